"""Registry-facing MoE ops (`moe_router`, `moe_experts`) and the fast path `moe_experts_packed` over packed FP4/FP8
expert weights: the launchers and tile policy of moe_router_kernel, moe_prep_kernel and moe_kernel.

`moe_experts` keeps the torch op's signature. Its fast path needs the experts in the released quantised format,
stacked once at load time (`PackedExperts`, deepinfer.kernels.packed_experts; the model holds experts this way on
CUDA); a plain list of dequantised (w1, w2, w3) tensors cannot be streamed by one grouped kernel, so it goes to
the torch reference.

What varies with the batch unless the registry's batch-invariant mode is on: the token tiles (router and experts)
follow the token count, and a token's routed experts and the shared expert add into one fp32 buffer with atomics in
no fixed order. In the batch-invariant mode the tiles are fixed and every (token, expert) contribution is written to
its own row, then summed per token in a fixed order (routed experts by ascending id, then the shared expert:
the torch op's order).
"""

import functools

import torch

from deepinfer.kernels import registry
from deepinfer.kernels.packed_experts import BLOCK_N, PackedExperts, pack_experts  # noqa: F401 (re-export)
from deepinfer.kernels.torch import moe as torch_moe

from ._build import jit, precompile  # noqa: F401 (precompile: warm-up with experts_specs)
from . import moe_prefill
from ._fallback import reason
from .moe_kernel import THREADS, build_grouped_gemm, shared_bytes
from . import moe_bulk_kernel, moe_warp_kernel
from .moe_prep_kernel import build_moe_prep
from .moe_table import routing_table_torch
from .shared_expert import shared_expert
from .swiglu_kernel import build_swiglu_halves
from .moe_router_kernel import SCORES, build_router_logits, build_router_topk

INVARIANT_ROUTED_BT, INVARIANT_SHARED_BT = 16, 64  # token tiles of the batch-invariant mode
# routing tables of more (token, expert) pairs are built by torch's sorts. moe_prep took 47 / 52 / 116 us less
# than the sorts at 384 / 512 / 1,024 tokens on the H200 (benchmarks/results/moe_gpu_prep_sweep*_h200.log; the
# gap widening), so it serves every size below the 2,048 tokens from which moe_prefill takes FP4 experts (12,288
# assignments at top-6; 1,024-2,047 tokens not measured)
PREP_KERNEL_ASSIGNMENTS = 12288
# tokens from which the shared expert runs dequantised through cuBLAS (as linear.py's projections from DENSE_ROWS)
SHARED_DENSE_TOKENS = 1024
PREP_ZEROES_OUTPUT = 1  # the routing table's launch zeroes the fp32 output (0: a fill launch; for A/B runs)
# the routed (FP4) passes' K step and stages: 256 x 4 as the H200 has run them; 128 x 8 keeps 5 stages in flight
# across each barrier instead of 1 in the same shared memory (moe_gpu.py "fp4 bk128 stages8"; for A/B runs)
FP4_BLOCK_K, FP4_STAGES = 256, 4
# the shared (FP8) expert's steps cut by this factor and its stages multiplied by it (1: as run): a few dozen
# blocks stream the whole expert at decode, each with one 32 KB step in flight across a barrier; at 2 (256 x 8)
# five 16 KB steps, at 4 (128 x 16) thirteen 8 KB ones, in the same shared memory (for A/B runs)
FP8_STAGE_SPLIT = 1
# 1: at one token a call, the routed FP4 passes stream each warp's rows through its own cp.async ring
# (moe_warp_kernel.py, mma.sync, no barrier in the K loop); 0: the grouped GEMM. The 40-layer B=1 step ran 10.92 ->
# 10.69 ms with it, the MoE op alone 76.4 -> 72.6 us (one H100, moe_gpu_warp_s29_h100.log, decode_gpu_warp_s29_h100)
WARP_STREAM = 1
# calls of 2 to this many tokens take moe_bulk_kernel for the routed FP4 passes (0: never): a producer warp's tensor
# copies (the TMA engine, one 8 KB box a stage) feed 4 math warps through mbarriers, a slot's tokens the MMA's
# columns. The 40-layer step at 4K, B=8 / 64: 21.90 -> 20.96 ms / 84.46 -> 79.63 ms, the MoE op 341.0 -> 317.6 us /
# 1686.4 -> 1582.9 us (one H100, decode_gpu_flash40_bulk_s42_h100); B=256 at 4K / 32K: 152.44 -> 140.03 ms /
# 163.64 -> 150.00 ms with 3 stages of 8 tokens (decode_gpu_flash40_bulk38_s43_h100). At 384 tokens (DSpark's
# verification at B=64) the grouped GEMM's op ties it (3159 against 3203 us, moe_gpu_bulk_beyond64_s43_h100)
BULK_TOKENS = 256
# tokens from which the router's logits run as one K split (0: never). The 20 splits spread the gate's 3.9 MB over
# the GPU at decode; an 8K prefill chunk has 768 token x expert tiles to fill it without them, while 20 splits write
# and re-read 252 MB of fp32 partials. router_logits_kernel in a 40-layer 32K prefill: 46.5 -> 18.1 ms, the prefill
# 3243 -> 3229 ms (one H100, prefill_gpu_flash40_router_s34_h100). The batch-invariant mode keeps the splits (a
# token's sum order then does not depend on the batch)
ROUTER_ONE_SPLIT_TOKENS = 1024


# ---------------------------------------------------------------------------------------------- router
def _router_splits(dim: int, tokens: int, block_k: int = 256, most: int = 20) -> int:
    if ROUTER_ONE_SPLIT_TOKENS and tokens >= ROUTER_ONE_SPLIT_TOKENS and not registry.batch_invariant():
        return 1
    steps = dim // block_k
    return max(s for s in range(1, most + 1) if steps % s == 0)


def moe_router(x, gate_weight, bias, top_k, scoring_func, gate_temp, norm_topk_prob, routed_scaling_factor):
    """Same contract as deepinfer.kernels.torch.moe.moe_router. Kernel path: bf16 x and gate weight,
    sqrtsoftplus or sigmoid scoring, experts a multiple of 64, hidden a multiple of 256; else the torch op."""
    E, D = gate_weight.shape
    fast = (x.is_cuda and x.dtype == torch.bfloat16 and gate_weight.dtype == torch.bfloat16 and scoring_func in SCORES
            and E % 64 == 0 and D % 256 == 0 and E <= 1024 and x.shape[0] > 0 and (bias is None or bias.dim() == 1))
    if not fast:
        why = reason(x, f"scoring {scoring_func}" if scoring_func not in SCORES else
                     "a per-token bias (image spans)" if bias is not None and bias.dim() == 2 else
                     "experts or hidden not covered")
        return registry.fall_back("moe_router", why, torch_moe.moe_router, x, gate_weight, bias, top_k,
                                  scoring_func, gate_temp, norm_topk_prob, routed_scaling_factor)
    x = x.contiguous()
    T_ = x.shape[0]
    splits = _router_splits(D, T_)
    block_t = 16 if T_ <= 16 or registry.batch_invariant() else 64
    part = torch.empty(splits, T_, E, dtype=torch.float32, device=x.device)
    jit(build_router_logits, E, D, block_t, 256, splits)(x, gate_weight.contiguous(), part)
    if bias is None:
        bias = torch.zeros(E, dtype=torch.float32, device=x.device)
    weights = torch.empty(T_, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(T_, top_k, dtype=torch.int64, device=x.device)
    jit(build_router_topk, E, splits, top_k, scoring_func, bool(norm_topk_prob))(
        part, bias.float().contiguous(), weights, ids, 1.0 / float(gate_temp), float(routed_scaling_factor))
    return weights, ids


# ---------------------------------------------------------------------------------------------- tile policy
def routed_block_t(n_tok: int, top_k: int, n_experts: int) -> int:
    """Token tile for the routed pass: about twice the mean tokens per expert, so few experts need a second
    chunk (each chunk streams the expert's weights again)."""
    if registry.batch_invariant():
        return INVARIANT_ROUTED_BT
    mean = n_tok * top_k / n_experts
    return next((b for b in (8, 16, 32) if mean <= b / 2), 64)


def routed_block_n(block_t: int) -> int:
    """Weight rows per block of the routed pass: two warpgroups (128 rows) share one activation tile at 16 and 32
    tokens, where a 64-row block's activations take as much shared memory as its weights or more (64 tokens x
    128 rows do not fit 4 stages)."""
    return 128 if block_t in (16, 32) else 64


def routed_down_splits(n_tok: int, top_k: int, n_experts: int) -> int:
    """K splits of the routed down pass (fp32 atomics add the partials: never in the batch-invariant mode, whose
    rows must each be one rounded value). 1 until a GPU sweep (benchmarks/moe_gpu.py --sweep, "routed-down
    split3") says where shorter chains of K steps win: at batch 1 a block walks all 9 K steps of its 64 rows."""
    return 1


def shared_block_t(n_tok: int) -> int:
    """Token tile for the shared expert (one slot per tile: _shared_table)."""
    if registry.batch_invariant():
        return INVARIANT_SHARED_BT
    return next((b for b in (8, 16, 32) if n_tok <= b), 64)


def pass_config(fmt: str, k_dim: int, block_t: int, block_n: int = BLOCK_N) -> tuple[int, int]:
    """(block_k, num_stages) of one pass. Four stages everywhere: with them the activation threads' proxy fence
    has no cp.async of its own in flight, and the weight threads keep one stage in flight across each barrier
    (moe_kernel's K loop; whether a fifth stage pays for a block fewer per SM now that the weight threads never
    fence is `moe_gpu.py --variants "fp4 stages5"`'s question). FP4 (routed): 256-K steps, 8.5 KB
    of weights each, ~53 KB per block at block_t 8, so 4 blocks (16 warps) share an SM. FP8 (the shared expert: one
    expert, 72-80 blocks per token tile, the longest chain at decode): the largest step dividing K that keeps 4
    stages within ~220 KB, so each of its few blocks keeps 16-32 KB in flight."""
    if fmt == "fp4":
        return FP4_BLOCK_K, FP4_STAGES
    for bk in (512, 256, 128):
        if k_dim % bk == 0 and shared_bytes(fmt, block_t, bk, 4, block_n) <= 220 * 1024:
            f = max(1, min(FP8_STAGE_SPLIT, bk // 128))
            return bk // f, 4 * f
    return 128, 4


def ffn_specs(p: PackedExperts, block_t: int, down_splits: int = 1, block_n: int = BLOCK_N):
    """jit(...) argument tuples of the up (+SwiGLU) and down passes of PackedExperts p at one token tile."""
    E, I, D = p.n_experts, p.inter, p.hidden
    bn = block_n if 2 * I % block_n == 0 and D % block_n == 0 else BLOCK_N
    th = THREADS * bn // BLOCK_N
    bk, st = pass_config(p.fmt, D, block_t, bn)
    up = (build_grouped_gemm, p.fmt, "swiglu", E, 2 * I, D, bn, block_t, bk, th, st, True, 1, 0)
    bk, st = pass_config(p.fmt, I, block_t, bn)
    down = (build_grouped_gemm, p.fmt, "add", E, D, I, bn, block_t, bk, th, st, False, down_splits, 0)
    return up, down


def warp_fits(p: PackedExperts) -> bool:
    """Whether moe_warp_kernel tiles the FP4 experts p (64-row tiles, 256-K steps)."""
    bk = moe_warp_kernel.BLOCK_K
    return (p.fmt == "fp4" and (2 * p.inter) % moe_warp_kernel.ROWS == 0 and p.hidden % moe_warp_kernel.ROWS == 0
            and p.hidden % bk == 0 and p.inter % bk == 0
            and moe_warp_kernel.shared_bytes(p.hidden) <= 227 * 1024)


def bulk_fits(p: PackedExperts) -> bool:
    """Whether moe_bulk_kernel tiles the FP4 experts p (64-row tiles, 256-K steps, the scales' bulk copy in
    16-byte multiples)."""
    bk = moe_bulk_kernel.BLOCK_K
    return (p.fmt == "fp4" and (2 * p.inter) % moe_bulk_kernel.ROWS == 0 and p.hidden % moe_bulk_kernel.ROWS == 0
            and p.hidden % bk == 0 and p.inter % bk == 0 and (moe_bulk_kernel.ROWS * p.inter // 32) % 16 == 0
            and moe_bulk_kernel.shared_bytes(p.hidden) <= 227 * 1024)


def routed_specs(p: PackedExperts, n_tok: int, top_k: int):
    """ffn_specs of the routed pass at n_tok tokens: the token tile and block rows of the tile policy (with
    WARP_STREAM, at one token, moe_warp_kernel's passes; up to BULK_TOKENS tokens, moe_bulk_kernel's)."""
    if WARP_STREAM and n_tok == 1 and not registry.batch_invariant() and warp_fits(p):
        E, I, D = p.n_experts, p.inter, p.hidden
        build = moe_warp_kernel.build_fp4_warp_gemm
        return ((build, "swiglu", E, 2 * I, D),
                (build, "add", E, D, I, moe_warp_kernel.BLOCK_K, moe_warp_kernel.STAGES, False))
    if n_tok <= BULK_TOKENS and not registry.batch_invariant() and bulk_fits(p):
        E, I, D = p.n_experts, p.inter, p.hidden
        build, bk = moe_bulk_kernel.build_fp4_bulk_gemm, moe_bulk_kernel.BLOCK_K
        st, mt = moe_bulk_kernel.config(n_tok)
        return (build, "swiglu", E, 2 * I, D, bk, st, mt), (build, "add", E, D, I, bk, st, mt)
    return _grouped_specs(p, n_tok, top_k)


def _grouped_specs(p: PackedExperts, n_tok: int, top_k: int):
    """The grouped GEMM's passes at n_tok tokens (the tile policy's token tile, block rows and down-pass splits)."""
    bt = routed_block_t(n_tok, top_k, p.n_experts)
    splits = 1 if registry.batch_invariant() else routed_down_splits(n_tok, top_k, p.n_experts)
    return ffn_specs(p, bt, splits, routed_block_n(bt))


def experts_specs(routed: PackedExperts, shared: PackedExperts | None, n_tok: int, top_k: int,
                  shared_down_splits: int = 1):
    """Every jit spec moe_experts_packed needs at n_tok tokens (for precompile / warm-up)."""
    specs = [(build_moe_prep, routed.n_experts, top_k, routed.hidden)]
    specs += routed_specs(routed, n_tok, top_k)
    if shared is not None and n_tok < SHARED_DENSE_TOKENS:
        specs += ffn_specs(shared, shared_block_t(n_tok), shared_down_splits)
    elif shared is not None:
        specs.append((build_swiglu_halves, shared.inter))  # cuBLAS, then the SwiGLU pass (shared_expert.py)
    return specs


# ---------------------------------------------------------------------------------------------- experts
def _scales_in_range(p: PackedExperts) -> bool:
    """The bf16 bit tricks in dequant.py bound the block-scale byte; checked once per weight set."""
    ok = getattr(p, "_scales_ok", None)
    if ok is None:
        most = 128 if p.fmt == "fp4" else 134
        ok = int(p.s13.max()) <= most and int(p.s2.max()) <= most
        p._scales_ok = ok
    return ok


@functools.lru_cache(maxsize=64)
def _shared_table(n_tok: int, device: str, block_t: int):
    """Routing table that sends every token to the single shared expert with weight 1, one slot per block_t
    tokens: the grid runs the token tiles side by side (N / 64 blocks per slot), where one slot of every token had
    72-80 blocks each walk all the tiles in turn (the up pass at 256 tokens: 219 -> 162 us on the H200,
    benchmarks/results/moe_gpu_tiled_h200.log). A token's computation is the same in either (its tile's K loop),
    so are its bits."""
    dev = torch.device(device)
    rows = torch.arange(n_tok, dtype=torch.int32, device=dev)
    n_slots = max(1, -(-n_tok // block_t))
    starts = torch.arange(n_slots, dtype=torch.int32, device=dev) * block_t
    counts = torch.clamp(n_tok - starts, max=block_t).to(torch.int32)
    return (rows, torch.ones(n_tok, dtype=torch.float32, device=dev),
            torch.zeros(n_slots, dtype=torch.int32, device=dev), starts, counts)


@functools.lru_cache(maxsize=8)
def _side_stream(device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device)


def routing_table(idx, weights, n_experts: int, zero: torch.Tensor | None = None):
    """moe_prep's (rows, aw, slot_expert, slot_start, slot_count) for router output idx/weights [T, k]: the one-block
    kernel up to PREP_KERNEL_ASSIGNMENTS assignments (decode: one launch), torch's sorts beyond (moe_table.py).
    `zero`: a contiguous fp32 [T, D] tensor (D % 4 == 0) set to zeros too, by the same launch on the kernel path."""
    T_, k = idx.shape
    if T_ * k > PREP_KERNEL_ASSIGNMENTS:
        if zero is not None:
            zero.zero_()
        return routing_table_torch(idx, weights, n_experts)
    n_slots = min(n_experts, T_ * k)
    dev = idx.device
    rows = torch.empty(T_ * k, dtype=torch.int32, device=dev)
    aw = torch.empty(T_ * k, dtype=torch.float32, device=dev)
    slots = [torch.empty(n_slots, dtype=torch.int32, device=dev) for _ in range(3)]
    args = (idx.contiguous(), weights.float().contiguous(), rows, aw, *slots)
    if zero is None:
        jit(build_moe_prep, n_experts, k)(*args)
    else:
        jit(build_moe_prep, n_experts, k, zero.shape[1])(*args, zero.view(-1, 4))
    return (rows, aw, *slots)


def ffn(p: PackedExperts, x, table, out_y, specs, limit: float, out_rows=None):
    """One SwiGLU expert pass over `table` with `specs` (ffn_specs): up (+gate, SwiGLU, routing weight) into h,
    then down, added into the fp32 out_y at the token of each assignment (at `out_rows[pos]` instead, when
    given)."""
    up, down = specs
    h = torch.empty(table[0].shape[0], p.inter, dtype=torch.bfloat16, device=x.device)
    jit(*up)(x, *table, p.w13, p.s13, h, limit, *pass_args(up, p.w13))
    down_table = table if out_rows is None else (out_rows, *table[1:])
    jit(*down)(h, *down_table, p.w2, p.s2, out_y, limit, *pass_args(down, p.w2))


def pass_args(spec, w) -> tuple:
    """What a pass's kernel takes after the grouped GEMM's arguments: moe_bulk_kernel's the tensor map of its
    weights w (encoded on the first call, outside a graph capture; cached on w)."""
    return (moe_bulk_kernel.weight_map(w),) if spec[0] is moe_bulk_kernel.build_fp4_bulk_gemm else ()


def moe_experts_packed(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, routed: PackedExperts,
                       shared: PackedExperts | None, swiglu_limit: float, shared_down_splits: int = 1) -> torch.Tensor:
    """x [T, D] bf16, weights/idx [T, k] from the router -> [T, D] bf16; same math as torch moe_experts with the
    experts dequantised from `routed` (and the single expert in `shared`). 63.8 / 96.1 / 97.1% of copy bandwidth at
    1 / 8 / 64 tokens on an H100 (benchmarks/results/moe_gpu_s45_h100.json.xz). The shared expert (one expert, a
    few dozen blocks: it cannot fill the GPU alone at decode) runs on a side stream, concurrently with the routed
    pass."""
    if registry.batch_invariant():
        return _moe_experts_invariant(x, *no_expert_as_zero_weight(weights, idx), routed, shared, swiglu_limit)
    if moe_prefill.wanted(x.shape[0], routed) and registry.host_reads_allowed():
        # (a graph capture, or a caller under registry.no_host_reads(): expert parallelism's static path over its
        # fixed-size, mostly empty receive buffer, keeps the streaming kernel: the grouped path reads its row counts
        # on the host and sizes its work by the buffer, not by the rows used)
        return moe_prefill.moe_experts_grouped(x, *no_expert_as_zero_weight(weights, idx), routed, shared,
                                               swiglu_limit)
    assert x.dtype == torch.bfloat16
    x = x.contiguous()
    T_, k = idx.shape
    dev = x.device
    # both passes add into y (fp32 atomics); the routing table's launch zeroes it
    y = torch.empty(T_, routed.hidden, dtype=torch.float32, device=dev)
    table = routing_table(idx, weights, routed.n_experts, zero=y if PREP_ZEROES_OUTPUT else None)
    if not PREP_ZEROES_OUTPUT:
        y.zero_()
    limit = float(swiglu_limit)
    if shared is not None and T_ >= SHARED_DENSE_TOKENS:
        # one expert over every token: dequantised once (a few dozen MB) and multiplied by cuBLAS, which fills the
        # GPU where the streaming kernel's 72-80 blocks per 64-token tile stream the FP8 weights once per tile
        ffn(routed, x, table, y, routed_specs(routed, T_, k), limit)
        y += shared_expert(x, shared, limit).float()
        return y.to(x.dtype)
    main = torch.cuda.current_stream(dev)
    if shared is not None:
        side = _side_stream(dev)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            bt = shared_block_t(T_)
            ffn(shared, x, _shared_table(T_, str(dev), bt), y, ffn_specs(shared, bt, shared_down_splits), limit)
    ffn(routed, x, table, y, routed_specs(routed, T_, k), limit)
    if shared is not None:
        main.wait_stream(side)
    return y.to(x.dtype)


def no_expert_as_zero_weight(weights: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """idx entries of -1 (no expert: torch moe_experts' contract) as expert 0 with routing weight 0, for the paths
    that need every assignment placed (the streaming kernel's moe_prep skips -1 itself). A zero-weight row adds
    zeros: the receive buffers of expert parallelism hold zero or finite rows."""
    none = idx < 0
    return torch.where(none, 0.0, weights.float()), torch.where(none, 0, idx)


def _moe_experts_invariant(x, weights, idx, routed, shared, swiglu_limit):
    """moe_experts_packed with a fixed reduction order: every (token, expert) contribution lands in its own fp32
    row (one add of its bf16-rounded value into zeros: exact), then y = the routed experts in ascending id order,
    from fp32 zeros, then the shared expert (its own bf16-rounded row): the torch op's order and rounding points,
    which expert parallelism reproduces from rows computed on other ranks (deepinfer.distributed.expert_parallel:
    it needs every term to be a row of its own and the shared expert last)."""
    assert x.dtype == torch.bfloat16
    x = x.contiguous()
    T_, k = idx.shape
    dev = x.device
    limit = float(swiglu_limit)
    table = routing_table(idx, weights, routed.n_experts)
    positions = torch.arange(T_ * k, dtype=torch.int32, device=dev)
    parts = torch.zeros(T_ * k, routed.hidden, dtype=torch.float32, device=dev)
    ffn(routed, x, table, parts, routed_specs(routed, T_, k), limit, out_rows=positions)
    # moe_prep sorts assignments by expert, tokens ascending inside one: a stable sort by token leaves each
    # token's k rows in ascending expert order
    parts = parts[torch.argsort(table[0], stable=True)].view(T_, k, routed.hidden)
    y = torch.zeros(T_, routed.hidden, dtype=torch.float32, device=dev)
    for j in range(k):
        y += parts[:, j]
    if shared is not None:
        s = torch.zeros(T_, routed.hidden, dtype=torch.float32, device=dev)
        bt = shared_block_t(T_)
        ffn(shared, x, _shared_table(T_, str(dev), bt), s, ffn_specs(shared, bt), limit)
        y += s
    return y.to(x.dtype)


def _kernel_ok(x, p) -> bool:
    return (isinstance(p, PackedExperts) and p.hidden % 256 == 0 and p.inter % 256 == 0 and p.hidden == x.shape[1]
            and _scales_in_range(p))


def moe_experts(x, weights, idx, experts, shared, swiglu_limit):
    """Same contract as deepinfer.kernels.torch.moe.moe_experts; kernel path for bf16 x on CUDA when `experts`
    (and `shared`, if given) are PackedExperts of kernel-sized shapes, else the torch reference (which reads
    PackedExperts too)."""
    if (x.is_cuda and x.dtype == torch.bfloat16 and x.shape[0] > 0 and _kernel_ok(x, experts)
            and (shared is None or _kernel_ok(x, shared))):
        return moe_experts_packed(x, weights, idx, experts, shared, swiglu_limit)
    if not isinstance(experts, PackedExperts) or (shared is not None and not isinstance(shared, PackedExperts)):
        why = "experts not packed (PackedExperts)"
    else:
        why = reason(x, "expert shapes or scales not covered")
    return registry.fall_back("moe_experts", why, torch_moe.moe_experts, x, weights, idx, experts, shared,
                              swiglu_limit)
