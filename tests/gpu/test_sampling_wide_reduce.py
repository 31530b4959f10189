"""On the GPU, the two-pass argmax and max of deepinfer.sampling.wide_reduce give torch's results bit for bit on
vocabulary-wide rows full of ties (the lowest index wins), eagerly and replayed from a CUDA graph (the DSpark
drafting graphs run it there)."""

import pytest
import torch

from deepinfer.sampling.wide_reduce import first_argmax, row_max

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_the_two_pass_argmax_and_max_are_torchs_on_the_gpu(rows):
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randint(-3, 4, (rows, 129280), device="cuda", generator=g).float()
    x[0, :-1] = float("-inf")  # the row's one finite value in its last chunk
    assert torch.equal(first_argmax(x), x.argmax(dim=-1))
    assert torch.equal(row_max(x), x.max(dim=-1).values)
    padded = torch.randn(rows, 129280 + 128, device="cuda", generator=g)[:, :129280]
    assert torch.equal(first_argmax(padded), padded.argmax(dim=-1))


def test_the_two_pass_argmax_replays_from_a_graph():
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randint(-3, 4, (4, 129280), device="cuda", generator=g).float()
    first_argmax(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = first_argmax(x)
    for _ in range(3):
        x.copy_(torch.randint(-3, 4, x.shape, device="cuda", generator=g).float())
        graph.replay()
        assert torch.equal(got, x.argmax(dim=-1))
