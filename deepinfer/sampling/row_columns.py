"""A batch's per-row sampling parameters as device columns, sent in one queued copy (queued_copy), and the
transforms of steps 5-8 (temperature, top-k/top-p, min-p) that read only them.

Why: on an accelerator every host read of a device value, and every copy from pageable host memory, waits for the
device's queue to drain. The sample stage runs right after the step's graph replay, so each such wait costs a
round trip with the device idle; the list-driven transforms made about ten of them per sampled step. Here the
parameters travel once and the only read left is the step's answer.

On the CPU the top-k/top-p cut takes the candidate path (`processors.apply_top_k_top_p_`, a host read that costs
nothing there, and far cheaper than sorting a 129k row); elsewhere the full stable sort, its definition, which
reads nothing on the host. Both give the same bits (tests/test_sampling_pipeline.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.sampling import processors as proc
from deepinfer.sampling.fixed_point import fixed_point_weights
from deepinfer.sampling.queued_copy import queued


def wants_cut(params) -> bool:
    return params.top_k > 0 or params.top_p < 1.0


def host_row(params, vocab: int, uniforms: list[float]) -> list[float]:
    """One row of `RowColumns.from_host`: temperature, min-p, top-k (the vocabulary when off), top-p, cut flag,
    then the row's uniforms. None: a row that samples nothing (temperature 1 and min-p 0 are exact identities)."""
    if params is None:
        return [1.0, 0.0, float(vocab), 1.0, 0.0] + uniforms
    return [params.temperature, params.min_p, float(params.top_k if params.top_k > 0 else vocab), params.top_p,
            float(wants_cut(params))] + uniforms


@dataclass
class RowColumns:
    """temperature, min_p float32 [n, 1] (as the logits, so dividing is what a float32 list column gave); top_k
    int64 [n, 1]; top_p float64 [n, 1]; cut bool [n, 1]; uniforms float64 [n, m]."""

    temperature: torch.Tensor
    min_p: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    cut: torch.Tensor
    uniforms: torch.Tensor

    @classmethod
    def from_host(cls, rows: list[list[float]], device) -> "RowColumns":
        """rows: `host_row`s, float64 on the host (exact for every parameter: top-k below 2**53), in one copy."""
        dev = queued(torch.tensor(rows, dtype=torch.float64), device)
        return cls(dev[:, 0:1].float(), dev[:, 1:2].float(), dev[:, 2:3].long(), dev[:, 3:4], dev[:, 4:5] > 0,
                   dev[:, 5:])


def transform_(x: torch.Tensor, params: list, cols: RowColumns) -> torch.Tensor:
    """Steps 5-8 on float32 logits x [n, V] in place, row r by params[r] (None: untouched). Returns x."""
    x /= cols.temperature
    cut = [p is not None and wants_cut(p) for p in params]
    if any(cut):
        if x.device.type == "cpu":
            rows = [r for r, c in enumerate(cut) if c]
            sub = x[rows]
            proc.apply_top_k_top_p_(sub, [params[r].top_k for r in rows], [params[r].top_p for r in rows])
            x[rows] = sub
        else:
            x.copy_(torch.where(cols.cut, proc.cut_top_k_top_p_sorted(x, cols.top_k, cols.top_p), x))
    if any(p is not None and p.min_p > 0.0 for p in params):
        proc.apply_min_p_column_(x, cols.min_p)
    return x


def processed_weights(x: torch.Tensor, params: list, vocab: int, uniforms: list[list[float]] | None = None):
    """The integer weights a sampled row draws from (steps 5-8, in place on x), and the RowColumns (their
    uniforms, if given, ride along in the same copy)."""
    uniforms = uniforms or [[] for _ in params]
    cols = RowColumns.from_host([host_row(p, vocab, u) for p, u in zip(params, uniforms)], x.device)
    return fixed_point_weights(transform_(x, params, cols)), cols
