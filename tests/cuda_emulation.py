"""Run a TileLang kernel's generated CUDA source on the CPU, for tests that must check a kernel without a GPU: the
kernel body is compiled by g++ with a small emulation layer (one OS thread per CUDA thread, blocks one after
another; __syncthreads = a barrier over the block, warp shuffles through per-warp slots, shared-memory atomics as
atomics, cp.async as a copy, bf16 as its top 16 bits with round-to-nearest-even).

What it can show: that two kernels compute the same bits from the same inputs (both run on the same emulated
intrinsics: `cosf`, `sinf` and `rsqrtf` are the host's, not the GPU's), that a kernel's indexing, lane orders and
stores are right, and a kernel's result against a torch op where no such intrinsic is involved. What it cannot: the
GPU's own last-bit behaviour of those intrinsics and of fma contraction (compiled here with -ffp-contract=off)."""

import ctypes
import re
import shutil
import subprocess

import torch

EMU_H = r"""
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <type_traits>
#include <vector>
typedef unsigned char uchar;
typedef unsigned int uint;
typedef unsigned short ushort;
struct alignas(16) uint4 { uint x, y, z, w; };
struct alignas(8) uint2 { uint x, y; };
struct alignas(16) float4 { float x, y, z, w; };
inline uint2 make_uint2(uint x, uint y) { return {x, y}; }
inline uint4 make_uint4(uint x, uint y, uint z, uint w) { return {x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
struct bfloat16_t {  // bf16 as the top half of an fp32, rounded to nearest even (NaN kept quiet)
  ushort bits;
  bfloat16_t() = default;
  bfloat16_t(float f) {
    uint u; std::memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) { bits = (ushort)((u >> 16) | 0x40); return; }
    u += 0x7FFFu + ((u >> 16) & 1u); bits = (ushort)(u >> 16);
  }
  operator float() const { uint u = (uint)bits << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
inline uint __pack_nv_bfloat162(bfloat16_t a, bfloat16_t b) { return (uint)a.bits | ((uint)b.bits << 16); }
struct Dim3 { int x, y, z; };
static thread_local Dim3 threadIdx, blockIdx;
static std::barrier<>* g_block;
static std::barrier<>* g_warp[32];
static long long g_slot[32][32];
alignas(1024) static uchar g_smem[232448];
#define __syncthreads() g_block->arrive_and_wait()
#define __global__
#define __launch_bounds__(...)
#define __restrict__ __restrict
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
template <class T> inline T emu_shfl_from(T v, int src_of_lane) {
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  long long b = 0; std::memcpy(&b, &v, sizeof(T)); g_slot[w][lane] = b;
  g_warp[w]->arrive_and_wait();
  T r = v; int src = src_of_lane;
  if (src >= 0 && src < 32) std::memcpy(&r, &g_slot[w][src], sizeof(T));
  g_warp[w]->arrive_and_wait();
  return r;
}
template <class T> inline T __shfl_down_sync(uint, T v, int d, int = 32) {
  return emu_shfl_from(v, (int)(threadIdx.x & 31) + d); }
template <class T> inline T __shfl_up_sync(uint, T v, int d, int = 32) {
  return emu_shfl_from(v, (int)(threadIdx.x & 31) - d); }
template <class T> inline T __shfl_xor_sync(uint, T v, int m, int = 32) {
  return emu_shfl_from(v, (int)(threadIdx.x & 31) ^ m); }
template <class T, class U> inline void AtomicAdd(T* p, U v) { __atomic_fetch_add(p, (T)v, __ATOMIC_RELAXED); }
template <class T, class U> inline void AtomicAdd(T& p, U v) { __atomic_fetch_add(&p, (T)v, __ATOMIC_RELAXED); }
inline int __popc(uint x) { return __builtin_popcount(x); }
template <class A, class B> inline typename std::common_type<A, B>::type max(A a, B b) {
  if constexpr (std::is_floating_point_v<A> || std::is_floating_point_v<B>) return std::fmax(a, b);
  else return a > b ? a : b; }
template <class A, class B> inline typename std::common_type<A, B>::type min(A a, B b) {
  if constexpr (std::is_floating_point_v<A> || std::is_floating_point_v<B>) return std::fmin(a, b);
  else return a < b ? a : b; }
namespace tl {
template <int N> inline void cp_async_gs_conditional(void* d, const void* s, bool p) {
  if (p) std::memcpy(d, s, N); else std::memset(d, 0, N); }
inline void cp_async_commit() {}
template <int N> inline void cp_async_wait() {}
}
template <class F> void emu_launch(int blocks, int nt, F body) {
  std::barrier<> bb(nt); g_block = &bb;
  std::vector<std::barrier<>*> wb;
  for (int w = 0; w < nt / 32; ++w) { wb.push_back(new std::barrier<>(32)); g_warp[w] = wb.back(); }
  std::vector<std::thread> th;
  for (int t = 0; t < nt; ++t)
    th.emplace_back([&, t] {
      threadIdx = {t, 0, 0};
      for (int b = 0; b < blocks; ++b) {
        blockIdx = {b, 0, 0};
        if (t == 0) std::memset(g_smem, 0xAB, sizeof(g_smem));  // shared memory starts as garbage
        bb.arrive_and_wait();
        body();
        bb.arrive_and_wait();
      }
    });
  for (auto& x : th) x.join();
  for (auto* p : wb) delete p;
}
"""


def gxx_ok() -> bool:
    """g++ with C++20's <barrier> (the emulation's block and warp barriers)."""
    gxx = shutil.which("g++")
    if not gxx:
        return False
    r = subprocess.run([gxx, "-std=c++20", "-x", "c++", "-fsyntax-only", "-"], input="#include <barrier>\n",
                       capture_output=True, text=True)
    return r.returncode == 0


def _ctype(param: str):
    kind = param.rsplit(" ", 1)[0]
    if "*" in kind:
        return ctypes.c_void_p
    return {"float": ctypes.c_float, "int": ctypes.c_int, "int64_t": ctypes.c_longlong}[kind.strip()]


def compile_kernel(src: str, tmp_path, name: str | None = None, prelude: str = ""):
    """The 1-D-grid kernel of TileLang CUDA source `src` as a Python callable run(blocks, **args): tensors (CPU,
    contiguous) by parameter name, scalars as ints / floats. `prelude`: host definitions of the helpers the kernel's
    imported device source defines (that source is not compiled here). Returns (run, parameter names)."""
    body = src[src.index('extern "C" __global__ void __launch_bounds__'):]
    # dynamic shared memory: the emulation's block-wide buffer
    body = re.sub(r"extern __shared__ __align__\(\d+\) (\w+) (\w+)\[\];", r"\1* \2 = (\1*)g_smem;", body)
    m = re.search(r"void __launch_bounds__\((\d+)(?:, \d+)?\) (\w+)\((.*?)\) \{", body)
    threads, kname, sig = int(m.group(1)), m.group(2), m.group(3)
    params = [p.strip() for p in sig.split(",")]
    names = [p.split()[-1] for p in params]
    code = EMU_H + prelude + body + ('\nextern "C" void launch(int emu_blocks, ' + ", ".join(params) + ") {\n"
                           f"  emu_launch(emu_blocks, {threads}, [&] {{ {kname}(" + ", ".join(names) + "); });\n}\n")
    stem = name or kname
    (tmp_path / f"{stem}.cpp").write_text(code)
    subprocess.check_call(["g++", "-std=c++20", "-O1", "-ffp-contract=off", "-fno-strict-aliasing", "-w", "-shared",
                           "-fPIC", "-pthread", str(tmp_path / f"{stem}.cpp"), "-o", str(tmp_path / f"{stem}.so")])
    lib = ctypes.CDLL(str(tmp_path / f"{stem}.so"))
    lib.launch.argtypes = [ctypes.c_int] + [_ctype(p) for p in params]

    def run(blocks: int, **args):
        vals = []
        for n, p in zip(names, params):
            v = args[n]
            if isinstance(v, torch.Tensor):
                assert v.is_contiguous() and v.device.type == "cpu", n
                vals.append(v.data_ptr())
            else:
                vals.append(v)
        lib.launch(blocks, *vals)

    return run, names
