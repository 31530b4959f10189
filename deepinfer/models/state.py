"""Per-sequence inference state of the V4.1 model: explicit data the engine owns, sizes and frees.

For one sequence the model keeps, per layer, a ring of the last `window - 1 + max_rollback` window-KV
vectors; per KV-source layer, the raw (kv, gate) rows of the still-open compression group (plus
`max_rollback` rows of history), the compressed-KV entries and the indexer keys; and the last
`max_ngram - 1 + max_rollback` compressed token ids for the Engram hash. `rollback(n)` undoes the last
n tokens (n <= max_rollback), which speculative decoding will need.
"""

from __future__ import annotations

import torch


class GrowBuffer:
    """Rows appended over time, stored in a tensor whose capacity grows in fixed-size blocks."""

    def __init__(self, width: int, dtype: torch.dtype, device: torch.device | str, block: int = 64):
        self.block = block
        self.data = torch.empty(0, width, dtype=dtype, device=device)
        self.length = 0

    def append(self, rows: torch.Tensor) -> None:
        need = self.length + rows.shape[0]
        if need > self.data.shape[0]:
            cap = -(-need // self.block) * self.block
            grown = torch.empty(cap, self.data.shape[1], dtype=self.data.dtype, device=self.data.device)
            grown[: self.length] = self.data[: self.length]
            self.data = grown
        self.data[self.length : need] = rows
        self.length = need

    def view(self) -> torch.Tensor:
        return self.data[: self.length]

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class Tail:
    """The last `keep` rows of a stream (a sliding-window ring); `keep` may be 0."""

    def __init__(self, keep: int, width: int, dtype: torch.dtype, device):
        self.keep = keep
        self.rows = torch.empty(0, width, dtype=dtype, device=device)

    def extend(self, new: torch.Tensor) -> None:
        self.rows = torch.cat([self.rows, new])[-self.keep :] if self.keep else self.rows[:0]

    def drop_last(self, n: int) -> None:
        self.rows = self.rows[: max(self.rows.shape[0] - n, 0)]

    @property
    def nbytes(self) -> int:
        return self.keep * self.rows.shape[1] * self.rows.element_size()


class SourceState:
    """Compressor + indexer state of one KV-source layer for one sequence."""

    def __init__(self, ratio: int, head_dim: int, index_dim: int, max_rollback: int, dtype, device):
        self.ratio = ratio
        # raw fp32 (kv, gate) rows: the open group (< ratio rows) plus rollback history
        self.raw_kv = Tail(ratio - 1 + max_rollback, head_dim, torch.float32, device)
        self.raw_gate = Tail(ratio - 1 + max_rollback, head_dim, torch.float32, device)
        self.compressed = GrowBuffer(head_dim, dtype, device)
        self.index_keys = GrowBuffer(index_dim, dtype, device)

    @property
    def entries(self) -> int:
        return self.compressed.length


class SequenceState:
    """Everything the model remembers about one sequence between forward calls."""

    def __init__(self, cfg, dtype: torch.dtype, device, max_rollback: int = 0):
        self.num_tokens = 0
        self.max_rollback = max_rollback
        keep = cfg.sliding_window - 1 + max_rollback
        self.window = [Tail(keep, cfg.head_dim, dtype, device) for _ in range(cfg.num_hidden_layers)]
        self.sources = {
            layer: SourceState(
                cfg.compress_ratios[layer], cfg.head_dim, cfg.index_head_dim, max_rollback, dtype, device
            )
            for layer in cfg.kv_source_layer_ids
        }
        n_hist = max(cfg.engram_max_ngram_size - 1, 0) + max_rollback if cfg.engram_layer_ids else 0
        self.ngram_history: list[int] = []
        self._ngram_keep = n_hist

    def push_ngram(self, compressed_ids: list[int]) -> None:
        if self._ngram_keep:
            self.ngram_history = (self.ngram_history + compressed_ids)[-self._ngram_keep :]

    def rollback(self, n: int) -> None:
        """Forget the last n tokens (n <= max_rollback), restoring the state before them."""
        if n > self.max_rollback or n > self.num_tokens:
            raise ValueError(f"rollback({n}) exceeds max_rollback={self.max_rollback} or num_tokens={self.num_tokens}")
        if n == 0:
            return
        new_len = self.num_tokens - n
        for tail in self.window:
            tail.drop_last(n)
        for src in self.sources.values():
            src.raw_kv.drop_last(n)
            src.raw_gate.drop_last(n)
            src.compressed.truncate(new_len // src.ratio)
            src.index_keys.truncate(new_len // src.ratio)
        self.ngram_history = self.ngram_history[: max(len(self.ngram_history) - n, 0)]
        self.num_tokens = new_len

    def nbytes(self) -> int:
        total = sum(t.nbytes for t in self.window)
        for src in self.sources.values():
            total += src.raw_kv.nbytes + src.raw_gate.nbytes + src.compressed.nbytes + src.index_keys.nbytes
        return total + 8 * self._ngram_keep

    def free(self) -> None:
        """Drop every tensor (the engine calls this on finish or preemption)."""
        self.window.clear()
        self.sources.clear()
        self.ngram_history = []
        self._ngram_keep = 0
