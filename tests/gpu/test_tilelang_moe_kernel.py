"""The grouped expert GEMM (kernels/tilelang/moe_kernel.py) vs the torch reference ops on fresh random inputs
(marker gpu): the whole MoE through moe.moe_experts_packed (routing table, side-stream launch) against
deepinfer.kernels.torch.moe.moe_experts and float64 math, FP4 and FP8 routed experts, with
and without the FP8 shared expert; and the two kernels alone at every token tile and with split K."""

import pytest
import torch

from deepinfer.kernels.packed_experts import pack_experts
from deepinfer.kernels.torch import moe as ref

from ._helpers import fp4_rows, fp8_blocks, poison_allocator, rel_err

pytestmark = pytest.mark.gpu

SHAPES = [(16, 1024, 512), (8, 5120, 2304)]  # (experts, hidden, inter); the second is the released width
TOKENS = [1, 5, 64, 300]
TOP_K = 6
LIMIT = 10.0


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _experts(E, D, I, fmt, g):
    """Random checkpoint tensors for E experts (on g's device) and their dequantised bf16 (w1, w2, w3)."""
    w1, s1, w3, s3, w2, s2, dense = [], [], [], [], [], [], []
    make = fp4_rows if fmt == "fp4" else fp8_blocks
    for _ in range(E):
        a, sa, da = make(I, D, g)
        b, sb, db = make(I, D, g)
        c, sc, dc = make(D, I, g)
        w1.append(a); s1.append(sa); w3.append(b); s3.append(sb); w2.append(c); s2.append(sc)
        dense.append(tuple(t.bfloat16().cuda() for t in (da, dc, db)))
    return pack_experts(fmt, w1, s1, w3, s3, w2, s2), dense


def _cases():
    out = []
    for E, D, I in SHAPES:  # tokens innermost: one weight set serves four cases
        for fmt in ("fp4", "fp8"):
            for with_shared in (True, False):
                for tokens in TOKENS:
                    out.append((E, D, I, tokens, fmt, with_shared, False))
    out.append((16, 1024, 512, 40, "fp4", True, True))  # every token on the same experts: the chunk loop
    # prefill sizes: the shared expert through cuBLAS, the routing table from torch's sorts
    out.append((16, 1024, 512, 1100, "fp4", True, False))
    return out


CASES = _cases()
_WEIGHTS = {}


def _weights(E, D, I, fmt, with_shared):
    key = (E, D, I, fmt, with_shared)
    if key not in _WEIGHTS:
        _WEIGHTS.clear()  # one weight set at a time: the released-width ones are ~1 GB with their bf16 copies
        gd = torch.Generator(device="cuda").manual_seed(E * 1000 + D + (fmt == "fp8"))
        routed, dense = _experts(E, D, I, fmt, gd)
        shared = shared_dense = None
        if with_shared:
            shared, sd = _experts(1, D, I, "fp8", gd)
            shared_dense = sd[0]
        _WEIGHTS[key] = (routed, dense, shared, shared_dense)
    return _WEIGHTS[key]


@pytest.fixture(scope="module", autouse=True)
def _precompile():
    """Build every kernel the cases below need on a thread pool first (52 of them on a cold machine)."""
    from deepinfer.kernels.packed_experts import PackedExperts
    from deepinfer.kernels.tilelang import moe as moe

    def fake(fmt, E, D, I):  # specs depend on shapes only
        t = torch.empty(0)
        return PackedExperts(fmt, t.new_empty(E, 2 * I, 0), t, t.new_empty(E, D, 0), t)

    specs = []
    for E, D, I, tokens, fmt, with_shared, _ in CASES:
        shared = fake("fp8", 1, D, I) if with_shared else None
        specs += moe.experts_specs(fake(fmt, E, D, I), shared, tokens, min(TOP_K, E))
    specs += _kernel_specs()
    moe.precompile(specs)


@pytest.mark.parametrize("E,D,I,tokens,fmt,with_shared,skew", CASES)
def test_experts_match_torch(E, D, I, tokens, fmt, with_shared, skew):
    from deepinfer.kernels.tilelang.moe import moe_experts_packed

    routed, dense, shared, shared_dense = _weights(E, D, I, fmt, with_shared)
    g = _gen(E * 1000 + tokens + 7 * with_shared)
    k = min(TOP_K, E)
    x = torch.randn(tokens, D, generator=g).bfloat16().cuda()
    if skew:
        idx = torch.arange(k).repeat(tokens, 1)
    else:
        idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
    idx = idx.cuda()
    weights = torch.rand(tokens, k, generator=g).cuda() + 0.1
    poison_allocator()
    out = moe_experts_packed(x, weights, idx, routed, shared, LIMIT)
    torch.cuda.synchronize()
    expect = ref.moe_experts(x, weights, idx, dense, shared_dense, LIMIT)
    assert out.shape == expect.shape and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    # same bf16 rounding points as the reference; what remains is fp32 summation order -> well under 1e-2
    assert rel_err(out, expect) < 1e-2, rel_err(out, expect)
    # against float64 math on the same dequantised weights (per expert, all its tokens at once)
    x64 = x.double()
    y64 = torch.zeros(tokens, D, dtype=torch.float64, device=x.device)

    def ffn64(xs, w1_, w2_, w3_, scale):
        gate = (xs @ w1_.double().T).clamp(max=LIMIT)
        up = (xs @ w3_.double().T).clamp(-LIMIT, LIMIT)
        return (torch.nn.functional.silu(gate) * up * scale) @ w2_.double().T

    for e in torch.unique(idx).tolist():
        t, j = torch.where(idx == e)
        y64.index_add_(0, t, ffn64(x64[t], *dense[e], weights[t, j, None].double()))
    if with_shared:
        y64 += ffn64(x64, *shared_dense, 1.0)
    assert rel_err(out, y64) < 1e-2


@pytest.mark.parametrize("E,D,I", SHAPES)
@pytest.mark.parametrize("with_shared", [True, False])
def test_the_warp_streamed_passes_match_torch_and_the_grouped_gemm(E, D, I, with_shared, monkeypatch):
    """moe.WARP_STREAM (moe_warp_kernel.py) at one token: the same op as the grouped GEMM's, within the reference's
    rounding of the grouped GEMM's result, and against torch; replayed from a CUDA graph (no host reads)."""
    from deepinfer.kernels.tilelang import moe, moe_warp_kernel

    routed, dense, shared, shared_dense = _weights(E, D, I, "fp4", with_shared)
    k = min(TOP_K, E)
    for seed in range(3):
        g = _gen(seed + 100)
        x = torch.randn(1, D, generator=g).bfloat16().cuda()
        idx = torch.randperm(E, generator=g)[:k][None].cuda()
        weights = torch.rand(1, k, generator=g).cuda() + 0.1
        assert moe.routed_specs(routed, 1, k)[0][0] is moe_warp_kernel.build_fp4_warp_gemm
        monkeypatch.setattr(moe, "WARP_STREAM", 0)
        grouped = moe.moe_experts_packed(x, weights, idx, routed, shared, LIMIT)
        monkeypatch.setattr(moe, "WARP_STREAM", 1)
        poison_allocator()
        out = moe.moe_experts_packed(x, weights, idx, routed, shared, LIMIT)
        expect = ref.moe_experts(x, weights, idx, dense, shared_dense, LIMIT)
        assert torch.isfinite(out).all() and rel_err(out, expect) < 1e-2, rel_err(out, expect)
        assert rel_err(out, grouped) < 1e-2, rel_err(out, grouped)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = moe.moe_experts_packed(x, weights, idx, routed, shared, LIMIT)
    graph.replay()
    torch.cuda.synchronize()
    # the same call replayed: equal but for the order of the fp32 atomics that sum a token's experts
    assert torch.isfinite(replayed).all() and rel_err(replayed, out) < 1e-3


# ------------------------------------------------------------------------------------------ kernels alone
KD, KI, KE = 512, 768, 4  # small shapes: K of the down pass = 768 = 3 steps of 256, so it splits in 3
# (token tile, weight rows per block): 128 rows up to 32 tokens (64 tokens x 128 rows exceed shared memory)
TILES = [(8, 64), (16, 64), (32, 64), (64, 64), (8, 128), (16, 128), (32, 128)]


def _kernel_specs():
    from deepinfer.kernels.tilelang import moe as moe

    out = []
    for fmt in ("fp4", "fp8"):
        for bt, bn in TILES:
            bk, st = moe.pass_config(fmt, KD, bt, bn)
            out.append((moe.build_grouped_gemm, fmt, "swiglu", KE, 2 * KI, KD, bn, bt, bk, 2 * bn, st, True, 1, 0))
            bk, st = moe.pass_config(fmt, KI, bt, bn)
            for splits in (1, 3):
                out.append((moe.build_grouped_gemm, fmt, "add", KE, KD, KI, bn, bt, bk, 2 * bn, st, False, splits, 0))
    return out


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
@pytest.mark.parametrize("block_t,block_n", TILES)
def test_kernels_each_tile(fmt, block_t, block_n):
    """Up (SwiGLU epilogue) and down ("add" epilogue, whole K and split in 3) at one token tile and block height
    (64 weight rows: one warpgroup; 128: two), against torch with the same bf16 rounding points; 37 tokens x top-2
    over 4 experts: every expert spans several chunks at the small tiles, and a partial chunk at the large ones."""
    _check_tile(fmt, block_t, block_n)


@pytest.mark.parametrize("block_t,block_n", [(8, 64), (16, 128)])
def test_fp4_kernels_in_128_k_steps(block_t, block_n):
    """The same with FP4 steps of 128 K over 8 stages (64-byte weight rows, their own swizzle; moe_gpu.py's
    "fp4 bk128 stages8")."""
    _check_tile("fp4", block_t, block_n, (128, 8))


@pytest.mark.parametrize("config", [(256, 8), (128, 16)])
def test_fp8_kernels_with_their_steps_split_into_more_stages(config):
    """The shared expert's format with moe.FP8_STAGE_SPLIT's shapes (2: 256 x 8, 4: 128 x 16; fewer steps than
    stages here, so the prologue's guard is exercised too)."""
    _check_tile("fp8", 8, 64, config)


def pass_references(x, table, dense, h):
    """(h_ref, y_ref) of an up / down pass pair over `table` with the same rounding points as the kernels: h per
    assignment position in the table's (expert-sorted) order, and y from the kernel's own h (so the down pass is
    checked alone)."""
    rows, aw, s_exp, s_start, s_cnt = table
    h_ref = torch.empty_like(h)
    y_ref = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for s in range(s_exp.shape[0]):
        e, a, n = int(s_exp[s]), int(s_start[s]), int(s_cnt[s])
        if n == 0:
            continue
        w1, w2, w3 = dense[e]
        xs = x[rows[a:a + n].long()]
        gate = (xs @ w1.T).float().clamp(max=LIMIT)
        up = (xs @ w3.T).float().clamp(-LIMIT, LIMIT)
        h_ref[a:a + n] = (torch.nn.functional.silu(gate) * up * aw[a:a + n, None]).bfloat16()
        y_ref.index_add_(0, rows[a:a + n].long(), (h[a:a + n] @ w2.T).float())
    return h_ref, y_ref


def _check_tile(fmt, block_t, block_n, config=None):
    from deepinfer.kernels.tilelang import moe as moe
    from deepinfer.kernels.tilelang._build import jit

    routed, dense = _experts(KE, KD, KI, fmt, torch.Generator(device="cuda").manual_seed(block_t))
    g = _gen(block_t + (fmt == "fp8"))
    T_, k = 37, 2
    x = torch.randn(T_, KD, generator=g).bfloat16().cuda()
    idx = torch.stack([torch.randperm(KE, generator=g)[:k] for _ in range(T_)]).cuda()
    weights = (torch.rand(T_, k, generator=g) + 0.1).cuda()
    table = moe.routing_table(idx, weights, KE)
    poison_allocator()
    h = torch.empty(T_ * k, KI, dtype=torch.bfloat16, device="cuda")
    bk, st = config or moe.pass_config(fmt, KD, block_t, block_n)
    jit(moe.build_grouped_gemm, fmt, "swiglu", KE, 2 * KI, KD, block_n, block_t, bk, 2 * block_n, st, True, 1, 0)(
        x, *table, routed.w13, routed.s13, h, LIMIT)
    torch.cuda.synchronize()
    h_ref, y_ref = pass_references(x, table, dense, h)
    assert torch.isfinite(h).all() and rel_err(h, h_ref) < 1e-2, rel_err(h, h_ref)
    bk, st = config or moe.pass_config(fmt, KI, block_t, block_n)
    for splits in (1, 3):
        y = torch.zeros(T_, KD, dtype=torch.float32, device="cuda")
        jit(moe.build_grouped_gemm, fmt, "add", KE, KD, KI, block_n, block_t, bk, 2 * block_n, st, False, splits, 0)(
            h, *table, routed.w2, routed.s2, y, LIMIT)
        torch.cuda.synchronize()
        assert torch.isfinite(y).all() and rel_err(y, y_ref) < 5e-3, (splits, rel_err(y, y_ref))


@pytest.mark.parametrize("tokens", [1, 6, 85, 341, 342, 1100, 2047])
def test_the_prep_kernel_and_the_torch_table_agree(tokens):
    """moe_prep_kernel (up to moe.PREP_KERNEL_ASSIGNMENTS) and moe_table's sorts (beyond) build the same table, so
    the switch between them changes no output; -1 (no expert) entries included."""
    from deepinfer.kernels.tilelang import moe as moe
    from deepinfer.kernels.tilelang._build import jit
    from deepinfer.kernels.tilelang.moe_table import routing_table_torch

    E, k = 384, TOP_K
    g = _gen(tokens)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
    idx.view(-1)[torch.randperm(idx.numel(), generator=g)[:tokens // 7]] = -1
    idx, weights = idx.cuda(), torch.rand(tokens, k, generator=g).cuda()
    n_slots = min(E, tokens * k)
    rows = torch.empty(tokens * k, dtype=torch.int32, device="cuda")
    aw = torch.empty(tokens * k, dtype=torch.float32, device="cuda")
    slots = [torch.empty(n_slots, dtype=torch.int32, device="cuda") for _ in range(3)]
    jit(moe.build_moe_prep, E, k)(idx, weights, rows, aw, *slots)
    t_rows, t_aw, *t_slots = routing_table_torch(idx, weights, E)
    n = int((idx >= 0).sum())
    assert torch.equal(rows[:n], t_rows[:n]) and torch.equal(aw[:n], t_aw[:n])
    for a, b in zip(slots, t_slots):
        assert torch.equal(a, b)


@pytest.mark.parametrize("tokens", [1, 8, 85, 256, 2047, 2100])
def test_the_routing_table_launch_zeroes_the_moe_output_and_builds_the_same_table(tokens):
    """routing_table(..., zero=y): the prep kernel's extra blocks zero y (poisoned with NaN first) and block 0's table
    is the plain kernel's; beyond moe_prep's size (2,100 tokens) the torch table and a zero fill."""
    from deepinfer.kernels.tilelang import moe as moe

    E, k, D = 384, TOP_K, 5120
    g = _gen(tokens + 1)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)]).cuda()
    weights = torch.rand(tokens, k, generator=g).cuda()
    y = torch.full((tokens, D), float("nan"), device="cuda")
    table = moe.routing_table(idx, weights, E, zero=y)
    plain = moe.routing_table(idx, weights, E)
    torch.cuda.synchronize()
    assert torch.equal(y, torch.zeros_like(y))
    for a, b in zip(table, plain):
        assert torch.equal(a, b)
