import torch

from deepinfer.kernels.fp8_weight import Fp8BlockWeight
from deepinfer.kernels.registry import batch_invariant

# Rows are padded to a multiple of this before the GEMM on the CPU: BLAS picks a different kernel (and summation
# order) for very few rows, which would make a row's result depend on how many rows ride with it.
ROW_TILE = 16
# cuBLAS picks its kernel (tile, split-K) by M, so padding cannot make a row's result independent of its batch; in
# the batch-invariant mode a dense GEMM on CUDA runs as GEMMs of exactly this many rows instead (the last one
# padded): the same shapes, the same kernel, whatever the batch.
CUDA_INVARIANT_ROWS = 64


def linear(x: torch.Tensor, weight: torch.Tensor | Fp8BlockWeight,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x @ weight.T (weight [out, in]), row-invariant across batch sizes on the CPU (and on CUDA in the
    batch-invariant mode). An FP8 weight kept as stored is dequantised to x's dtype first: the same matrix the
    loader builds when it dequantises at load.

    out_dtype=torch.float32 with bf16 (or fp16) operands: the fp32 GEMM of the upcast operands (their products are
    exact in fp32), the result not rounded to the operands' dtype. On CUDA one GEMM of the operands as stored with
    fp32 output (the weight read at 2 bytes a value, no fp32 copy kept or made); elsewhere the operands upcast."""
    if isinstance(weight, Fp8BlockWeight):
        weight = weight.dense(x.dtype)
    widen = out_dtype is not None and out_dtype != x.dtype
    if widen and not (x.is_cuda and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16)
                      and out_dtype == torch.float32):
        return linear(x.to(out_dtype), weight.to(out_dtype))
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    if x.is_cuda and batch_invariant():
        return _fixed_rows(x2, weight, out_dtype).reshape(*lead, weight.shape[0])
    if widen:
        return torch.mm(x2, weight.t(), out_dtype=out_dtype).reshape(*lead, weight.shape[0])
    pad = -m % ROW_TILE if x.device.type == "cpu" else 0
    if pad:
        x2 = torch.cat([x2, x2.new_zeros(pad, x2.shape[1])])
    return torch.nn.functional.linear(x2, weight)[:m].reshape(*lead, weight.shape[0])


def grouped_linear(x: torch.Tensor, weight) -> torch.Tensor:
    """The grouped output projection: x [T, G, K], weight[g] group g's [R, K] projection (a [G, R, K] tensor or a
    sequence of G weights, e.g. Fp8BlockWeight.row_groups) -> [T, G * R], group g in columns [g * R, (g + 1) * R)."""
    return torch.cat([linear(x[:, g], weight[g]) for g in range(x.shape[1])], dim=-1)


def _fixed_rows(x2: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    m, rows = x2.shape[0], CUDA_INVARIANT_ROWS
    pad = -m % rows
    if pad:
        x2 = torch.cat([x2, x2.new_zeros(pad, x2.shape[1])])
    dtype = out_dtype or torch.result_type(x2, weight)
    out = torch.empty(m + pad, weight.shape[0], dtype=dtype, device=x2.device)
    for start in range(0, m + pad, rows):
        if dtype == x2.dtype:
            torch.mm(x2[start:start + rows], weight.t(), out=out[start:start + rows])
        else:
            out[start:start + rows] = torch.mm(x2[start:start + rows], weight.t(), out_dtype=dtype)
    return out[:m]
