"""Engram tables in host memory (`model.engram_storage: host`): the n-gram embedding tables (~203 GB at V4.1-Flash
size as stored, more than a dep4 rank's GPU holds) stay in host RAM, pinned on CUDA, and each step reads only the
rows its tokens pick (per token and Engram layer: n_hash_cols = 24 rows of engram_head_dim).

How a step reads them: on CUDA the pinned tables are mapped into the GPU's address space (unified virtual
addressing: a CUDA tensor aliasing the host memory, `_mapped`), so the row gather is an ordinary device kernel
(`table[ids]`) whose loads cross PCIe. Nothing comes back to the host and nothing waits for it: the hash stays on
the device, the step has no host sync, and a decode step with host tables is captured as a CUDA graph like one
with device tables (the gather is a node of it). The traffic is the picked rows only: 24 x 264 B per token and
Engram layer in FP8 (codes + one ue8m0 scale per 32 channels), ~0.8 MB for a 64-token decode step of
V4.1-Flash's two Engram layers, read where the layer needs them (not copied ahead on a side stream: the read is a
few microseconds of PCIe, and a graph replay could not wait on a copy issued from the host anyway).

Format: a table whose values an FP8 row format holds exactly (the released tables are FP8 e4m3 with ue8m0 scales per
row and 32 channels) is kept as FP8 codes + scales (half the bytes of the bf16 the device tables are loaded as) and
dequantised on the device after the gather with the loader's formula (codes x 2^(scale - 127) in fp32, then the
model's dtype): the rows are the device tables' values bit for bit. Any other table stays as it was.

Each rank pins its own copy (a node running 4 ranks holds 4 copies: ~812 GB at V4.1-Flash size in FP8); sharing one
pinned copy between the ranks of a node is not built. `DEEPINFER_ENGRAM_FORCE_GPU_STORAGE` (DeepInfer's switch the
other way) is read by the config (conf/model/*.yaml `engram_storage`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.kernels.torch.quant import FP8_MAX, ceil_pow2, e8m0_to_float

ROW_BLOCK = 32  # channels per ue8m0 scale (the released tables' format)
CHUNK_ROWS = 1 << 18  # rows quantised / copied at a time: bounds the transient memory of a 384M-row table


@dataclass
class HostTable:
    """One Engram layer's table in host memory: FP8 codes [rows, D] (uint8) with ue8m0 scales [rows, D / 32], or
    the values themselves [rows, D] (`scales` None)."""

    codes: torch.Tensor
    scales: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales) if t is not None)


def to_host_table(table: torch.Tensor, pin: bool) -> HostTable:
    """A device (or host) table moved to host memory, in FP8 rows when that holds its values exactly (chunk by
    chunk, verified), else as it is. `pin`: page-locked (CUDA: what the device reads through its mapping)."""
    rows, dim = table.shape
    fp8 = dim % ROW_BLOCK == 0
    codes = torch.empty(rows, dim, dtype=torch.uint8 if fp8 else table.dtype, pin_memory=pin)
    scales = torch.empty(rows, dim // ROW_BLOCK, dtype=torch.uint8, pin_memory=pin) if fp8 else None
    for start in range(0, rows, CHUNK_ROWS):
        part = table[start: start + CHUNK_ROWS]
        q = fp8_rows_exact(part) if fp8 else None
        if q is None and fp8:  # not FP8-representable: keep the values (restart with the dense layout)
            return _dense(table, pin)
        if q is None:
            codes[start: start + part.shape[0]].copy_(part)
            continue
        codes[start: start + part.shape[0]].copy_(q[0])
        scales[start: start + part.shape[0]].copy_(q[1])
    return HostTable(codes, scales)


def _dense(table: torch.Tensor, pin: bool) -> HostTable:
    out = torch.empty(table.shape, dtype=table.dtype, pin_memory=pin)
    for start in range(0, table.shape[0], CHUNK_ROWS):
        out[start: start + CHUNK_ROWS].copy_(table[start: start + CHUNK_ROWS])
    return HostTable(out)


def fp8_rows_exact(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(e4m3 codes as uint8 [n, D], ue8m0 scales [n, D / 32]) whose dequantisation gives back `w` exactly (in w's
    dtype), or None when some value is not so representable."""
    n, dim = w.shape
    blocks = w.float().view(n, dim // ROW_BLOCK, ROW_BLOCK)
    s = ceil_pow2(blocks.abs().amax(-1).clamp_min(1e-30) / FP8_MAX)
    codes = (blocks / s[..., None]).to(torch.float8_e4m3fn)
    if not torch.equal((codes.float() * s[..., None]).view(n, dim).to(w.dtype), w):
        return None
    return codes.view(torch.uint8).view(n, dim), (torch.log2(s).round() + 127).to(torch.uint8)


def _mapped(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor on `device` aliasing the pinned host tensor `t` (its unified virtual address; the
    `__cuda_array_interface__` protocol, which torch.as_tensor takes without copying memory the driver has
    registered). Refused (one line) when torch copies it instead, or when a row read through it differs."""

    class Mapped:
        __cuda_array_interface__ = {"shape": tuple(t.view(torch.uint8).shape), "typestr": "|u1",
                                    "data": (t.data_ptr(), False), "version": 2, "strides": None}
        keep = t  # the host memory lives as long as the view

    view = torch.as_tensor(Mapped(), device=device)
    probe = torch.tensor([0, t.shape[0] // 2, t.shape[0] - 1])
    same_device = view.device.type == "cuda" and device.index in (None, view.device.index)
    if (view.data_ptr() != t.data_ptr() or not same_device
            or not torch.equal(view[probe.to(view.device)].cpu(), t.view(torch.uint8)[probe])):
        raise RuntimeError(f"model.engram_storage=host: the pinned Engram table could not be mapped into {device}'s "
                           "address space (unified virtual addressing); allowed: model.engram_storage=device")
    return view.view(t.dtype)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """t's rows as the widest integer words that tile them (one gather reads 8-byte words, not single bytes)."""
    row = t.shape[-1] * t.element_size()
    for dtype in (torch.int64, torch.int32, torch.int16):
        if row % dtype.itemsize == 0:
            return t.view(torch.uint8).view(dtype)
    return t.view(torch.uint8)


class HostEngram:
    def __init__(self, tables: list[HostTable], device):
        self.device = torch.device(device)
        self.tables = tables
        cuda = self.device.type == "cuda"
        # what the gathers index: the mapped device views on CUDA, the host tensors themselves elsewhere
        self._codes = [_wide(_mapped(t.codes, self.device) if cuda else t.codes) for t in tables]
        self._scales = [None if t.scales is None else _wide(_mapped(t.scales, self.device) if cuda else t.scales)
                        for t in tables]

    @property
    def host_bytes(self) -> int:
        return sum(t.nbytes for t in self.tables)

    def rows(self, j: int, ids: torch.Tensor) -> torch.Tensor:
        """Engram layer j's rows for bucket ids `ids` [..., cols] (on the device): [..., cols, D], the device
        table's values (fp32 from FP8 rows, which the model casts to its dtype as it does the device rows)."""
        table = self.tables[j]
        codes = self._codes[j][ids].view(torch.uint8).view(table.codes.dtype)
        if table.scales is None:
            return codes
        scales = self._scales[j][ids].view(torch.uint8)
        s = e8m0_to_float(scales).repeat_interleave(ROW_BLOCK, -1)
        return codes.view(torch.float8_e4m3fn).float() * s
