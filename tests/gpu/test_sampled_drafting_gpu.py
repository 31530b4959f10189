"""DSpark's choice of drafts for sampled requests, captured in a CUDA graph (deepinfer.sampling.static_drafts): the
token and the draft distribution q of every row equal eager DraftChooser's on the same CUDA logits, bit for bit,
after capture and at every replay with new logits and new parameters (a 129,280-wide row: Flash's padded head;
the "cut" mode's full stable sort inside the graph)."""

import pytest
import torch

from deepinfer.sampling import SamplingParams
from deepinfer.sampling.speculative import DraftChooser, DraftRequest
from deepinfer.sampling.static_drafts import StaticDraftChooser

pytestmark = pytest.mark.gpu

WIDTH, VOCAB, BLOCK, ROWS = 129_280, 129_000, 3, 8


def _params(round_: int, cut: bool):
    """Greedy and sampled rows; top-k/top-p only for the graphs captured with the cut."""
    t = 0.5 + 0.25 * round_
    k, p = (40, 0.9) if cut else (-1, 1.0)
    return [SamplingParams(temperature=t, top_k=k), SamplingParams(temperature=0.0),
            SamplingParams(temperature=t, top_p=p, min_p=0.02), SamplingParams(temperature=t + 0.3),
            SamplingParams(temperature=t, top_k=k // 5, top_p=p - 0.3 * cut)]


@pytest.mark.parametrize("cut", [False, True], ids=["sampled", "cut"])
def test_a_captured_sampled_choice_is_the_eager_choice(cut):
    g = torch.Generator(device="cuda").manual_seed(11)
    static = StaticDraftChooser(ROWS, BLOCK, VOCAB, torch.device("cuda"))
    logits = torch.zeros(ROWS, WIDTH, device="cuda")
    pick = static.choose(cut)
    first = DraftChooser([DraftRequest(p, 100 + r, 4) for r, p in enumerate(_params(0, cut))], VOCAB)
    static.fill(first, ROWS)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        [pick(i, logits) for i in range(BLOCK)]  # warm-up: allocates the weights buffer outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.stack([pick(i, logits) for i in range(BLOCK)], 1)
    for round_ in range(3):
        ps = _params(round_, cut)
        chooser = DraftChooser([DraftRequest(p, 7 * round_ + r, 4 + round_) for r, p in enumerate(ps)], VOCAB)
        static.fill(chooser, ROWS)
        logits.copy_(torch.randn(ROWS, WIDTH, device="cuda", generator=g) * 3)
        logits[:, :64] = logits[:, :64].round() + 10  # ties at the top: top-k's cut among equal logits
        graph.replay()
        static.hand_over(chooser)
        eager = DraftChooser([DraftRequest(p, 7 * round_ + r, 4 + round_) for r, p in enumerate(ps)], VOCAB)
        want = torch.stack([eager(i, logits[: len(ps)]) for i in range(BLOCK)], 1)
        assert torch.equal(out[: len(ps)], want), round_
        for r in range(len(ps)):
            for got, exp in zip(chooser.weights[r], eager.weights[r]):
                assert (got is None) == (exp is None)
                if exp is not None:
                    assert torch.equal(got, exp), (round_, r)
