"""CPU checks of the row-wise TileLang kernels (rowwise_kernel.py / rowwise.py), no GPU needed:
* every builder the wrappers can pick for the model's widths lowers to CUDA source for sm_90a and sm_100a, with the
  roundings the bit-exactness relies on visible in the source (`__fmul_rn`, accurate cosf / sinf, rsqrtf);
* the lane table of ATen's row reduction (rowwise.torch_reduce_lanes), and the lines of the installed torch's
  Reduce.cuh it was read from (so a torch upgrade that changes the order fails here, not silently on the GPU);
* numpy models of the quantisers' bit arithmetic, written op for op like the kernels, against the torch ops on
  the CPU (the e4m3 conversion, ue8m0 scales and e2m1 rounding are the same code on CPU and CUDA in torch).
"""

import importlib.util
import pathlib

import numpy as np
import pytest
import torch

from deepinfer.kernels.torch import quant

tilelang_missing = importlib.util.find_spec("tilelang") is None
needs_tilelang = pytest.mark.skipif(tilelang_missing, reason="tilelang is not installed")

NORM_DIMS = (128, 512, 1024, 1280, 5120)


def _kernels():
    from deepinfer.kernels.tilelang import rowwise_kernel as k

    out = {}
    for d in NORM_DIMS:
        out[f"rms_warp_{d}"] = lambda d=d: k.build_rms_norm_warp(d, "bf16")
        if d >= 256:
            out[f"rms_block_{d}"] = lambda d=d: k.build_rms_norm_block(d, "bf16")
    out["rms_warp_512_fp32w"] = lambda: k.build_rms_norm_warp(512, "fp32")
    out["rms_block_512_fp32w"] = lambda: k.build_rms_norm_block(512, "fp32")
    for d in (512, 128):
        for inv in (False, True):
            out[f"rope_{d}_{'inv' if inv else 'fwd'}"] = lambda d=d, inv=inv: k.build_rope(d, 64, inv)
    out["rope_512_fwd_inplace"] = lambda: k.build_rope(512, 64, False, inplace=True)
    out["fp8_32"] = lambda: k.build_fake_quant("fp8", 32)
    out["fp4_ue8m0_32"] = lambda: k.build_fake_quant("fp4_ue8m0", 32)
    out["fp4_e4m3_16"] = lambda: k.build_fake_quant("fp4_e4m3", 16)
    out["fp8_32_encode"] = lambda: k.build_fake_quant("fp8", 32, encode=True)
    out["fp4_ue8m0_32_encode"] = lambda: k.build_fake_quant("fp4_ue8m0", 32, encode=True)
    out["fp4_e4m3_16_encode"] = lambda: k.build_fake_quant("fp4_e4m3", 16, encode=True)
    from deepinfer.kernels.tilelang.window_kv_kernel import build_window_kv

    for d in (512, 5120):
        out[f"window_kv_{d}"] = lambda d=d: build_window_kv(d, 64)
    return out


NAMES = ([f"rms_warp_{d}" for d in NORM_DIMS] + [f"rms_block_{d}" for d in NORM_DIMS if d >= 256]
         + ["rms_warp_512_fp32w", "rms_block_512_fp32w", "rope_512_fwd", "rope_512_inv", "rope_128_fwd",
            "rope_128_inv", "rope_512_fwd_inplace", "fp8_32", "fp4_ue8m0_32", "fp4_e4m3_16", "fp8_32_encode", "fp4_ue8m0_32_encode",
            "fp4_e4m3_16_encode", "window_kv_512", "window_kv_5120"])


@needs_tilelang
def test_names_cover_builders():
    assert set(NAMES) == set(_kernels())


@needs_tilelang
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("name", NAMES)
def test_rowwise_kernel_lowers_to_cuda(name, arch):
    from lowering_helpers import lower_source

    src = lower_source(_kernels()[name](), arch)
    assert "__global__" in src
    assert "__cosf" not in src and "__sinf" not in src and "__expf" not in src  # no fast-math intrinsics
    if name.startswith("rms"):
        assert "__fmul_rn" in src and "rsqrtf(" in src  # squares rounded before the sum (no fma contraction)
        if "warp" in name:
            assert "__shfl_xor_sync" in src
    if name.startswith("rope"):
        assert "cosf(" in src and "sinf(" in src and "__fsub_rn" in src and "__fadd_rn" in src
        assert "*(uint4*)" in src  # 16-byte vector loads / stores
        # in place: only the rotated chunks (8 of a row's 64 at 512 wide, from channel 448), no copy branch
        assert ("(int64_t)448))" in src) == name.endswith("inplace"), name
    if name.startswith("fp"):
        assert "*(uint4*)" in src and "__shfl_xor_sync" in src
        assert ("__fdiv_rn" in src) == ("e4m3" in name)
    if name.startswith("window_kv"):  # the norm's rounded squares, rope's accurate cos / sin, the amax shuffles,
        # and the codes (4 bytes a thread) and the block's scale byte stored at the write row, nothing else stored
        assert "__fmul_rn" in src and "rsqrtf(" in src and "cosf(" in src and "sinf(" in src
        assert "__shfl_xor_sync" in src and "write_row[" in src
        assert "*(uint*)(ring_codes + " in src and "ring_scale[" in src
    if name.endswith("encode"):  # the codes as 8 bytes (fp8) or 4 e2m1 pairs, the block's scale byte from its first lane
        assert ("*(uint*)(codes + " if name.startswith("fp4") else "*(uint2*)(codes + ") in src and "scale[" in src


@needs_tilelang
def test_registry_functions_keep_the_torch_signatures():
    import inspect

    from deepinfer.kernels.tilelang import rowwise
    from deepinfer.kernels.torch import norm, rope

    from deepinfer.kernels.tilelang import window_kv as tl_window_kv
    from deepinfer.kernels.torch import cache_formats
    from deepinfer.kernels.torch import window_kv as torch_window_kv

    for ours, ref in ((rowwise.rms_norm, norm.rms_norm), (rowwise.rope, rope.rope),
                      (rowwise.fake_quant_fp8, quant.fake_quant_fp8), (rowwise.fake_quant_fp4, quant.fake_quant_fp4),
                      (rowwise.encode_fp8, cache_formats.encode_fp8), (rowwise.encode_fp4, cache_formats.encode_fp4),
                      (tl_window_kv.window_kv, torch_window_kv.window_kv)):
        assert inspect.signature(ours, eval_str=True) == inspect.signature(ref, eval_str=True), ours.__name__


@needs_tilelang
def test_cpu_inputs_take_the_torch_op():
    from deepinfer.kernels.tilelang import rowwise
    from deepinfer.kernels.torch import norm, rope

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 512, generator=g).bfloat16()
    w = torch.randn(512, generator=g).bfloat16()
    assert torch.equal(rowwise.rms_norm(x, w, 1e-6), norm.rms_norm(x, w, 1e-6))
    inv = rope.default_inv_freq(10000.0, 64)
    pos = torch.tensor([0, 7, 900])
    assert torch.equal(rowwise.rope(x, pos, inv, True), rope.rope(x, pos, inv, True))
    y = x.clone()
    assert rowwise.rope(y, pos, inv, True, inplace=True) is y and torch.equal(y, rope.rope(x, pos, inv, True))
    assert torch.equal(rowwise.fake_quant_fp8(x, 32), quant.fake_quant_fp8(x, 32))
    assert torch.equal(rowwise.fake_quant_fp4(x, 16, True), quant.fake_quant_fp4(x, 16, True))
    from deepinfer.kernels.torch import cache_formats

    for got, ref in zip(rowwise.encode_fp4(x, 16, True), cache_formats.encode_fp4(x, 16, True)):
        assert torch.equal(got, ref)


# ---------------------------------------------------------------------------------------------- ATen order
@needs_tilelang
@pytest.mark.parametrize("dim,rows,lanes", [
    (5120, 1, 512), (5120, 2, 256), (5120, 3, 256), (5120, 4, 128), (5120, 7, 128), (5120, 8, 64), (5120, 15, 64),
    (5120, 16, 32), (5120, 300, 32), (5120, 32768, 32),
    (512, 1, 128), (512, 4, 128), (512, 8, 64), (512, 16, 32), (512, 8192, 32),
    (1024, 1, 256), (1024, 2, 256), (1024, 4, 128), (1280, 1, 256), (1280, 8, 64), (1280, 300, 32),
    (128, 1, 32), (128, 7, 32), (128, 8192, 32),
    (8192, 16, None),   # 256 values per lane: ATen splits the row across warps (not emulated)
    (7680, 1, 512), (96, 4, None), (130, 1, None),
])
def test_torch_reduce_lanes(dim, rows, lanes):
    from deepinfer.kernels.tilelang.rowwise import torch_reduce_lanes

    assert torch_reduce_lanes(dim, rows) == lanes


def _reduce_cuh():
    p = pathlib.Path(torch.__file__).parent / "include" / "ATen" / "native" / "cuda" / "Reduce.cuh"
    return p.read_text() if p.exists() else None


@pytest.mark.skipif(_reduce_cuh() is None, reason="torch ships no ATen CUDA headers")
def test_installed_aten_reduce_order_is_the_emulated_one():
    src = " ".join(_reduce_cuh().split())
    for line in (
        "static constexpr int MAX_NUM_THREADS = 512;",                       # mnt_wrapper<float>
        "reduction_on_fastest_striding_dimension && dim0 >= 128 && iter.num_reduce_dims() == 1",  # 4-wide input
        "block_width = std::min(dim0_pow2, int(at::cuda::warp_size()));",
        "block_height = std::min(dim1_pow2, int(max_num_threads / block_width));",
        "block_width = std::min(dim0_pow2, int(max_num_threads / block_height));",
        "std::min<int>(block_height * 16, max_values_per_thread);",
        "value_list[i] = ops.reduce(value_list[i], values_vec.val[i], shift + idx * input_vec_size + i);",
        "value_list[0] = ops.combine(value_list[0], value_list[i]);",
        "for (int offset = dim_x/2; offset >= C10_WARP_SIZE; offset >>= 1) {",
        "for (int offset = dim_x >> 1; offset > 0; offset >>= 1) {",        # CUDA warp fold: halving
        "template <typename scalar_t, typename out_scalar_t, int vt0=4, int input_vec_size=vt0,",
    ):
        assert line in src, line


# ---------------------------------------------------------------------------------------------- quant models
def _bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _flt(b):
    return np.ascontiguousarray(b, dtype=np.uint32).view(np.float32)


def model_e4m3(v):
    """rowwise_kernel._e4m3, op for op."""
    b = _bits(v)
    sign = b & np.uint32(0x80000000)
    mag = b ^ sign
    a = np.minimum(mag, np.uint32(0x43E00000))
    sub = _bits((_flt(a) + np.float32(16384.0)) - np.float32(16384.0))
    nrm = (a + np.uint32(0x7FFFF) + ((a >> np.uint32(20)) & np.uint32(1))) & np.uint32(0xFFF00000)
    q = np.where(a < np.uint32(121 << 23), sub, nrm)
    q = np.where(mag > np.uint32(0x7F800000), mag, q)
    return _flt(q | sign)


def model_e2m1_magnitude(a):
    """rowwise_kernel._e2m1_magnitude."""
    steps = ((a > 0.25, 0.5), (a >= 0.75, 0.5), (a > 1.25, 0.5), (a >= 1.75, 0.5), (a > 2.5, 1.0), (a >= 3.5, 1.0),
             (a > 5.0, 2.0))
    mag = np.zeros_like(a, dtype=np.float32)
    for cond, step in steps:
        mag = mag + np.where(cond, np.float32(step), np.float32(0.0))
    return mag


def _pow2(k):
    return _flt(((k + 127).astype(np.uint32)) << np.uint32(23))


def model_fake_quant(x: torch.Tensor, kind: str, block: int, cuda_scalar_div: bool = True) -> torch.Tensor:
    """rowwise_kernel.build_fake_quant on bf16 x. cuda_scalar_div=False divides amax by 6 (the CPU op) instead
    of multiplying by fp32(1/6) (the CUDA op) in the e4m3-scale variant."""
    from deepinfer.kernels.tilelang.rowwise_kernel import f32

    xf = x.float().numpy().reshape(-1, block)
    fp4 = kind != "fp8"
    qmax = np.float32(6.0 if fp4 else 448.0)
    floor = np.float32({"fp8": f32(1e-4), "fp4_ue8m0": 6.0 * 2.0**-126, "fp4_e4m3": 6.0 * 2.0**-9}[kind])
    recip = np.float32(f32(1.0 / 6.0) if fp4 else f32(1.0 / 448.0))
    m = np.maximum(np.abs(xf).max(-1, keepdims=True), floor)
    if kind == "fp4_e4m3":
        sc = model_e4m3(m * recip if cuda_scalar_div else m / np.float32(6.0))
        q = xf / sc
    else:
        b = _bits(m * recip)
        k = ((b >> np.uint32(23)) & np.uint32(0xFF)).astype(np.int32) - 127 + ((b & np.uint32(0x7FFFFF)) != 0)
        sc, q = _pow2(k), xf * _pow2(-k)
    q = np.minimum(np.maximum(q, -qmax), qmax)
    if fp4:
        out = _flt(_bits(model_e2m1_magnitude(np.abs(q)) * sc) | (_bits(q) & np.uint32(0x80000000)))
    else:
        out = model_e4m3(q) * sc
    return torch.from_numpy(out.reshape(x.shape)).to(torch.bfloat16)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def quant_inputs(rows: int, width: int, block: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """bf16 [rows, width]: per-block magnitudes over 2^-60..2^60, bf16 subnormals, blocks under the scale floor,
    blocks near bf16's max, signed zeros, and blocks of exact rounding ties (e4m3 midpoints for fp8; e2m1
    boundaries 0.25 .. 5 for fp4) at an exactly known scale. Shared by the GPU test (same construction)."""
    nb = rows * width // block
    mag = torch.exp2(torch.randint(-60, 61, (nb, 1), generator=gen).float())
    x = torch.randn(nb, block, generator=gen) * mag
    sel = torch.randint(0, 10, (nb,), generator=gen)
    x[sel == 0] = torch.randn(int((sel == 0).sum()), block, generator=gen) * 1e-39           # bf16 subnormals
    x[sel == 1] = torch.randn(int((sel == 1).sum()), block, generator=gen) * 3e-5            # under the floor
    x[sel == 2] = torch.randn(int((sel == 2).sum()), block, generator=gen).clamp(-1.7, 1.7) * 1e38  # near max
    if kind == "fp4_e4m3":  # amax / 6 over 448: the scale saturates at 448, values clamp to +-6
        x[sel == 3] = torch.randn(int((sel == 3).sum()), block, generator=gen) * 4000.0
    ties = (sel >= 8).nonzero().flatten()
    k = torch.randint(-30, 31, (len(ties),), generator=gen).float()
    if kind == "fp8":  # scale 2^k exactly (amax 400 * 2^k); midpoints between adjacent e4m3 values
        grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        mids = (grid[:-1] + grid[1:]) / 2
        pick = mids[torch.randint(0, len(mids), (len(ties), block), generator=gen)]
        pick[:, 0] = 400.0
        x[ties] = pick * torch.exp2(k)[:, None]
    else:
        bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
        pick = bounds[torch.randint(0, 7, (len(ties), block), generator=gen)]
        pick[:, 0] = 6.0  # amax = 6 * scale: ue8m0 scale 2^k, e4m3 scale s exactly
        if kind == "fp4_e4m3":
            s = torch.tensor([0.875, 0.5, 1.25, 0.0390625, 3.0])[torch.randint(0, 5, (len(ties),), generator=gen)]
        else:
            s = torch.exp2(k)
        x[ties] = pick * s[:, None]
    x = x * torch.where(torch.rand(nb, block, generator=gen) < 0.5, -1.0, 1.0)
    x = x.bfloat16().view(rows, width)
    flat = x.view(-1)
    z = torch.randint(0, flat.numel(), (max(1, flat.numel() // 500),), generator=gen)
    flat[z] = torch.where(torch.rand(len(z), generator=gen) < 0.5, 0.0, -0.0).bfloat16()
    return x


def test_model_e4m3_matches_torch_conversion():
    rng = np.random.default_rng(0)
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    mids = (grid[:-1] + grid[1:]) / 2
    v = np.concatenate([
        grid, mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(1000)),
        [448, 449, 463.99, 464, 464.01, 479, 480, 500, 1e6, 3e38, np.inf, 2.0**-10, 3 * 2.0**-11, 1e-45, 0.0],
        (rng.standard_normal(20000) * np.exp2(rng.integers(-14, 10, 20000))),
    ]).astype(np.float32)
    v = np.concatenate([v, -v])
    ref = torch.from_numpy(v).to(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(_bits(model_e4m3(v)), _bits(ref))
    nan = model_e4m3(np.array([np.nan], dtype=np.float32))
    assert np.isnan(nan).all()


def test_model_e2m1_matches_torch_codes():
    b = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
    v = np.concatenate([b, np.nextafter(b, np.float32(0)), np.nextafter(b, np.float32(7)), [0, 0.5, 1, 1.5, 2, 3, 4, 6],
                        np.random.default_rng(1).uniform(0, 6, 5000)]).astype(np.float32)
    ref = quant.e2m1_values(quant.e2m1_codes(torch.from_numpy(v))).numpy()
    assert np.array_equal(model_e2m1_magnitude(v), ref)


@pytest.mark.parametrize("kind,block,width", [("fp8", 32, 512), ("fp4_ue8m0", 32, 128), ("fp4_e4m3", 16, 512)])
def test_model_fake_quant_matches_torch_op(kind, block, width):
    """The kernel's formula = the torch op (CPU). The CPU op divides amax by 6 where CUDA multiplies by fp32(1/6):
    the e4m3-scale model is compared in the CPU form here; the GPU test compares the kernel with the CUDA op."""
    pytest.importorskip("tilelang")
    x = quant_inputs(64, width, block, kind, torch.Generator().manual_seed(7))
    if kind == "fp8":
        ref = quant.fake_quant_fp8(x, block)
    else:
        ref = quant.fake_quant_fp4(x, block, kind == "fp4_e4m3")
    assert _same_bits(model_fake_quant(x, kind, block, cuda_scalar_div=False), ref)
    if kind != "fp4_e4m3":
        assert _same_bits(model_fake_quant(x, kind, block), ref)


def model_e2m1_code(a):
    """rowwise_kernel._e2m1_code: the grid steps below a = |v|, counted."""
    code = np.zeros_like(a, dtype=np.uint32)
    for cond in (a > 0.25, a >= 0.75, a > 1.25, a >= 1.75, a > 2.5, a >= 3.5, a > 5.0):
        code = code + cond.astype(np.uint32)
    return code


def model_encode_fp4(x: torch.Tensor, block: int, e4m3_scales: bool):
    """build_fake_quant(fp4, encode=True)'s outputs on bf16 x [rows, width], in the CPU op's division form: the
    e2m1 pairs (the code of the even channel in the low nibble, sign in bit 3) and the scale bytes."""
    from deepinfer.kernels.tilelang.rowwise_kernel import f32

    xf = x.float().numpy().reshape(-1, block)
    floor = np.float32(6.0 * 2.0**-9 if e4m3_scales else 6.0 * 2.0**-126)
    m = np.maximum(np.abs(xf).max(-1, keepdims=True), floor)
    if e4m3_scales:
        sc = model_e4m3(m / np.float32(6.0))
        q, byte = xf / sc, e4m3_byte_model(sc)
    else:
        b = _bits(m * np.float32(f32(1.0 / 6.0)))
        k = ((b >> np.uint32(23)) & np.uint32(0xFF)).astype(np.int32) - 127 + ((b & np.uint32(0x7FFFFF)) != 0)
        q, byte = xf * _pow2(-k), (k + 127).astype(np.uint8)
    q = np.minimum(np.maximum(q, np.float32(-6.0)), np.float32(6.0))
    code = (model_e2m1_code(np.abs(q)) | ((_bits(q) >> np.uint32(28)) & np.uint32(8))).reshape(x.shape[0], -1)
    packed = (code[:, 0::2] | (code[:, 1::2] << np.uint32(4))).astype(np.uint8)
    return torch.from_numpy(packed), torch.from_numpy(byte.reshape(x.shape[0], -1))


def test_model_e2m1_code_matches_torch_codes():
    b = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
    v = np.concatenate([b, np.nextafter(b, np.float32(0)), np.nextafter(b, np.float32(7)), [0, 0.5, 1, 1.5, 2, 3, 4, 6],
                        np.random.default_rng(2).uniform(0, 6, 5000)]).astype(np.float32)
    assert np.array_equal(model_e2m1_code(v), quant.e2m1_codes(torch.from_numpy(v)).numpy())


@pytest.mark.parametrize("block,e4m3_scales,width", [(32, False, 128), (16, True, 512)])
def test_model_encode_fp4_is_the_codec_encode(block, e4m3_scales, width):
    """The FP4 encode kernel's formula = cache_formats.Fp4Codec's encode on the CPU, bytes for bytes (the indexer
    keys' codec and the compressed KV's), over the quantiser test inputs (ties, signed zeros, subnormals)."""
    from deepinfer.kernels.torch import cache_formats

    kind = "fp4_e4m3" if e4m3_scales else "fp4_ue8m0"
    x = quant_inputs(64, width, block, kind, torch.Generator().manual_seed(11))
    if e4m3_scales:  # blocks whose scale saturates: torch's fp32 -> e4m3 of amax / 6 differs across versions
        x = x.view(-1, block)
        x = torch.where(x.float().abs().amax(-1, keepdim=True) > 2000, torch.zeros_like(x), x).view(64, width)
    packed, scale = model_encode_fp4(x, block, e4m3_scales)
    ref_packed, ref_scale = cache_formats.encode_fp4(x, block, e4m3_scales)
    assert torch.equal(packed, ref_packed) and torch.equal(scale, ref_scale)


def e4m3_byte_model(r: np.ndarray) -> np.ndarray:
    """rowwise_kernel._e4m3_byte in numpy, op for op: the float8_e4m3fn byte of an fp32 value already rounded to
    e4m3 (normal: exponent - 120 and 3 mantissa bits; below 2^-6: |r| * 512; NaN: 0x7F), with r's sign."""
    b = r.astype(np.float32).view(np.uint32)
    a = b & np.uint32(0x7FFFFFFF)
    normal = (((a >> 23) - np.uint32(120)) << 3) | ((a >> 20) & np.uint32(7))
    with np.errstate(invalid="ignore"):  # NaN lanes compute a value np.where then drops
        sub = (a.view(np.float32) * np.float32(512.0)).astype(np.uint32)
    mag = np.where(a > 0x7F800000, np.uint32(0x7F), np.where(a >= np.uint32(121 << 23), normal, sub))
    return (mag | ((b >> 24) & np.uint32(0x80))).astype(np.uint8)


def test_the_e4m3_byte_arithmetic_gives_every_code():
    """Each of the 256 float8_e4m3fn bytes, as the fp32 value it stands for, maps back to itself (both NaN codes
    to the kernel's NaN, 0x7F with the sign)."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(torch.float8_e4m3fn).float().numpy()
    got = e4m3_byte_model(values)
    nan = (codes & 0x7F) == 0x7F
    assert np.array_equal(got[~nan.numpy()], codes.numpy()[~nan.numpy()])
    assert np.array_equal(got[nan.numpy()], (codes[nan] & 0x80 | 0x7F).numpy())


def test_rope_in_place_writes_the_same_values_into_x():
    """The torch op in place (the model's queries and attention outputs, temporaries of their step): the rotated
    channels written into x, the others untouched, x returned; bitwise the out-of-place result, also on a
    strided x."""
    from deepinfer.kernels.torch import rope

    g = torch.Generator().manual_seed(3)
    inv = rope.default_inv_freq(10000.0, 64)
    pos = torch.tensor([0, 5, 70000])
    for x in (torch.randn(3, 4, 512, generator=g).bfloat16(), torch.randn(3, 4, 1024, generator=g)[..., 256:768]):
        for inverse in (False, True):
            expect = rope.rope(x, pos, inv, inverse)
            y = x.clone() if x.is_contiguous() else x.clone()[..., :]
            got = rope.rope(y, pos, inv, inverse, inplace=True)
            assert got is y and torch.equal(y, expect) and torch.equal(y[..., :-64], x[..., :-64])


@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="tilelang is not installed")
def test_small_rope_launches_take_one_chunk_a_thread(monkeypatch):
    """rowwise.ROPE_ONE_CHUNK_BELOW (65536 chunks by default): below it a launch's threads take one chunk each, above
    four; at 0 every launch four (the out-of-place spec without its defaults)."""
    from deepinfer.kernels.tilelang import rowwise
    from deepinfer.kernels.torch.rope import default_inv_freq

    specs = []
    monkeypatch.setattr(rowwise, "jit", lambda builder, *a: specs.append(a) or (lambda *t: None))
    monkeypatch.setattr(rowwise, "_rope_ok", lambda *a: True)
    inv = default_inv_freq(10000.0, 64)

    def launch(tokens, inplace):
        specs.clear()
        x = torch.zeros(tokens, 64, 512, dtype=torch.bfloat16)
        rowwise.rope(x, torch.zeros(tokens, dtype=torch.int64), inv, inplace=inplace)
        return specs[0]

    assert rowwise.ROPE_ONE_CHUNK_BELOW == 1 << 16
    assert launch(1, True) == (512, 64, False, 128, 1, True) and launch(1, False) == (512, 64, False, 128, 1, False)
    assert launch(127, True) == (512, 64, False, 128, 1, True)  # 127 x 64 x 8 chunks: one a thread
    assert launch(128, True) == (512, 64, False, 128, 4, True)  # 128 x 64 x 8 = 65536: four a thread
    monkeypatch.setattr(rowwise, "ROPE_ONE_CHUNK_BELOW", 0)
    assert launch(1, True) == (512, 64, False, 128, 4, True) and launch(1, False) == (512, 64, False)
