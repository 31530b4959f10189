"""`linear` for the tilelang-sm90 backend: FP8 projection weights as stored (Fp8BlockWeight) through the
weight-only FP8 GEMM of linear_kernel.py; everything else through the torch op.

Kernel path: bf16 x on CUDA, an Fp8BlockWeight with N % 64 == 0, K % 128 == 0, blocks aligned to row 0
(row_offset 0) and block scales the in-register dequantisation can represent (ue8m0 byte <= 134, i.e. scales up
to 2^7; projection weights sit near 2^-10). `why_not(x, w)` names the first condition that fails (None: the
kernel runs), so tests and benchmarks can insist on the kernel path.

Other inputs: the torch op (cuBLAS on CUDA), which dequantises an Fp8BlockWeight per call (fp32 models, tiny
shapes; counted by the registry's per-call fallbacks). Dense bf16 weights stay on cuBLAS: it picks its kernel by
M, so those projections are not batch invariant on the GPU; the FP8 ones are (see linear_kernel.py).

Verification and prefill sizes: from `dense_rows(N, K)` rows and DENSE_MIN_N output columns, outside the
batch-invariant mode, the weight is dequantised to bf16 for the call (fp8_dense_kernel.py, one pass; exact: e4m3
times a power of two) and multiplied by cuBLAS, whose large tiles run near the bf16 rate; the weight-only kernel
re-reads and re-dequantises the weight for every token tile. The dequantisation costs 3 bytes per weight against
the GEMM's 2 x rows FLOPs per weight. The kernel stays the path of decode steps and of the batch-invariant mode
(cuBLAS picks its kernel by the row count).

Decode sizes: up to GEMV_ROWS rows, outside the batch-invariant mode, gemv_kernel.py's GEMV (a warp streams a
weight row from HBM to registers; no tiles, rarely a K split): the GEMM's 16-token tiles are mostly empty there.
A row's result is the same at every row count up to GEMV_ROWS, but differs from the GEMM's in the last bits, so
the invariant mode keeps the GEMM for every size.

Tile policy: 128-K steps, and K split over `split_count(N, K)` blocks when N alone gives too few blocks to keep
HBM busy at decode (each split's fp32 partial is reduced in split order by the tile's last block to finish, or by
a second small kernel beyond TILE_COUNTERS tiles), both fixed by
(N, K) alone, so a row's result never depends on the batch. The block's tile (tokens x weight rows) follows the
row count outside the invariant mode (`gemm_tiles`: 16 or 32 x 128) and is 32 x 64 in it; every tile gives a row
the same bits.
"""

from __future__ import annotations

import torch

from deepinfer.kernels.fp8_weight import Fp8BlockWeight, RowGroups
from deepinfer.kernels.packed_experts import PackedExperts
from deepinfer.kernels.registry import batch_invariant, fall_back
from deepinfer.kernels.torch import linear as torch_linear

from ._build import jit, pdl_enabled
from .counters import TILE_COUNTERS, tile_counters
from .fp8_dense_kernel import build_fp8_dense
from .gemv_kernel import M_MAX, WARPS, build_fp8_gemv, chunk_width
from .linear_kernel import BLOCK_K, BLOCK_T, STAGES, build_fp8_linear, build_split_reduce

BLOCK_N = 64
TARGET_BLOCKS = 264  # per token tile: two resident blocks on each of the H200's 132 SMs
MAX_SPLITS = 16  # each split costs M * N * 8 bytes of fp32 partials (written, then read) at large M
MAX_SCALE_BYTE = 134  # dequant.py's e4m3 bit placement holds scales up to 2^7
# rows from which a call dequantises the weight and takes cuBLAS, outside the invariant mode (`dense_rows`): the
# crossovers at V4.1-Flash's projection shapes on an H200 with the one-pass dequantisation
# (benchmarks/results/prefill_kernels_dense_s17_h200.log): the large weights (wq_b, wo_b: 42 M codes) from 128 rows
# (1.5x the kernel at 192 rows), the smaller ones (wq_a, the indexer's wq_b, a group of wo_a) from 256: the kernels
# alone crossed at 512, but in the 40-layer B=256 step 256 won (139.34 -> 136.09 ms, one H100,
# decode_gpu_flash40_dense256_s28_h100.log); narrower projections (wkv, 512 rows: DENSE_MIN_N) gain less than the
# dequantisation costs until ~1,024 rows
DENSE_ROWS, DENSE_ROWS_LARGE, LARGE_WEIGHT, DENSE_MIN_N = 256, 128, 1 << 25, 1024
# rows up to which a call takes the GEMV (outside the invariant mode): on an H200 it beats the GEMM 1.1-2.2x at one
# row on every Flash shape; at two it wins on some and loses on others, from four it loses: its per-row activation
# loads and sums grow with the rows (linear_gpu_gemv_h200.log, linear_gpu_gemv_cvt_h200.log)
GEMV_ROWS = 1
WIDE_N = 128  # weight rows per block of the GEMM outside the invariant mode (`gemm_tiles`)
GEMV_MIN_BLOCKS = 128  # the GEMV splits K only when N / WARPS rows give fewer blocks than about one per SM


def split_count(n_rows: int, k_dim: int, block_k: int = BLOCK_K) -> int:
    """K splits for an [N, K] weight: the smallest divisor of the K steps that gives TARGET_BLOCKS blocks,
    at most MAX_SPLITS (then the largest divisor within it). A function of the shape only."""
    tiles, steps = n_rows // BLOCK_N, k_dim // block_k
    divisors = [d for d in range(1, min(steps, MAX_SPLITS) + 1) if steps % d == 0]
    return next((d for d in divisors if tiles * d >= TARGET_BLOCKS), divisors[-1])


def dense_rows(n_rows: int, k_dim: int) -> int:
    """Rows from which an [N, K] weight is dequantised for cuBLAS (outside the invariant mode; see DENSE_ROWS)."""
    return DENSE_ROWS_LARGE if n_rows * k_dim >= LARGE_WEIGHT else DENSE_ROWS


def gemv_splits(n_rows: int, k_dim: int) -> int:
    """K splits of the GEMV for an [N, K] weight: 1 unless N alone gives fewer than GEMV_MIN_BLOCKS blocks, then
    the smallest divisor of its chunks that reaches them (at most 8)."""
    blocks, chunks = n_rows // WARPS, k_dim // (32 * chunk_width(k_dim))
    divisors = [d for d in range(1, min(chunks, 8) + 1) if chunks % d == 0]
    return next((d for d in divisors if blocks * d >= GEMV_MIN_BLOCKS), divisors[-1])


def gemv_fits(w: Fp8BlockWeight, groups: int = 1) -> bool:
    """Whether the GEMV tiles weight w (whole blocks of WARPS rows per group, whole 32-lane chunks of K)."""
    n, k = w.shape
    return n % (WARPS * groups) == 0 and k % (32 * chunk_width(k)) == 0


def _gemv_ok(m: int, w: Fp8BlockWeight, groups: int = 1) -> bool:
    return 0 < m <= GEMV_ROWS and not batch_invariant() and gemv_fits(w, groups)


def why_not(x: torch.Tensor, w) -> str | None:
    """Why `linear(x, w)` does not take the FP8 kernel path, or None when it does."""
    if not isinstance(w, Fp8BlockWeight):
        return "dense weight (cuBLAS)"
    if not (x.is_cuda and w.device.type == "cuda"):
        return "not on CUDA"
    if x.dtype != torch.bfloat16:
        return f"activations are {x.dtype}, the kernel takes bfloat16"
    n, k = w.shape
    if n % BLOCK_N or k % BLOCK_K or x.shape[-1] != k:
        return f"weight shape not a multiple of [{BLOCK_N}, {BLOCK_K}]"
    if w.row_offset:
        return "row group starts inside a 32-row scale block"
    if not (w.weight.is_contiguous() and w.scale.is_contiguous()):
        return "weight or scale not contiguous"
    if not _scales_in_range(w):
        return f"a block scale byte exceeds {MAX_SCALE_BYTE}"
    return None


def linear(x: torch.Tensor, weight, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Same contract as deepinfer.kernels.torch.linear.linear (weight: a dense tensor or an Fp8BlockWeight). An
    Fp8BlockWeight the kernel cannot take is a counted per-call fallback; a dense weight is cuBLAS by design (with
    out_dtype too: the Markov head's fp32 logits from its bf16 table)."""
    if not isinstance(weight, Fp8BlockWeight):
        return torch_linear.linear(x, weight, out_dtype)
    reason = why_not(x, weight) if out_dtype in (None, x.dtype) else f"out_dtype {out_dtype} (the kernel writes bf16)"
    if reason is None:
        m = x.numel() // x.shape[-1]
        if m >= dense_rows(*weight.shape) and weight.shape[0] >= DENSE_MIN_N and not batch_invariant():
            return torch.nn.functional.linear(x, dense_bf16(weight))
        if _gemv_ok(m, weight):
            return fp8_gemv(x, weight)
        return fp8_linear(x, weight)
    return fall_back("linear", reason, torch_linear.linear, x, weight, out_dtype)


def _rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """x as contiguous rows of `width`, 16-byte aligned: both kernels read each row in 16-byte chunks."""
    x2 = x.reshape(-1, width)
    if not x2.is_contiguous() or x2.data_ptr() % 16:
        x2 = x2.clone(memory_format=torch.contiguous_format)
    return x2


def gemm_tiles(m: int, n_rows: int) -> tuple[int, int]:
    """(tokens, weight rows) per block of the GEMM at m rows: outside the batch-invariant mode, two warpgroups of
    64 weight rows share each activation tile (128 rows a block) wherever the weight's rows divide into it, with
    16-token tiles up to 16 rows and 32-token tiles beyond; the invariant mode keeps BLOCK_T x BLOCK_N. Why: a
    block's work per K step is its weight tile's dequantisation plus its activation tile's loads and permute, so
    one activation tile per 128 weight rows halves the second, and a 16-token tile halves it again where the rows
    are few (linear_gpu.py --tiles on an H200: 1.2-1.6x the 32 x 64 tile from 64 rows, 1.0-1.6x at 8 rows;
    benchmarks/results/linear_gpu_tiles_h200.log). A row's result is the same bits at every tile (the K loop, its
    splits and a token's MMA column do not change; tests/gpu checks it), so the tiles keep the GEMM's results."""
    if batch_invariant() or n_rows % WIDE_N:
        return BLOCK_T, BLOCK_N
    return (16 if m <= 16 else 32), WIDE_N


def fp8_linear(x: torch.Tensor, w: Fp8BlockWeight, k_splits: int | None = None, groups: int = 1,
               block_t: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """x [..., K] bf16 @ dequant(w)[N, K].T -> [..., N] bf16 through the kernel (inputs as `why_not` accepts).
    `k_splits` overrides the shape's split count (benchmarks only: results then differ in the last bits).
    groups > 1: x [..., groups * K], row group g of w times x's g-th K columns (build_fp8_linear). `block_t`,
    `block_n`: tokens and weight rows per block (default: `gemm_tiles`; benchmarks time others)."""
    n, k = w.shape
    lead = x.shape[:-1]
    x2 = _rows(x, k * groups)
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return out.view(*lead, n)
    bt, bn = gemm_tiles(m, n // groups)
    bt, bn = block_t or bt, block_n or bn
    splits = k_splits or split_count(n, k)
    # the tiles' own last blocks sum the split partials up to TILE_COUNTERS tiles (every decode and verification
    # size); larger calls (the invariant mode's prefill) add the split_reduce launch: the same sums, same order
    fused = splits > 1 and -(-m // bt) * (n // bn) <= TILE_COUNTERS
    tail = (bt, BLOCK_K, STAGES, 0, groups, bn) + ((TILE_COUNTERS,) if fused else ())
    spec = (build_fp8_linear, n, k, splits) + (() if groups == 1 and (bt, bn) == (BLOCK_T, BLOCK_N) and not fused
                                               else tail)
    if splits == 1:
        jit(*spec)(x2, w.weight, w.scale, out)
        return out.view(*lead, n)
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    if fused:
        jit(*spec)(x2, w.weight, w.scale, part, out, tile_counters(x.device))
    else:
        jit(*spec)(x2, w.weight, w.scale, part)
        jit(build_split_reduce, n, splits)(part, out)
    return out.view(*lead, n)


def fp8_gemv(x: torch.Tensor, w: Fp8BlockWeight, groups: int = 1) -> torch.Tensor:
    """x [..., groups * K] bf16 with at most M_MAX[-1] rows @ dequant(w)[N, K].T -> [..., N] bf16 through the GEMV
    (inputs as `why_not` and `gemv_fits` accept); groups as in fp8_linear. `linear` takes it up to GEMV_ROWS."""
    n, k = w.shape
    lead = x.shape[:-1]
    x2 = _rows(x, k * groups)
    m = x2.shape[0]
    m_max = next(v for v in M_MAX if v >= m)
    splits = gemv_splits(n, k)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    codes = w.weight.view(torch.float8_e4m3fn)  # the kernel converts them with the hardware's e4m3 cvt
    # under graph capture the weights are the model's, fixed: their loads may start before the kernel ahead ends
    early = pdl_enabled() and x.is_cuda and torch.cuda.is_current_stream_capturing()
    if splits == 1:
        jit(build_fp8_gemv, n, k, m_max, 1, groups, early)(x2, codes, w.scale, out)
    else:
        part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
        jit(build_fp8_gemv, n, k, m_max, splits, groups, early)(x2, codes, w.scale, part)
        jit(build_split_reduce, n, splits)(part, out)
    return out.view(*lead, n)


def dense_bf16(w: Fp8BlockWeight) -> torch.Tensor:
    """w dequantised to bf16, equal to w.dense(torch.bfloat16) (exact: e4m3 times a power-of-two block scale):
    one pass of fp8_dense_kernel.py on CUDA for whole 32x32 scale blocks from row 0 (every weight `why_not`
    passes), else the torch reference."""
    n, k = w.shape
    if w.device.type == "cuda" and not w.row_offset and w.scale.shape == (n // 32, k // 32) \
            and w.weight.is_contiguous() and w.scale.is_contiguous():
        out = torch.empty(n, k, dtype=torch.bfloat16, device=w.device)
        jit(build_fp8_dense, n, k)(w.weight.view(torch.float8_e4m3fn), w.scale, out)
        return out
    return w.dense(torch.bfloat16)


def expert_dense(p: PackedExperts, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert e of packed experts as (w13 [2I, D], w2 [D, I]) for cuBLAS (the shared expert at prefill sizes), w13's
    gate and up rows interleaved as packed (PackedExperts.split_w13 separates them): FP8 matrices through dense_bf16
    (one pass on CUDA; e4m3 with 32x32 block scales is Fp8BlockWeight's format), the values PackedExperts.dense
    gives."""
    if p.fmt != "fp8" or dtype != torch.bfloat16:
        return p.dense_w13(e, dtype)
    return p.dense_w13(e, dtype, dequant=lambda w, s: dense_bf16(Fp8BlockWeight(w, s)))


def grouped_linear(x: torch.Tensor, weight) -> torch.Tensor:
    """Same contract as deepinfer.kernels.torch.linear.grouped_linear (x [T, G, K]). The row groups of one FP8
    weight (Fp8BlockWeight.row_groups) run as one launch of the kernel over the whole weight (decode) or one
    batched cuBLAS GEMM over its dequantised groups (prefill sizes); other weights through the torch op."""
    if not isinstance(weight, RowGroups):
        return torch_linear.grouped_linear(x, weight)
    T_, G, K = x.shape
    whole = weight.whole
    reason = why_not(x.reshape(T_, G * K)[:, :K], whole) if len(weight) == G else "groups differ from x's"
    if reason is None and (whole.shape[1] != K or (whole.shape[0] // G) % BLOCK_N):
        reason = f"group rows not a multiple of {BLOCK_N} (the kernel's row tile never spans two groups)"
    if reason is not None:
        return fall_back("grouped_linear", reason, torch_linear.grouped_linear, x, weight)
    R = whole.shape[0] // G
    if T_ >= dense_rows(R, K) and not batch_invariant():
        w = dense_bf16(whole).view(G, R, K)
        return torch.bmm(x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1).reshape(T_, G * R)
    if _gemv_ok(T_, whole, G):
        return fp8_gemv(x.reshape(T_, G * K), whole, groups=G)
    return fp8_linear(x.reshape(T_, G * K), whole, groups=G)


def _scales_in_range(w: Fp8BlockWeight) -> bool:
    """Checked once per weight object (a device sync), remembered on it."""
    ok = w.__dict__.get("_scales_ok")
    if ok is None:
        ok = w.scale.numel() == 0 or int(w.scale.max()) <= MAX_SCALE_BYTE
        object.__setattr__(w, "_scales_ok", ok)  # a cache, not a field: the dataclass stays frozen
    return ok
