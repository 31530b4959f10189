"""DraftChooser's choice over static device tensors: DSpark drafting for sampled requests inside a CUDA graph.

A captured graph replays fixed kernels over fixed buffers, so nothing a request asks for may be read on the host
inside it. Each row's temperature, top-k, top-p, min-p, whether it samples, and its uniforms (seed, position + i,
DRAFT) go into static tensors before the replay (`fill`), and every row takes every step, with values that change
nothing where its request asked for nothing: temperature 1 and min-p 0 are exact identities, and top-k/top-p (only
in the graphs captured with `cut`, for a batch where some request asked for them) is the full stable sort, the
definition that DraftChooser's candidate cut reproduces, kept only for the rows that asked. Per row the token and
the integer weights q (which verification needs) are DraftChooser's, bit for bit.
"""

from __future__ import annotations

import torch

from deepinfer.sampling import processors as proc
from deepinfer.sampling.fixed_point import draw_tokens, fixed_point_weights
from deepinfer.sampling.queued_copy import queued
from deepinfer.sampling.row_columns import RowColumns, host_row
from deepinfer.sampling.seeds import DrawKind, uniform
from deepinfer.sampling.speculative import DraftChooser


class StaticDraftChooser:
    """Static per-row sampling parameters for up to `rows` requests and `block` draft positions, and `choose(cut)`:
    the `choose(i, logits)` callable DSpark.draft takes, reading only them. The weights buffer [rows, block, width]
    (int64: max_num_seqs x drafts x padded vocabulary x 8 bytes, ~330 MB for 64 x 5 x 129,280) is allocated by the
    first call, a capture's warm-up, never inside a capture."""

    def __init__(self, rows: int, block: int, vocab: int, device):
        self.rows, self.block, self.vocab = rows, block, vocab
        f32, f64 = dict(dtype=torch.float32, device=device), dict(dtype=torch.float64, device=device)
        self.temperature = torch.ones(rows, 1, **f32)
        self.min_p = torch.zeros(rows, 1, **f32)
        self.top_k = torch.full((rows, 1), 0, dtype=torch.int64, device=device)
        self.top_p = torch.ones(rows, 1, **f64)
        self.cuts = torch.zeros(rows, 1, dtype=torch.bool, device=device)
        self.sampled = torch.zeros(rows, dtype=torch.bool, device=device)
        self.uniforms = torch.zeros(rows, block, **f64)
        self.weights: torch.Tensor | None = None

    def fill(self, chooser: DraftChooser, size: int) -> None:
        """The parameters of chooser's requests in rows 0..B-1 and neutral rows up to `size` (the graph's bucket),
        in one host-to-device copy. top-k off is k = the vocabulary: past it the sorted row holds only the padding
        columns' -inf."""
        zeros = [0.0] * self.block
        rows = [host_row(None, self.vocab, zeros) + [0.0]] * size  # the last column: the row samples
        for r in chooser.sampled:
            q = chooser.requests[r]
            rows[r] = host_row(q.params, self.vocab, [uniform(q.seed, q.position + i, DrawKind.DRAFT)
                                                      for i in range(self.block)]) + [1.0]
        cols = RowColumns.from_host(rows, self.temperature.device)
        self.temperature[:size] = cols.temperature
        self.min_p[:size] = cols.min_p
        self.top_k[:size] = cols.top_k
        self.top_p[:size] = cols.top_p
        self.cuts[:size] = cols.cut
        self.sampled[:size] = cols.uniforms[:, -1] > 0
        self.uniforms[:size] = cols.uniforms[:, :-1]

    def choose(self, cut: bool):
        def pick(i: int, logits: torch.Tensor) -> torch.Tensor:
            n = logits.shape[0]
            x = logits.float().clone()
            x[:, self.vocab:] = float("-inf")
            tokens = x.argmax(dim=-1)  # greedy rows: ties to the lowest id, as DraftChooser
            x /= self.temperature[:n]
            if cut:
                x = torch.where(self.cuts[:n], proc.cut_top_k_top_p_sorted(x, self.top_k[:n], self.top_p[:n]), x)
            proc.apply_min_p_column_(x, self.min_p[:n])
            w = fixed_point_weights(x)
            if self.weights is None:
                self.weights = torch.zeros(self.rows, self.block, w.shape[-1], dtype=torch.int64, device=w.device)
            self.weights[:n, i].copy_(w)
            return torch.where(self.sampled[:n], draw_tokens(w, self.uniforms[:n, i]), tokens)

        return pick

    def hand_over(self, chooser: DraftChooser) -> None:
        """The sampled rows' weights into chooser.weights (as DraftChooser keeps them), copied out of the static
        buffer that the next replay overwrites: a request not verified next step still holds its own."""
        q = self.weights[queued(torch.tensor(chooser.sampled), self.weights.device)]
        for j, r in enumerate(chooser.sampled):
            chooser.weights[r] = list(q[j].unbind(0))
        for r in chooser.greedy:
            chooser.weights[r] = [None] * self.block
