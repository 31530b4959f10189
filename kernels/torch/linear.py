import torch

from deepinfer.kernels.fp8_weight import Fp8BlockWeight

# Rows are padded to a multiple of this before the GEMM on the CPU: BLAS picks a different kernel (and summation
# order) for very few rows, which would make a row's result depend on how many rows ride with it. Not on GPUs:
# cuBLAS picks kernels by M anyway (padding cannot make it row-invariant), and the copies cost launches.
ROW_TILE = 16


def linear(x: torch.Tensor, weight: torch.Tensor | Fp8BlockWeight) -> torch.Tensor:
    """y = x @ weight.T (weight [out, in]), row-invariant across batch sizes on the CPU. An FP8 weight kept as
    stored is dequantised to x's dtype first: the same matrix the loader builds when it dequantises at load."""
    if isinstance(weight, Fp8BlockWeight):
        weight = weight.dense(x.dtype)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    pad = -m % ROW_TILE if x.device.type == "cpu" else 0
    if pad:
        x2 = torch.cat([x2, x2.new_zeros(pad, x2.shape[1])])
    return torch.nn.functional.linear(x2, weight)[:m].reshape(*lead, weight.shape[0])
