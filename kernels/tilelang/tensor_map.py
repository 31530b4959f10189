"""TMA tensor maps (CUtensorMap, the driver's cuTensorMapEncodeTiled) for kernels written in CUDA through
TileLang's call_extern, which cannot take one as a launch parameter: the 128-byte map is encoded on the host and
copied to a device buffer the kernel reads it from (a tensor map may live in global memory; the kernel acquires it
with fence.proxy.tensormap before its first copy). One map per (tensor, box), kept as long as the tensor lives."""

from __future__ import annotations

import ctypes
import functools

import torch

SWIZZLE_NONE, SWIZZLE_128B = 0, 3
_UINT8, _INTERLEAVE_NONE, _L2_PROMOTION_256B, _OOB_FILL_NONE = 0, 0, 3, 0


@functools.lru_cache(maxsize=1)
def _encode_tiled():
    fn = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    u32, u64, p = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p
    fn.argtypes = [p, ctypes.c_int, u32, p, ctypes.POINTER(u64), ctypes.POINTER(u64), ctypes.POINTER(u32),
                   ctypes.POINTER(u32), ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return fn


def encode_2d_u8(t: torch.Tensor, box_cols: int, box_rows: int, swizzle: int = SWIZZLE_128B) -> bytes:
    """The 128 bytes of a tensor map over `t` viewed as a 2-D uint8 matrix [rows, cols] (its last dim the columns,
    every other dim flattened into rows; contiguous), box [box_rows, box_cols] bytes."""
    assert t.dtype == torch.uint8 and t.is_cuda and t.is_contiguous() and t.data_ptr() % 16 == 0
    cols = t.shape[-1]
    rows = t.numel() // cols
    assert cols % 16 == 0 and 0 < box_cols <= 256 and 0 < box_rows <= 256
    assert swizzle != SWIZZLE_128B or box_cols <= 128
    raw = (ctypes.c_uint8 * 192)()  # CUtensorMap: 128 bytes, 64-byte aligned
    addr = (ctypes.addressof(raw) + 63) // 64 * 64
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(cols)
    box = (ctypes.c_uint32 * 2)(box_cols, box_rows)
    elem = (ctypes.c_uint32 * 2)(1, 1)
    rc = _encode_tiled()(addr, _UINT8, 2, t.data_ptr(), dims, strides, box, elem, _INTERLEAVE_NONE, swizzle,
                         _L2_PROMOTION_256B, _OOB_FILL_NONE)
    if rc != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {rc}) for a [{rows}, {cols}] uint8 tensor, "
                           f"box [{box_rows}, {box_cols}], swizzle {swizzle}")
    return ctypes.string_at(addr, 128)


def device_map_2d_u8(t: torch.Tensor, box_cols: int, box_rows: int, swizzle: int = SWIZZLE_128B) -> torch.Tensor:
    """encode_2d_u8's map in a 128-byte device buffer (cached on `t` by box and swizzle, so a CUDA graph that
    captured a kernel reading it replays against the same buffer)."""
    cache = getattr(t, "_deepinfer_tmaps", None)
    if cache is None:
        cache = {}
        t._deepinfer_tmaps = cache
    key = (t.data_ptr(), tuple(t.shape), box_cols, box_rows, swizzle)
    if key not in cache:
        if torch.cuda.is_current_stream_capturing():  # the map's copy to the device cannot be captured
            raise RuntimeError("a tensor map's first use is inside a CUDA graph capture: call the kernel once "
                               "before capturing it")
        host = torch.frombuffer(bytearray(encode_2d_u8(t, box_cols, box_rows, swizzle)), dtype=torch.uint8)
        cache[key] = host.to(t.device)
    return cache[key]
