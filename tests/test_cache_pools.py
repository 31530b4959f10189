"""The runner-owned cache pools (issue 10): stored formats lose nothing, a decode step reads the caches as stored
and agrees bitwise with the prefill path, a step's work does not grow with the batch, and a replayed decode step
(the CUDA-graph path, here with the graph replaced by re-running the captured function) equals an eager one."""

import dataclasses
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer.engine.cuda_graphs import graph_batch_sizes
from deepinfer.kernels.torch.cache_formats import Fp4Codec, Fp8Codec
from deepinfer.kernels.torch.quant import fake_quant_fp4, fake_quant_fp8
from deepinfer.models import ForwardBatch, load_model
from deepinfer.models.cache import CacheLayout
from deepinfer.models.synthetic import config as synthetic_config
from emulated_graphs import EmulatedDecodeGraphs
from model_fixtures import FIXTURES


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stored_formats_decode_to_exactly_the_fake_quantised_values(dtype):
    x = (torch.randn(257, 512) * torch.logspace(-6, 3, 257)[:, None]).to(dtype)
    for codec, fake in ((Fp8Codec(), lambda t: fake_quant_fp8(t, 32)),
                        (Fp4Codec(16, True), lambda t: fake_quant_fp4(t, 16, True)),
                        (Fp4Codec(32, False), lambda t: fake_quant_fp4(t, 32, False))):
        parts = codec.encode(x)
        assert all(p.dtype == torch.uint8 for p in parts)
        assert torch.equal(codec.decode(*parts, dtype=dtype), fake(x)), codec.name


def test_cache_bytes_per_token_are_the_formats_minimum_at_flash_width():
    cfg = synthetic_config({"compress_ratios": [0, 0] + [2] * 18 + [1] * 20, "num_hidden_layers": 40,
                            "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24],
                            "candidate_source_layer_id": 20})
    layout = CacheLayout(cfg, torch.bfloat16, block_size=64)
    # MODEL_V41_SPEC §5.2: compressed KV 288 B/entry, indexer keys 68 B/entry; three ratio-2 sources and one ratio-1
    assert layout.bytes_per_token() == pytest.approx(3 * (288 + 68) / 2 + (288 + 68))
    assert layout.block_bytes() == 64 * layout.bytes_per_token()
    # fixed per sequence: 40 rings of 128 rows x 528 B (+ positions), 3 open groups of 1 row of fp32 (kv, gate)
    assert layout.slot_bytes() == 40 * 128 * 528 + 4 * 128 + 3 * 2 * 512 * 4 + 8 * 3  # + 3 Engram token ids


@pytest.fixture(scope="module")
def model():
    return load_model(FIXTURES / "tiny-engram-hc4")


def test_a_decode_step_through_the_stored_caches_equals_the_prefill_path_bitwise(model):
    rng = random.Random(0)
    ids = [rng.randrange(3, 512) for _ in range(70)]
    one_shot = model.forward(ForwardBatch([ids], [model.new_state()], all_logits=True))
    st = model.new_state()
    model.forward(ForwardBatch([ids[:40]], [st]))
    rows = [model.forward(ForwardBatch([[t]], [st])) for t in ids[40:]]  # decode-only steps: the decode op
    assert torch.equal(torch.cat(rows), one_shot[40:])


def test_decode_steps_write_their_window_rows_through_window_kv_and_prefill_steps_do_not(model):
    """The decode path's norm, rope, FP8 encode and ring writes are one op kind (one launch on the GPU); the prefill
    paths read the rings before the step's writes and keep the separate ops."""
    calls = []
    ops = model.ops
    spy = dataclasses.replace(ops, _fns=dict(ops._fns))
    spy._fns["window_kv"] = lambda kv, *rest: calls.append(kv.shape[0]) or ops.window_kv(kv, *rest)
    model.use_ops(spy)
    try:
        st = model.new_state()
        model.forward(ForwardBatch([[5, 6, 7]], [st]))
        assert calls == []
        model.forward(ForwardBatch([[8]], [st]))
    finally:
        model.use_ops(ops)
    assert calls == [1] * model.config.num_hidden_layers


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n, self.paused = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += not self.paused and not func.is_view  # views launch nothing (and vary with tensor strides)
        return func(*args, **(kwargs or {}))


def test_the_work_of_a_decode_step_does_not_grow_with_the_batch(model, monkeypatch):
    """Every op covers the whole batch: the op count of a decode step is the same at batch 1 and batch 9 (host
    packing included). Two torch references branch on data, not on the batch, and count as one op each here: the
    MoE loops over the experts a batch touches (the GPU's grouped GEMM is one launch) and the top-k sorts a row only
    when a tie straddles its k-th place (the GPU's radix select never branches)."""
    counter = CountOps()

    def opaque(fn):
        def run(*args, **kwargs):
            counter.paused = True
            try:
                return fn(*args, **kwargs)
            finally:
                counter.paused = False
        return run

    for kind in ("moe_experts", "index_topk_rows"):
        monkeypatch.setitem(model.ops._fns, kind, opaque(model.ops._fns[kind]))
    counts = {}
    for batch in (1, 9):
        states = [model.new_state() for _ in range(batch)]
        model.forward(ForwardBatch([[5 + i] * (20 + 7 * i) for i in range(batch)], states))
        counter.n = 0
        with counter:
            model.forward(ForwardBatch([[7]] * batch, states))
        counts[batch] = counter.n
    assert counts[1] == counts[9] > 0


def test_graph_batch_buckets_follow_deepinfers_spacing():
    assert graph_batch_sizes(64, 8) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_batch_sizes(5, 8) == [1, 2, 4, 5]
    assert graph_batch_sizes(1, 8) == [1]


# DecodeGraphs with the captured graph replaced by re-running what was recorded (no CUDA here): what is checked is
# everything around the graph (static buffers, padding rows, the spare slot and block)
ReplayedByRerun = EmulatedDecodeGraphs


def prefilled_twins(model, rng, pools: dict, batch: int, max_prompt: int, blocks_per_seq: int) -> dict:
    """The same `batch` random prompts prefilled into each of `pools` (same slots and blocks in each): name ->
    its SequenceCaches."""
    from deepinfer.models.cache import SequenceCache

    any_pools = next(iter(pools.values()))
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in [rng.randint(1, max_prompt) for _ in range(batch)]]
    slots = rng.sample(range(any_pools.num_slots), batch)
    blocks = list(range(any_pools.num_blocks))
    rng.shuffle(blocks)
    seqs = {}
    for name, p in pools.items():
        seqs[name] = [SequenceCache(p, s, blocks[blocks_per_seq * i: blocks_per_seq * (i + 1)])
                      for i, s in enumerate(slots)]
        model.forward(ForwardBatch(prompts, seqs[name]))
    return seqs


def test_a_replayed_decode_step_equals_the_eager_step_for_every_batch_size(model):
    rng = random.Random(1)
    layout = model.cache_layout(16)
    eager_pools = model.allocate_cache(12, 200, 16)
    graph_pools = model.allocate_cache(12, 200, 16)
    graphs = ReplayedByRerun(model, graph_pools, max_batch=12, interval=4, max_blocks=16)
    for batch in (1, 3, 4, 7, 12):
        seqs = prefilled_twins(model, rng, {"eager": eager_pools, "graph": graph_pools}, batch, 120, 16)
        for step in range(3):
            tokens = [[rng.randrange(3, 512)] for _ in range(batch)]
            want = model.forward(ForwardBatch(tokens, seqs["eager"]))
            got = graphs.run(tokens, seqs["graph"])
            assert got is not None and torch.equal(got, want), (batch, step)
    assert graphs.replays == 15 and {size for size, _, _ in graphs._graphs} == {1, 4, 8, 12}
    assert all(width in (1, 2, 4, 8, 16) for _, width, _ in graphs._graphs)
    assert layout.ring == model.config.sliding_window


def test_a_replayed_verification_step_equals_the_eager_step(model):
    """DSpark verification steps (every sequence an anchor + the same number of drafts, logits for each) replay
    graphs keyed by length too; between steps the sequences roll back rejected drafts as the runner does."""
    rng = random.Random(2)
    eager_pools = model.allocate_cache(8, 120, 16, max_rollback=6)
    graph_pools = model.allocate_cache(8, 120, 16, max_rollback=6)
    graphs = ReplayedByRerun(model, graph_pools, max_batch=8, interval=4, max_blocks=16, max_length=6)
    for batch, length in ((1, 6), (3, 2), (5, 6)):
        seqs = prefilled_twins(model, rng, {"eager": eager_pools, "graph": graph_pools}, batch, 90, 12)
        for step in range(3):
            tokens = [[rng.randrange(3, 512) for _ in range(length)] for _ in range(batch)]
            want = model.forward(ForwardBatch(tokens, seqs["eager"], num_logits=[length] * batch))
            got = graphs.run(tokens, seqs["graph"])
            assert got is not None and torch.equal(got, want), (batch, length, step)
            for a, b in zip(seqs["eager"], seqs["graph"]):
                back = rng.randint(0, length - 1)
                a.rollback(back)
                b.rollback(back)
    assert {key[2] for key in graphs._graphs} == {2, 6}


def test_decoding_rows_beside_a_prefill_chunk_take_the_decode_path_and_prompt_rows_never(model, monkeypatch):
    """A mixed step splits its rows (HostStep.split): the decoding sequence's row runs the decode op exactly as in a
    decode-only step, the prompt chunk's rows the slate path; a one-token prompt chunk is a prompt row. The result is
    bitwise the same as the sequences run apart (the CPU ops agree; the split is what keeps the GPU kernels' rows
    the same, tests/gpu/test_engine_batch_invariance.py)."""
    from deepinfer.models.attention import Attention

    rng = random.Random(1)
    a_ids, b_ids = [rng.randrange(3, 512) for _ in range(30)], [rng.randrange(3, 512) for _ in range(25)]
    alone_a = model.new_state()
    model.forward(ForwardBatch([a_ids[:29]], [alone_a]))
    want = model.forward(ForwardBatch([a_ids[29:]], [alone_a], decode_rows=[True]))
    calls = []
    decode = Attention._attend_decode

    def spy(self, q, kv_parts, meta, pools, rows=None):
        calls.append(None if rows is None else rows.tolist())
        return decode(self, q, kv_parts, meta, pools, rows)

    monkeypatch.setattr(Attention, "_attend_decode", spy)
    a, b = model.new_state(), model.new_state()
    model.forward(ForwardBatch([a_ids[:29]], [a]))
    model.forward(ForwardBatch([b_ids[:20]], [b]))
    calls.clear()
    got = model.forward(ForwardBatch([a_ids[29:], b_ids[20:]], [a, b], decode_rows=[True, False]))
    assert torch.equal(got[0], want[0])
    assert calls and all(c == [0] for c in calls)  # only the decoding sequence's row, in every layer
    calls.clear()
    c = model.new_state()
    model.forward(ForwardBatch([b_ids[:24]], [c]))
    model.forward(ForwardBatch([b_ids[24:]], [c], decode_rows=[False]))  # a prompt's last token, chunked alone
    assert calls == []


def test_pack_step_splits_only_when_told_which_rows_are_generated(model):
    from deepinfer.models.cache import SequenceCache, pack_step

    pools = model.allocate_cache(num_slots=2, num_blocks=4)
    seqs = [SequenceCache(pools, 0, [0]), SequenceCache(pools, 1, [1])]
    plain = pack_step([[5], [6, 7, 8]], seqs, pools.layout, "cpu")
    assert plain.split is None and not plain.decode_only
    told = pack_step([[5], [6, 7, 8]], seqs, pools.layout, "cpu", decode_rows=[True, False])
    assert [t.tolist() for t in told.split] == [[0], [1, 2, 3]] and not told.decode_only
    prompt = pack_step([[5], [6]], seqs, pools.layout, "cpu", decode_rows=[True, False])
    assert not prompt.decode_only and [t.tolist() for t in prompt.split] == [[0], [1]]
    assert pack_step([[5], [6]], seqs, pools.layout, "cpu", decode_rows=[True, True]).decode_only


def test_the_block_table_holds_each_sequence_s_blocks_then_the_fill():
    from types import SimpleNamespace

    from deepinfer.models.cache.metadata import block_table

    seqs = [SimpleNamespace(blocks=[7, 3, 9]), SimpleNamespace(blocks=[]), SimpleNamespace(blocks=[5, 1, 2, 8, 6])]
    assert block_table(seqs, 4, -1).tolist() == [[7, 3, 9, -1], [-1, -1, -1, -1], [5, 1, 2, 8]]
    assert block_table(seqs, 4, -1).dtype == torch.int64 and block_table([], 3, 0).shape == (0, 3)
