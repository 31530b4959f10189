"""Registry-facing MoE ops (`moe_router`, `moe_experts`) and the fast path over packed FP4/FP8 expert weights.

`moe_experts` keeps the torch op's signature. Its fast path needs the experts in the released quantised format,
stacked once at load time (`PackedExperts`, deepinfer.kernels.packed_experts; the model holds experts this way on
CUDA); a plain list of dequantised (w1, w2, w3) tensors cannot be streamed by one grouped kernel, so it goes to
the torch reference unchanged. `moe_experts_packed` is the kernel-level entry.
"""

import functools

import torch

from deepinfer.kernels.packed_experts import BLOCK_N, PackedExperts, pack_experts  # noqa: F401 (re-export)
from deepinfer.kernels.torch import moe as torch_moe

from ._build import jit
from .moe_gemm import build_grouped_gemm
from .moe_prep import build_moe_prep
from .moe_router import SCORES, build_router_logits, build_router_topk

STAGES = 2    # cp.async pipeline depth of the weight stream (2, 3 and 4 measured: 4 is slower, 2 ~ 3)


# ---------------------------------------------------------------------------------------------- router
def _router_splits(dim: int, block_k: int = 256, most: int = 20) -> int:
    steps = dim // block_k
    return max(s for s in range(1, most + 1) if steps % s == 0)


def moe_router(x, gate_weight, bias, top_k, scoring_func, gate_temp, norm_topk_prob, routed_scaling_factor):
    """Same contract as deepinfer.kernels.torch.moe.moe_router. Kernel path: bf16 x and gate weight,
    sqrtsoftplus or sigmoid scoring, experts a multiple of 64, hidden a multiple of 256; else the torch op."""
    E, D = gate_weight.shape
    fast = (x.is_cuda and x.dtype == torch.bfloat16 and gate_weight.dtype == torch.bfloat16 and scoring_func in SCORES
            and E % 64 == 0 and D % 256 == 0 and E <= 1024 and x.shape[0] > 0)
    if not fast:
        return torch_moe.moe_router(x, gate_weight, bias, top_k, scoring_func, gate_temp, norm_topk_prob,
                                    routed_scaling_factor)
    x = x.contiguous()
    T_ = x.shape[0]
    splits = _router_splits(D)
    block_t = 16 if T_ <= 16 else 64
    part = torch.empty(splits, T_, E, dtype=torch.float32, device=x.device)
    jit(build_router_logits, E, D, block_t, 256, splits)(x, gate_weight.contiguous(), part)
    if bias is None:
        bias = torch.zeros(E, dtype=torch.float32, device=x.device)
    weights = torch.empty(T_, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(T_, top_k, dtype=torch.int64, device=x.device)
    jit(build_router_topk, E, splits, top_k, scoring_func, bool(norm_topk_prob))(
        part, bias.float().contiguous(), weights, ids, 1.0 / float(gate_temp), float(routed_scaling_factor))
    return weights, ids


# ---------------------------------------------------------------------------------------------- packing
# The layout lives in deepinfer.kernels.packed_experts (shared with the torch reference); re-exported here.
def _scales_in_range(p: PackedExperts) -> bool:
    """The bf16 bit tricks in dequant.py bound the block-scale byte; checked once per weight set."""
    ok = getattr(p, "_scales_ok", None)
    if ok is None:
        most = 128 if p.fmt == "fp4" else 134
        ok = int(p.s13.max()) <= most and int(p.s2.max()) <= most
        p._scales_ok = ok
    return ok


# ---------------------------------------------------------------------------------------------- experts
@functools.lru_cache(maxsize=64)
def _shared_table(n_tok: int, device: str):
    """Routing table that sends every token to the single shared expert with weight 1."""
    dev = torch.device(device)
    rows = torch.arange(n_tok, dtype=torch.int32, device=dev)
    return (rows, torch.ones(n_tok, dtype=torch.float32, device=dev), torch.zeros(1, dtype=torch.int32, device=dev),
            torch.zeros(1, dtype=torch.int32, device=dev), torch.full((1,), n_tok, dtype=torch.int32, device=dev))


def _bucket(n: int, sizes=(16, 32, 64)) -> int:
    # larger token tiles would not fit shared memory with block_k 256 (bigger batches loop over chunks)
    return next((s for s in sizes if n <= s), sizes[-1])


@functools.lru_cache(maxsize=8)
def _side_stream(device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device)


def _ffn(p: PackedExperts, x, table, out_y, block_t: int, limit: float):
    """One SwiGLU expert pass over `table` (rows, aw, slot_expert, slot_start, slot_count): up (+gate, SwiGLU,
    routing weight) into h, then down, atomically added into out_y (fp32)."""
    rows, aw = table[0], table[1]
    E, I, D = p.n_experts, p.inter, p.hidden
    h = torch.empty(rows.shape[0], I, dtype=torch.bfloat16, device=x.device)
    jit(build_grouped_gemm, p.fmt, "swiglu", E, 2 * I, D, BLOCK_N, block_t, 256, 128, STAGES, True)(
        x, *table, p.w13, p.s13, h, limit)
    jit(build_grouped_gemm, p.fmt, "add", E, D, I, BLOCK_N, block_t, 256, 128, STAGES, False)(
        h, *table, p.w2, p.s2, out_y, limit)


def moe_experts_packed(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, routed: PackedExperts,
                       shared: PackedExperts | None, swiglu_limit: float) -> torch.Tensor:
    """x [T, D] bf16, weights/idx [T, k] from the router -> [T, D] bf16; same math as torch moe_experts with the
    experts dequantised from `routed` (and the single expert in `shared`). Runs the v3 grouped GEMM
    (moe_gemm_v3: dequant straight into the wgmma A registers; 1.6-1.9x v2, 60-67% of copy bandwidth at B=8..256
    on an H200, benchmarks/results/moe_v3_gpu_h200.json)."""
    from .moe_gemm_v3 import moe_experts_packed_v3

    return moe_experts_packed_v3(x, weights, idx, routed, shared, swiglu_limit)


def moe_experts_packed_v2(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, routed: PackedExperts,
                          shared: PackedExperts | None, swiglu_limit: float) -> torch.Tensor:
    """The v2 path (moe_gemm.py: dequant -> bf16 shared-memory tile -> wgmma), kept for comparison."""
    assert x.dtype == torch.bfloat16
    x = x.contiguous()
    T_, k = idx.shape
    n_slots = min(routed.n_experts, T_ * k)
    dev = x.device
    rows = torch.empty(T_ * k, dtype=torch.int32, device=dev)
    aw = torch.empty(T_ * k, dtype=torch.float32, device=dev)
    slots = [torch.empty(n_slots, dtype=torch.int32, device=dev) for _ in range(3)]
    jit(build_moe_prep, routed.n_experts, k)(idx.contiguous(), weights.float().contiguous(), rows, aw, *slots)
    # fp32 accumulator: the routed and the shared passes both add into it. The shared expert (one expert, a few
    # dozen blocks: it cannot fill the GPU alone at decode) runs on a side stream, concurrently with the routed one.
    y = torch.zeros(T_, routed.hidden, dtype=torch.float32, device=dev)
    limit = float(swiglu_limit)
    main = torch.cuda.current_stream(dev)
    if shared is not None:
        side = _side_stream(dev)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            _ffn(shared, x, _shared_table(T_, str(dev)), y, _bucket(T_), limit)
    _ffn(routed, x, (rows, aw, *slots), y, 16 if T_ <= 256 else 64, limit)
    if shared is not None:
        main.wait_stream(side)
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
    return torch_moe.moe_experts(x, weights, idx, experts, shared, swiglu_limit)
