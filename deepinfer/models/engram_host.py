"""Engram tables in host memory (`model.engram_storage: host`): the n-gram embedding tables (~203 GB at V4.1-Flash
size, more than a dep4 rank's GPU holds) stay in host RAM, pinned on CUDA, and each step copies to the device
only the rows its tokens pick (per token and Engram layer: n_hash_cols rows of engram_head_dim).

Per step (`HostEngram.fetch`, called once by the model's `run` after the n-gram hash): the step's bucket ids
come to the host (one device-to-host copy, T x layers x cols int64: a device sync on CUDA), every Engram layer's
rows are gathered from its host table into a pinned staging buffer, and copied to the device on a side stream,
one event per layer; the layer waits on its event only (`rows(j)`), so the copies of later layers' rows overlap the
layers before them. The staging and device buffers are allocated once, for `max_tokens` tokens a step; a larger
step is an error naming the bound. The rows are the table's values, so the model's output is bitwise that of
device tables.

Not built: the hash on the host (it would remove the step's one device sync, and with it what stops a CUDA graph
from capturing the step); DeepInfer's DEEPINFER_ENGRAM_FORCE_GPU_STORAGE (the setting is `model.engram_storage`).
"""

from __future__ import annotations

import torch


class HostEngram:
    def __init__(self, tables: list[torch.Tensor], cols: int, max_tokens: int, device):
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        # the tables leave the device: pinned host copies (plain host memory off CUDA)
        self.tables = [t.detach().to("cpu").pin_memory() if cuda else t.detach().to("cpu") for t in tables]
        self.cols, self.max_tokens = cols, max_tokens
        width, dtype = self.tables[0].shape[-1], self.tables[0].dtype
        n = max_tokens * cols
        self.stage = [torch.empty(n, width, dtype=dtype, pin_memory=cuda) for _ in tables]
        self.on_device = [torch.empty(n, width, dtype=dtype, device=self.device) for _ in tables]
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.events = [torch.cuda.Event() for _ in tables] if cuda else None
        self._tokens = 0

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tables)

    def fetch(self, hash_ids: torch.Tensor) -> None:
        """hash_ids [T, layers, cols]: gather every layer's rows on the host and start their copies."""
        T = hash_ids.shape[0]
        if T > self.max_tokens:
            raise ValueError(f"a step of {T} tokens; the host Engram buffers hold {self.max_tokens} "
                             "(engine.max_num_batched_tokens)")
        ids = hash_ids.to("cpu")
        n = T * self.cols
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the buffers' previous readers
        for j, table in enumerate(self.tables):
            torch.index_select(table, 0, ids[:, j].reshape(-1), out=self.stage[j][:n])
            if self.stream is None:
                self.on_device[j][:n].copy_(self.stage[j][:n])
                continue
            with torch.cuda.stream(self.stream):
                self.on_device[j][:n].copy_(self.stage[j][:n], non_blocking=True)
                self.events[j].record(self.stream)
        self._tokens = T

    def rows(self, j: int) -> torch.Tensor:
        """Engram layer j's rows of this step, [T, cols, width] on the device."""
        if self.events is not None:
            torch.cuda.current_stream(self.device).wait_event(self.events[j])
        return self.on_device[j][: self._tokens * self.cols].view(self._tokens, self.cols, -1)
