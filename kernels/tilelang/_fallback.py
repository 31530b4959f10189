"""The reason a TileLang op hands a call to the torch op, for the per-call fallback counts of the registry
(deepinfer.kernels.registry.fall_back): the first of device, dtype and emptiness that rules the kernel out,
else the op's own phrase for the shapes its kernels do not cover."""

import torch


def reason(x: torch.Tensor, shapes: str, dtypes=(torch.bfloat16,)) -> str:
    if not x.is_cuda:
        return "input not on CUDA"
    if x.dtype not in dtypes:
        return f"dtype {str(x.dtype).removeprefix('torch.')}"
    if x.numel() == 0:
        return "empty input"
    return shapes
