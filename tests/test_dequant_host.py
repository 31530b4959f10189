"""dequant.py's CUDA functions compiled for the host by nvcc (cuda_bf16's host arithmetic) where nvcc is installed:
the pool rows' one-call dequantisation (di_dq_e2m1x16_e4m3, the attention kernel's pool path since the thirty-seventh
session) gives the bits of the two-step form it replaced (two calls of 8 codes, each converting the scale), for every
code in every nibble and every scale byte, and zeros for a row it does not keep."""

import shutil
import subprocess

import pytest

from deepinfer.kernels.tilelang.dequant import CUDA_SOURCE

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")

# the reference: di_dq_e2m1x8 with a 2^0 scale (codes as exact bf16 values), then times the e4m3 scale, for each
# half of the 8 bytes (the attention kernel's pool path until the thirty-seventh session)
MAIN = r"""
#include <cstdio>
#include <cstring>
static void two_step(const uint8_t* src, uint8_t s, uint16_t* out) {
  for (int h = 0; h < 2; ++h) {
    __nv_bfloat162 d[4];
    di_dq_e2m1x8(src + 4 * h, (uint8_t)127, d);
    __nv_fp8_e4m3 se = *reinterpret_cast<__nv_fp8_e4m3*>(&s);
    __nv_bfloat162 scale = __float2bfloat162_rn(float(se));
    for (int i = 0; i < 4; ++i) d[i] = __hmul2(d[i], scale);
    memcpy(out + 8 * h, d, 16);
  }
}
static bool is_nan(uint16_t b) { return (b & 0x7F80u) == 0x7F80u && (b & 0x7Fu); }
int main() {
  long checked = 0, bad = 0, zeros_bad = 0;
  uint8_t rows[32][8];
  for (int c = 0; c < 16; ++c) for (int j = 0; j < 8; ++j) rows[c][j] = (uint8_t)(c | (c << 4));
  uint32_t x = 12345u;  // plus rows of mixed codes
  for (int r = 16; r < 32; ++r) for (int j = 0; j < 8; ++j) { x = x * 1664525u + 1013904223u; rows[r][j] = x >> 24; }
  for (int r = 0; r < 32; ++r) {
    for (int s = 0; s < 256; ++s) {
      uint16_t want[16], got[16], none[16];
      two_step(rows[r], (uint8_t)s, want);
      di_dq_e2m1x16_e4m3(rows[r], (uint8_t)s, true, got);
      di_dq_e2m1x16_e4m3(rows[r], (uint8_t)s, false, none);
      for (int i = 0; i < 16; ++i) {
        ++checked;
        if (!(want[i] == got[i] || (is_nan(want[i]) && is_nan(got[i])))) ++bad;
        if ((none[i] & 0x7FFFu) != 0 && !((s & 0x7F) == 0x7F)) ++zeros_bad;  // (a NaN scale stays NaN)
      }
    }
  }
  printf("checked %ld bad %ld zeros_bad %ld\n", checked, bad, zeros_bad);
  return bad || zeros_bad;
}
"""


def test_the_pool_rows_one_call_dequantisation_is_the_two_step_form_bit_for_bit(tmp_path):
    src = CUDA_SOURCE
    for fn in ("di_dq_e2m1x8", "di_dq_e2m1x16_e4m3"):  # (di_dq_e4m3x8's __byte_perm has no host form)
        src = src.replace(f"__device__ __forceinline__ void {fn}(", f"__host__ __device__ __forceinline__ void {fn}(")
    src += MAIN
    (tmp_path / "t.cu").write_text(src)
    build = subprocess.run(["nvcc", "-std=c++17", "-o", str(tmp_path / "t"), str(tmp_path / "t.cu")],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-2000:]
    run = subprocess.run([str(tmp_path / "t")], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("checked 131072 bad 0 zeros_bad 0"), run.stdout
