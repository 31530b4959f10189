"""Balanced (mirror) context parallelism for prefill (issue 13 item 5), after DeepInfer's CP-mirror layout
(model_executor/layers/tilelang_ops/prepare_cp_mirror.py, models/v4_modules/attn.py).

Split: each sequence's chunk of a prefill step is cut into 2·cp blocks; rank r computes the tokens of block r and of
its mirror 2cp−1−r. Causal attention costs grow with position, so an early block paired with a late one gives every
rank about the same work. Block size is ceil(n / 2cp) like DeepInfer's, but every interior cut is rounded up to a
multiple of the compression ratios' lcm *in absolute positions*, so no compression group straddles two blocks (a
chunk that starts mid-group keeps that group whole in block 0); the last blocks of a short chunk may be shorter or
empty. A rank that owns no token of the step still computes one row (row 0 of the step, a copy of another rank's
work whose result is never used) so every per-row op and collective has something to run on.

What each rank computes: every per-token op (embedding, mHC, Q, window-KV and compressor projections, indexer
queries, attention of its own queries, MoE) on its own rows only. What is gathered, per layer: this layer's window
KV as cached (FP8 codes + scales) and, on a KV-source layer, the compressor input (ratio 2: the fp32 kv/gate
projections; ratio 1: the normed latent), as DeepInfer gathers `kv_swa` and `projected_kv`. Every rank then writes
the whole chunk into its own pools exactly as a single process would (window ring rows, open compression groups,
compressed entries and indexer keys, computed from the gathered rows by the same row-invariant ops; the Engram
history and the draft layers' context are written from the full step too), and its own queries read the whole
causal context from those pools and the gathered rows. So after the step every rank holds the sequence's complete
caches and any rank can decode it; on the CPU the logits are bitwise the single-process ones (the ops are
row-invariant there: kernels/torch/linear.py row tiles, per-query key slates).

Collective: `all_gather_single` (`all_gather_into_tensor` before torch 2.13), one per layer. Why: every rank needs
every other rank's rows (its queries read keys from the whole causal context, and its caches must hold the whole
sequence), so it is an all-to-all-of-everything, which is exactly an all-gather; the contributions are made equal in
size by padding to the largest rank's row count, so the single-tensor variant applies (one NCCL ring all-gather /
gloo allgather into one preallocated buffer, no per-rank list), and the step's several tensors (codes, scales,
projections, of different dtypes) travel as one byte buffer so each layer costs one collective, not four. The
reorder back to step order is one index_select on the receiving side.

Engine contract: every rank of the group calls `model.forward(batch, cp=ContextParallel(group))` with the same
token ids and the same tokens held per sequence (slots and blocks may differ: each rank addresses its own pools).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import groups

# torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single; same semantics
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def split_cuts(n: int, past: int, size: int, align: int = 1) -> list[int]:
    """2·size+1 cut points (chunk-relative, 0..n) of a chunk of n tokens starting at position `past`: block b is
    [cuts[b], cuts[b+1]). Interior cuts sit at past + k·ceil(n / 2size), rounded up to a multiple of `align` in
    absolute positions (compression groups never straddle blocks) and clamped into the chunk."""
    ps = -(-n // (2 * size))
    cuts = [0]
    for k in range(1, 2 * size):
        cut = -(-(past + k * ps) // align) * align - past
        cuts.append(min(max(cut, 0), n))
    return cuts + [n]


@dataclass(frozen=True)
class SplitPlan:
    """Which rows of a step each rank computes. Rows are the step's packed rows (sequence i's new tokens at
    starts[i] ..), the order of the single-process step."""

    size: int
    lengths: tuple[int, ...]
    pasts: tuple[int, ...]
    cuts: tuple[tuple[int, ...], ...]  # per sequence, split_cuts(...)
    rows: tuple[tuple[int, ...], ...]  # per rank: the step rows it owns, ascending (seq by seq: block r, its mirror)

    @property
    def total(self) -> int:
        return sum(self.lengths)

    def counts(self) -> list[int]:
        """Tokens each rank computes (its balance)."""
        return [len(r) for r in self.rows]

    def computed(self, rank: int) -> tuple[int, ...]:
        """The rows `rank` runs: its own, or row 0 as a stand-in when it owns none (see the module docstring)."""
        return self.rows[rank] or (0,)

    def padded(self) -> int:
        """Rows of each rank's contribution to a gather (the largest rank's, at least 1)."""
        return max(len(self.computed(r)) for r in range(self.size))

    def owners(self) -> torch.Tensor:
        """[T] int64: the rank owning each step row."""
        out = torch.empty(self.total, dtype=torch.int64)
        for r, rows in enumerate(self.rows):
            out[torch.tensor(rows, dtype=torch.int64)] = r
        return out

    def gather_index(self) -> torch.Tensor:
        """[T] int64: each step row's row in the gathered buffer [size · padded(), ...] (owner · padded + local)."""
        pad, out = self.padded(), torch.empty(self.total, dtype=torch.int64)
        for r, rows in enumerate(self.rows):
            out[torch.tensor(rows, dtype=torch.int64)] = r * pad + torch.arange(len(rows))
        return out


class ContextParallel:
    """This process's place in a context-parallel group (None: the default world group, which must exist)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.size = groups.world_size(group)
        self.rank = groups.rank(group)

    def plan(self, lengths: list[int], pasts: list[int] | None = None, align: int = 1) -> SplitPlan:
        """The split of a step whose sequence i appends lengths[i] tokens to pasts[i] held ones (`align`: the lcm
        of the model's compression ratios, align_of(cfg.compress_ratios)). Deterministic: every rank computes the same
        plan from the same host ints."""
        pasts = list(pasts) if pasts is not None else [0] * len(lengths)
        if len(pasts) != len(lengths) or any(n < 1 for n in lengths) or align < 1:
            raise ValueError(f"plan: lengths {lengths} (each >= 1) and pasts {pasts} must pair up; align={align} >= 1")
        rows: list[list[int]] = [[] for _ in range(self.size)]
        cuts_all, start = [], 0
        for n, past in zip(lengths, pasts):
            cuts = split_cuts(n, past, self.size, align)
            cuts_all.append(tuple(cuts))
            for r in range(self.size):
                for b in (r, 2 * self.size - 1 - r):
                    rows[r].extend(range(start + cuts[b], start + cuts[b + 1]))
            start += n
        return SplitPlan(self.size, tuple(lengths), tuple(pasts), tuple(cuts_all), tuple(tuple(r) for r in rows))

    def step(self, plan: SplitPlan, full_meta, device) -> CPStep:
        return CPStep(self, plan, full_meta, device)


def align_of(compress_ratios) -> int:
    """lcm of a model's compression ratios (> 0): the granularity CP blocks keep whole."""
    return math.lcm(1, *(r for r in compress_ratios if r > 0))


class CPStep:
    """One context-parallel prefill step on this rank: the row indices on the device, the full step's metadata
    (`full`: what the cache writes read) and the gathers. The model's local StepMeta carries it as `meta.cp`."""

    def __init__(self, cp: ContextParallel, plan: SplitPlan, full_meta, device):
        self.cp, self.plan, self.full = cp, plan, full_meta
        self.pad = plan.padded()
        self.own = torch.tensor(plan.computed(cp.rank), dtype=torch.int64).to(device)
        self.index = plan.gather_index().to(device)
        self.owner = plan.owners().to(device)  # [T] rank owning each step row
        self.local = self.index - self.owner * self.pad  # [T] its row among the owner's computed rows

    def _all_gather(self, recv: torch.Tensor, send: torch.Tensor) -> None:
        if self.cp.size == 1:  # a group of one (or none): the step runs unsplit through the same code
            recv.copy_(send)
        else:
            _all_gather_single(recv, send, group=self.cp.group)

    def gather(self, *xs: torch.Tensor | None) -> list[torch.Tensor | None]:
        """Each x: [rows this rank computes, ...]; returns [step rows, ...] in step order, bitwise as computed on
        their owners (None passes through). All of them travel in one collective as bytes."""
        parts = [x for x in xs if x is not None]
        if not parts:
            return list(xs)
        n = parts[0].shape[0]
        flat = [x.contiguous().view(n, -1).view(torch.uint8) for x in parts]
        widths = [f.shape[1] for f in flat]
        send = torch.zeros(self.pad, sum(widths), dtype=torch.uint8, device=parts[0].device)
        send[:n] = torch.cat(flat, 1)
        recv = torch.empty(self.cp.size * self.pad, send.shape[1], dtype=torch.uint8, device=send.device)
        self._all_gather(recv, send)
        full = recv.index_select(0, self.index)
        out, it = [], iter(torch.split(full, widths, 1))
        for x in xs:
            if x is None:
                out.append(None)
                continue
            b = next(it).contiguous().view(x.dtype)
            out.append(b.view(full.shape[0], *x.shape[1:]))
        return out

    def local_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """For step rows `rows` [K]: their index among this rank's computed rows where it owns them (0 elsewhere:
        a stand-in whose value `pick` discards)."""
        return torch.where(self.owner[rows] == self.cp.rank, self.local[rows], 0)

    def pick(self, y: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """y [K, ...]: this rank's values for step rows `rows` (computed at local_rows(rows)); returns every row's
        value from its owner, the same on every rank. One all-gather of K rows per rank."""
        K = y.shape[0]
        send = y.contiguous().view(K, -1).view(torch.uint8)
        recv = torch.empty(self.cp.size * K, send.shape[1], dtype=torch.uint8, device=y.device)
        self._all_gather(recv, send)
        mine = recv[self.owner[rows] * K + torch.arange(K, device=rows.device)]
        return mine.view(y.dtype).view(K, *y.shape[1:])
