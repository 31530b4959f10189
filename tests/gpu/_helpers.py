"""Shared helpers for the GPU kernel tests: random quantised tensors in the released formats, their exact
dequantisation through the torch reference ops, relative error, and allocator poisoning."""

import pytest
import torch

from deepinfer.kernels.torch import quant

# Files that build a Flash-width model (40-70 GiB each on the H200): with pytest-xdist's `--dist loadgroup` they run
# one at a time in one worker while the kernel tests share the others (two such models at once filled the GPU).
FLASH_WIDTH = pytest.mark.xdist_group("flash-width")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def poison_allocator(device="cuda"):
    """Fill freed blocks of both caching-allocator pools with NaN, so an output element a kernel forgets to
    write shows up as NaN instead of a stale finite value."""
    big = torch.full((64 << 20,), float("nan"), dtype=torch.float32, device=device)
    small = [torch.full((1 << 16,), float("nan"), dtype=torch.float32, device=device) for _ in range(32)]
    del big, small


def fp4_rows(rows: int, cols: int, gen: torch.Generator, scale_lo: int = 118, scale_hi: int = 124):
    """Packed e2m1 [rows, cols/2] (every code equally likely, so all 16 incl. 0 and +-0.5 appear) and ue8m0
    scales [rows, cols/32]; returns (packed uint8, scale uint8, dequantised fp32)."""
    dev = gen.device
    packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=gen, device=dev)
    scale = torch.randint(scale_lo, scale_hi, (rows, cols // 32), dtype=torch.uint8, generator=gen, device=dev)
    return packed, scale, quant.dequant_fp4_rows(packed, scale)


def fp8_blocks(rows: int, cols: int, gen: torch.Generator):
    """e4m3 [rows, cols] from random normals with ue8m0 scales per 32x32 block (as the checkpoint stores them)."""
    w = torch.randn(rows, cols, generator=gen, device=gen.device) * 0.02
    blocks = w.view(rows // 32, 32, cols // 32, 32)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-8)
    s = quant.ceil_pow2(amax / quant.FP8_MAX)
    codes = (blocks / s[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(rows, cols)
    scale = (torch.log2(s).round() + 127).to(torch.uint8)
    return codes.view(torch.uint8), scale, quant.dequant_fp8_blocks(codes, scale)


def fp8_rows32(rows: int, cols: int, gen: torch.Generator, amp: float = 3.0):
    """Window-KV format: e4m3 [rows, cols] with one ue8m0 scale per row and 32 channels."""
    x = torch.randn(rows, cols, generator=gen) * amp
    blocks = x.view(rows, cols // 32, 32)
    s = quant.ceil_pow2(blocks.abs().amax(-1).clamp_min(1e-4) / quant.FP8_MAX)
    codes = (blocks / s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    deq = (codes.float() * s[..., None]).view(rows, cols)
    scale = (torch.log2(s).round() + 127).to(torch.uint8)
    return codes.view(rows, cols).view(torch.uint8), scale, deq


def fp4_rows16_e4m3(rows: int, cols: int, gen: torch.Generator):
    """Compressed-KV format: e2m1 pairs [rows, cols/2] with an e4m3 scale per 16 channels [rows, cols/16]."""
    packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=gen)
    sc = (torch.rand(rows, cols // 16, generator=gen) * 1.5 + 0.05).to(torch.float8_e4m3fn)
    b = packed
    codes = torch.stack([b & 15, b >> 4], dim=-1).flatten(-2)
    deq = quant.e2m1_values(codes) * sc.float().repeat_interleave(16, dim=1)
    return packed, sc.view(torch.uint8), deq


def mhc_mixes64(streams, fn, scale, base, hc_eps, iters, norm_eps):
    """The torch op's formulas (deepinfer.kernels.torch.mhc.mhc_mixes) in float64: streams [t, hc, D] -> pre
    [t, hc], post [t, hc], comb [t, hc, hc] (the torch op computes in fp32 internally)."""
    t, hc, d = streams.shape
    flat = streams.reshape(t, hc * d).double()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    mixes = flat @ fn.double().T
    scale, base = scale.double(), base.double()
    pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(mixes[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = torch.softmax((mixes[:, 2 * hc:] * scale[2] + base[2 * hc:]).view(t, hc, hc), dim=-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return pre, post, comb
