"""Registry-facing `engram_hash` and `engram_gate` on the kernels of engram_kernel.py. Same signatures and result
dtypes as deepinfer.kernels.torch.engram. Neither synchronises with the host, so decode steps under CUDA-graph
capture can call them; a step with no token returns the empty result without a launch.

* engram_hash: bitwise the torch op's ids for any int64 input (wrapping products, torch's remainder). Kernel path:
  CUDA int64 tokens [T, N] (N >= 2), multipliers [L, N], primes [L, N - 1, heads], offsets [L, (N - 1) * heads]
  on one device (the model's layout); other shapes or dtypes go to the torch op.
* engram_gate: close to the torch op (its sums run in another order; the GPU test bounds the difference against a
  float64 reference). Kernel path: CUDA bf16 streams [T, hc, D] (D a multiple of 4, at most MAX_GATE_DIM), key of
  the same shape, value [T, D], weight [hc, D], each fp32 or bf16, on one device; else the torch op.
  Batch invariance: one block per (token, stream) whose reduction order depends on D only, so a token's output is
  bitwise the same alone or in any batch; the kernel serves the batch-invariant mode as well (the torch op needs
  its 64-token chunks there, the kernel does not).
"""

import numpy as np
import torch

from deepinfer.kernels.registry import fall_back
from deepinfer.kernels.torch import engram as torch_engram

from ._build import dense, jit
from ._fallback import reason
from .engram_kernel import build_engram_gate, build_engram_hash

MAX_GATE_DIM = 16384  # the gate kernel keeps a stream's row in registers: 4 * ceil(D / 1024) bf16 per thread
_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


def _hash_shapes(tokens, multipliers, primes, offsets):
    """(N, L, heads) when the kernel covers the call, else None."""
    ts = (tokens, multipliers, primes, offsets)
    if not (all(t.is_cuda and t.dtype == torch.int64 and t.device == tokens.device for t in ts)
            and tokens.dim() == 2 and multipliers.dim() == 2 and primes.dim() == 3 and offsets.dim() == 2):
        return None
    n, (layers, _, heads) = tokens.shape[1], primes.shape
    ok = (n >= 2 and layers >= 1 and heads >= 1 and tuple(multipliers.shape) == (layers, n)
          and tuple(primes.shape) == (layers, n - 1, heads) and tuple(offsets.shape) == (layers, (n - 1) * heads))
    return (n, layers, heads) if ok else None


def engram_hash(
    tokens: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """Same contract as deepinfer.kernels.torch.engram.engram_hash (module docstring for the kernel path)."""
    plan = _hash_shapes(tokens, multipliers, primes, offsets)
    if plan is None:
        return fall_back("engram_hash", reason(tokens, "shapes not covered", (torch.int64,)),
                         torch_engram.engram_hash, tokens, multipliers, primes, offsets)
    n, layers, heads = plan
    out = torch.empty(tokens.shape[0], layers, (n - 1) * heads, dtype=torch.int64, device=tokens.device)
    if tokens.shape[0]:
        jit(build_engram_hash, n, layers, heads)(dense(tokens), dense(multipliers), dense(primes), dense(offsets), out)
    return out


def _gate_ok(streams, key, value, weight) -> bool:
    if not (streams.is_cuda and streams.dtype == torch.bfloat16 and streams.dim() == 3
            and all(t.dtype in _DTYPES for t in (key, value, weight))
            and all(t.device == streams.device for t in (key, value, weight))):
        return False
    n_tok, hc, dim = streams.shape
    return (0 < dim <= MAX_GATE_DIM and dim % 4 == 0 and hc >= 1 and key.shape == streams.shape
            and tuple(value.shape) == (n_tok, dim) and tuple(weight.shape) == (hc, dim))


def engram_gate(
    streams: torch.Tensor, key: torch.Tensor, value: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Same contract as deepinfer.kernels.torch.engram.engram_gate (module docstring for the kernel path)."""
    if not _gate_ok(streams, key, value, weight):
        return fall_back("engram_gate", reason(streams, "shapes or dtypes not covered"), torch_engram.engram_gate,
                         streams, key, value, weight, eps)
    n_tok, hc, dim = streams.shape
    out = torch.empty(n_tok, hc, dim, dtype=streams.dtype, device=streams.device)
    if n_tok:
        eps32 = float(np.float32(eps))  # torch adds eps to an fp32 tensor as an fp32 scalar
        kernel = jit(build_engram_gate, hc, dim, _DTYPES[key.dtype], _DTYPES[value.dtype], _DTYPES[weight.dtype])
        kernel(dense(streams), dense(key), dense(value), dense(weight), out, eps32)
    return out
