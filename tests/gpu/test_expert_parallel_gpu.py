"""The expert-parallel code path on one GPU (marker gpu): world size 1 with EP's dispatch on (an NCCL group of one
rank, the static-capacity buffers, the all-to-alls, the registered moe_experts op over the receive buffer, the
shared expert on its side stream, the engine's per-step agreement on a gloo group) is bitwise `single` through the
engine with DEEPINFER_BATCH_INVARIANT=1 and CUDA graphs on: greedy and seeded tokens and chosen-token logprobs, plain
decoding and DSpark (verification steps replay graphs of their own), and with the Engram tables in host memory
(mapped into the GPU's address space, gathered inside the graphs). Every decode step of the EP runs replayed a graph,
and the graphs were captured through the static path.

The model: synthetic DSPARK_FLASH (hidden 5120, 64 heads x 512, 384 FP4 experts top-6, every layer kind once, three
DSpark draft layers), random weights in the released formats, bf16, TileLang kernels preferred, built once with the
batch-invariant op set. The EP run and the single run share the model: only `model.expert_parallel` differs."""

import socket

import pytest
import torch

from ._helpers import FLASH_WIDTH

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              FLASH_WIDTH]

MAX_SEQS = 16
VOCAB_HI = 500


@pytest.fixture(scope="module")
def setup():
    import torch.distributed as dist

    from deepinfer.distributed import groups
    from deepinfer.distributed.expert_parallel import ExpertParallel
    from deepinfer.distributed.placement import ExpertPlacement
    from deepinfer.kernels import registry
    from deepinfer.models import synthetic

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    group = groups.init_group(0, 1, f"tcp://127.0.0.1:{port}", "cuda", timeout_s=120)
    agree = dist.new_group(backend="gloo")
    cfg = synthetic.config(synthetic.DSPARK_FLASH)
    model = synthetic.build_model(cfg, "cuda", torch.bfloat16, backends={"default": ["tilelang-sm90", "torch"]},
                                  seed=11, batch_invariant=True)
    assert registry.batch_invariant()
    ep = ExpertParallel(ExpertPlacement.initial(cfg.n_routed_experts, 1), 0, group)
    # decode steps of MAX_SEQS sequences x (1 + 3 drafts) tokens: the static path
    ep.plan_static(MAX_SEQS * 4, cfg.num_experts_per_tok, cfg.hidden_size, torch.bfloat16, "cuda", agree)
    # the build's freed blocks back to the driver: NCCL allocates its all-to-all buffers outside torch's cache (on an
    # 80 GB card the cache otherwise holds what NCCL needs: 'Cuda failure 2 out of memory' in the first variable step)
    torch.cuda.empty_cache()
    yield model, ep
    registry.OpSet.build("cuda", ["torch"], batch_invariant=False)
    del model
    groups.destroy()
    torch.cuda.empty_cache()


def _requests():
    from deepinfer import SamplingParams

    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 300, (12,), generator=g).tolist()
    prompts = [torch.randint(3, VOCAB_HI, (n,), generator=g).tolist() for n in lengths]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, max_tokens=4 + i % 7, ignore_eos=True, logprobs=True,
                             seq_seed=None if i % 2 else 100 + i) for i in range(len(prompts))]
    return prompts, params


def _run(model, ep, drafts: int = 0):
    """The requests through the engine, graphs on; `ep`: the EP code path (None: single). Returns (tokens and
    logprobs per request, metrics, the runner's decode graphs)."""
    from deepinfer.config.schema import Settings
    from deepinfer.engine import EngineOptions
    from deepinfer.engine.backend import backend_from_model
    from deepinfer.frontend import LLMEngine

    model.expert_parallel = ep
    prompts, params = _requests()
    opts = EngineOptions.for_settings(Settings(), max_num_seqs=MAX_SEQS, max_num_batched_tokens=1024,
                                      memory_budget=8 << 30, process="inproc", enforce_eager=False,
                                      num_draft_tokens=drafts, seed=0)
    try:
        with LLMEngine(lambda: backend_from_model(model, batch_invariant=True), opts) as engine:
            outs = engine.generate(prompts, params, use_tqdm=False)
            runner = engine.client.core.runner
            assert (runner._ep is ep) if ep is not None else runner._ep is None
            results = []
            for o in outs:
                assert o.error is None, o.error
                results.append((o.token_ids, [lp.logprob for lp in o.logprobs]))
            return results, engine.last_metrics, runner.graphs
    finally:
        model.expert_parallel = None


def _static_captures(monkeypatch):
    """Counts the MoE layer calls that ran the static path while a graph was being captured."""
    from deepinfer.models import deepseek_v41

    seen = []
    inner = deepseek_v41.ep_moe_experts

    def spy(*args, buffers=None, **kwargs):
        if torch.cuda.is_current_stream_capturing():
            seen.append(buffers is not None)
        return inner(*args, buffers=buffers, **kwargs)

    monkeypatch.setattr(deepseek_v41, "ep_moe_experts", spy)
    return seen


def test_an_ep_moe_layer_is_bitwise_the_op_in_the_batch_invariant_mode(setup):
    """The layer alone, both dispatch paths (the engine test below needs this to hold in every layer)."""
    from deepinfer.distributed.ep_dispatch import StepPath

    model, ep = setup
    g = torch.randn(37, model.config.hidden_size, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    g = g.bfloat16()
    want = model._moe(g, model.layers[0].ffn, 0)
    model.expert_parallel = ep
    try:
        got = {}
        for static in (True, False):
            with ep.pin(StepPath(static, 0, g.shape[0] if static else 0)):
                ep.begin_forward(g.shape[0])
            got[static] = model._moe(g, model.layers[0].ffn, 0)
    finally:
        model.expert_parallel = None
    assert torch.equal(got[True], want), (got[True].float() - want.float()).abs().max().item()
    assert torch.equal(got[False], want), (got[False].float() - want.float()).abs().max().item()


@pytest.mark.parametrize("drafts", [0, 3])
def test_ep_on_one_gpu_is_bitwise_single_with_graphs(setup, monkeypatch, drafts):
    model, ep = setup
    want, m_single, _ = _run(model, None, drafts)
    assert m_single["graph_steps"] > 0, m_single
    captured = _static_captures(monkeypatch)
    got, m_ep, graphs = _run(model, ep, drafts)
    assert captured and all(captured), "the EP graphs were not captured through the static path"
    assert m_ep["graph_steps"] == m_single["graph_steps"] and graphs.replays == m_ep["graph_steps"], (m_ep, m_single)
    assert not graphs.failures(), graphs.failures()
    for i, (a, b) in enumerate(zip(want, got)):
        assert b[0] == a[0], f"request {i}: tokens differ under EP ({b[0]} vs {a[0]})"
        assert b[1] == a[1], f"request {i}: logprobs differ under EP"  # bitwise: float equality
    if drafts:
        assert m_ep["speculative"]["verifications"] > 0


def test_ep_with_engram_tables_in_host_memory_is_bitwise_single(setup):
    """Last: the tables leave the device for good (keep_engram_on_host)."""
    model, ep = setup
    want, _, _ = _run(model, None)
    model.keep_engram_on_host()
    assert model.engram_host is not None and all(t.codes.is_pinned() for t in model.engram_host.tables)
    got, m, graphs = _run(model, ep)
    assert got == want
    assert m["graph_steps"] > 0 and not graphs.failures(), (m, graphs.failures())
