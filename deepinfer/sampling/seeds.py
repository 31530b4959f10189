"""Counter-based randomness: every random number is a pure function of (seq_seed, position, draw kind, index).

Why not a torch.Generator: a shared generator hands out numbers in the order rows are visited, so a request's
tokens would depend on its batch neighbours and their order. A counter-based hash has no state, so a request
samples the same tokens alone, in any batch, in any order, on any device.

The hash is splitmix64's output mixer (Steele, Lea, Flood 2014), written with torch int64 ops: additions and
multiplications wrap modulo 2**64 (two's complement on CPU and CUDA alike), and right shifts are made logical by
masking off the sign-extended bits. ``mix64_int`` is the pure-Python reference the torch version is tested against.
"""

from __future__ import annotations

import enum
import secrets

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64 increment (2**64 / golden ratio)
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


class DrawKind(enum.IntEnum):
    """What a random stream is used for; different kinds at the same position never share numbers."""

    TOKEN = 0  # the main sampled token
    DRAFT = 1  # speculative-decoding draft / verification draws
    GRAMMAR = 2  # reserved: anything else a future stage needs


_KIND_BITS = 2  # positions are spread as position * 4 + kind, so (position, kind) pairs never collide


def _signed(value: int) -> int:
    """A uint64 as the int64 with the same bits (torch has no full uint64 arithmetic)."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def mix64_int(x: int) -> int:
    """splitmix64's finaliser on Python ints: the reference for ``mix64``."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _M1) & _MASK64
    x = ((x ^ (x >> 27)) * _M2) & _MASK64
    return x ^ (x >> 31)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    # torch's >> on int64 is arithmetic; masking the top `bits` bits makes it the logical shift uint64 needs.
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on an int64 tensor holding uint64 bit patterns (wrapping arithmetic)."""
    x = (x ^ _shr(x, 30)) * _signed(_M1)
    x = (x ^ _shr(x, 27)) * _signed(_M2)
    return x ^ _shr(x, 31)


def stream_key_int(seed: int, position: int, kind: int) -> int:
    """The key of the random stream for one draw; a row's uniforms are splitmix64 outputs from this state."""
    return mix64_int(mix64_int(seed) ^ ((position << _KIND_BITS) | int(kind)))


def uniforms_at(keys: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """float64 uniforms in the open interval (0, 1): element k is a function of (keys[k], index[k]) only, the
    index[k]-th output of splitmix64 started from keys[k]. keys, index: int64 tensors of one shape."""
    state = keys + (index + 1) * _signed(_GOLDEN)  # splitmix64's counter, wrapping
    bits53 = _shr(mix64(state), 11)  # the top 53 bits: exactly representable in float64
    return (bits53.to(torch.float64) + 0.5) * (2.0**-53)


def stream_keys(seeds: list[int], positions: list[int], kind: DrawKind, device) -> torch.Tensor:
    """int64 [rows] stream keys (uint64 bit patterns) for the rows' draws."""
    keys = [_signed(stream_key_int(s, p, kind)) for s, p in zip(seeds, positions)]
    return torch.tensor(keys, dtype=torch.int64, device=device)


def gumbel_at(keys: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise -log(-log(u)) at the given (key, vocab index) pairs; argmax(logits + noise) over a
    row draws from softmax(logits). Only the candidates a row keeps need noise, so callers pass just those."""
    return -torch.log(-torch.log(uniforms_at(keys, index)))


def child_seed(seq_seed: int, i: int) -> int:
    """Seed of sample i of a request with n > 1. Child 0 keeps the parent's seed, so n=1 and the first of n
    samples agree; the others are hashed so that children of nearby parent seeds do not overlap."""
    if i == 0:
        return seq_seed & _MASK64
    return mix64_int(seq_seed ^ mix64_int(i * _GOLDEN))


def request_seed(seq_seed: int | None) -> int:
    """The seed a request samples with: its own, or a fresh random one drawn at admission when None."""
    return secrets.randbits(64) if seq_seed is None else seq_seed
