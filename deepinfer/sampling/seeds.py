"""Counter-based randomness: every random number is a pure function of (seq_seed, position, draw kind, index).

Why not a torch.Generator: a shared generator hands out numbers in the order rows are visited, so a request's
tokens would depend on its batch neighbours and their order. A counter-based hash has no state, so a request
samples the same tokens alone, in any batch, in any order, on any device, and after preemption and recompute.

The hash is splitmix64 (Steele, Lea, Flood 2014) on Python ints: a draw needs one uniform per row (the sampler
inverts an exact integer CDF with it), so the few hashes per step cost nothing and never touch the device.
"""

from __future__ import annotations

import enum
import secrets

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64 increment (2**64 / golden ratio)
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_KIND_BITS = 2  # positions are spread as position * 4 + kind, so (position, kind) pairs never collide


class DrawKind(enum.IntEnum):
    """What a random stream is used for; different kinds at the same position never share numbers."""

    TOKEN = 0  # the main sampled token
    DRAFT = 1  # speculative-decoding draft / verification draws
    GRAMMAR = 2  # reserved: anything else a future stage needs


def mix64(x: int) -> int:
    """splitmix64's output mixer: a bijection of uint64 whose outputs look independent for consecutive inputs."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _M1) & _MASK64
    x = ((x ^ (x >> 27)) * _M2) & _MASK64
    return x ^ (x >> 31)


def stream_key(seed: int, position: int, kind: DrawKind) -> int:
    """The state of the random stream for one draw of one request."""
    return mix64(mix64(seed) ^ ((position << _KIND_BITS) | int(kind)))


def uniform(seed: int, position: int, kind: DrawKind, index: int = 0) -> float:
    """A float64 in [0, 1) with 53 random bits: the index-th output of splitmix64 started at stream_key."""
    bits = mix64(stream_key(seed, position, kind) + (index + 1) * _GOLDEN)
    return (bits >> 11) * 2.0**-53


def child_seed(seq_seed: int, i: int) -> int:
    """Seed of sample i of a request with n > 1. Child 0 keeps the parent's seed, so n=1 and the first of n
    samples agree; the others are hashed so that children of nearby parent seeds do not overlap."""
    if i == 0:
        return seq_seed & _MASK64
    return mix64(seq_seed ^ mix64(i * _GOLDEN))


def request_seed(seq_seed: int | None) -> int:
    """The seed a request samples with: its own, or a fresh random one drawn at admission when None."""
    return secrets.randbits(64) if seq_seed is None else seq_seed


def seed_for(seq_seed: int | None, base_seed: int | None, request_id: int) -> int:
    """The one per-request seed rule: the request's own seq_seed; without one, child_seed(base_seed, request_id)
    (runtime.seed: reproducible runs); without a base either, a fresh random seed."""
    if seq_seed is None and base_seed is not None:
        return child_seed(base_seed, request_id)
    return request_seed(seq_seed)
