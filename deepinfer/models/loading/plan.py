"""Match the stored tensors against the expected table and decide how each one is materialised.

Everything here works on headers only, so a bad checkpoint fails before a single weight is read."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .errors import CheckpointError, name_list, shape_str
from .names import scale_sibling
from .safetensors_reader import StoredTensor
from .tensors import FLOAT, FP4_ROWS, FP8_BLOCK, FP8_ROWS, Spec

FLOAT_DTYPES = ("F32", "BF16", "F16")
FP8_DTYPES = ("F8_E4M3",)
PACKED_DTYPES = ("I8", "U8")
SCALE_DTYPES = ("F8_E8M0", "U8")  # ue8m0 exponent bytes; U8 is the same bytes under an older dtype label
ROW_BLOCK = 32  # FP4 experts and Engram tables: one scale per row and 32 consecutive columns


@dataclass(frozen=True)
class LoadItem:
    name: str  # canonical name
    kind: str
    shape: tuple[int, ...]  # logical (dequantized) shape
    weight: StoredTensor
    scale: StoredTensor | None = None


def natural_key(name: str):
    """layers.2 before layers.10, so error lists read in model order."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def plan_load(
    expected: dict[str, Spec], stored: dict[str, StoredTensor], block: tuple[int, int] = (32, 32), where: str = ""
) -> list[LoadItem]:
    """`stored` maps canonical names (set-aside tensors already removed) to their headers; `where` (the model
    directory) prefixes every error message."""
    try:
        return _plan(expected, stored, block)
    except CheckpointError as exc:
        raise CheckpointError(f"{where}: {exc}" if where else str(exc)) from None


def _plan(expected, stored, block) -> list[LoadItem]:
    # A scale whose weight is expected belongs to that weight; if the weight itself is missing, the "missing"
    # report already says so and the orphan scale is not listed again as unexpected.
    scales = {n for n in stored if n.endswith(".scale") and _weight_of(n) in expected}
    missing = sorted((n for n, s in expected.items() if not s.optional and n not in stored), key=natural_key)
    unexpected = sorted((n for n in stored if n not in expected and n not in scales), key=natural_key)
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {name_list(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s): {name_list(unexpected)}")
    if problems:
        raise CheckpointError("checkpoint does not match config.json: " + "; ".join(problems))

    items = []
    for name in sorted((n for n in expected if n in stored), key=natural_key):
        weight = stored[name]
        scale = stored.get(scale_sibling(name)) if scale_sibling(name) in scales else None
        items.append(_check(name, expected[name], weight, scale, block))
    return items


def _weight_of(scale_name: str) -> str:
    return scale_name[: -len(".scale")] + ".weight"


def _kind_of(dtype: str, allowed: tuple[str, ...]) -> str | None:
    if dtype in FLOAT_DTYPES:
        return FLOAT
    if dtype in FP8_DTYPES:
        return FP8_ROWS if FP8_ROWS in allowed else FP8_BLOCK
    if dtype in PACKED_DTYPES:
        return FP4_ROWS
    return None


def _describe(kind: str, shape: tuple[int, ...], block: tuple[int, int]) -> str:
    if kind == FLOAT:
        return f"{'/'.join(FLOAT_DTYPES)} {shape_str(shape)}"
    stored, grid = _stored_shapes(kind, shape, block)
    label = "I8 (packed e2m1)" if kind == FP4_ROWS else "F8_E4M3"
    return f"{label} {shape_str(stored)} + F8_E8M0 .scale {shape_str(grid)}"


def _stored_shapes(kind: str, shape: tuple[int, ...], block: tuple[int, int]):
    """(stored weight shape, scale shape) of a quantized tensor with logical shape [out, in]."""
    out, inp = shape
    if kind == FP8_BLOCK:
        return shape, (math.ceil(out / block[0]), math.ceil(inp / block[1]))
    if kind == FP4_ROWS:
        return (out, inp // 2), (out, math.ceil(inp / ROW_BLOCK))
    return shape, (out, math.ceil(inp / ROW_BLOCK))  # FP8_ROWS


def _check(name: str, spec: Spec, w: StoredTensor, s: StoredTensor | None, block) -> LoadItem:
    where = f"tensor {name!r} ({w.file.name})"
    kind = _kind_of(w.dtype, spec.allowed)
    if kind not in spec.allowed:
        options = " or ".join(_describe(k, spec.shape, block) for k in spec.allowed)
        raise CheckpointError(f"{where} has dtype {w.dtype}, expected {options}")
    if kind == FLOAT:
        if w.shape != spec.shape:
            raise CheckpointError(f"{where} has shape {shape_str(w.shape)}, expected {shape_str(spec.shape)}")
        if s is not None:
            raise CheckpointError(
                f"{where} is stored unquantized ({w.dtype}) but has a {scale_sibling(name)!r} scale tensor"
            )
        return LoadItem(name, kind, spec.shape, w)
    if len(spec.shape) != 2 or (kind == FP4_ROWS and spec.shape[1] % 2):
        raise CheckpointError(f"{where} is quantized ({w.dtype}) but its logical shape {shape_str(spec.shape)} "
                              f"cannot be stored that way")
    want_w, want_s = _stored_shapes(kind, spec.shape, block)
    if w.shape != want_w:
        raise CheckpointError(
            f"{where} has shape {shape_str(w.shape)}, expected {shape_str(want_w)} for {w.dtype} storage "
            f"(logical {shape_str(spec.shape)})"
        )
    if s is None:
        raise CheckpointError(f"{where} is quantized ({w.dtype}) but {scale_sibling(name)!r} is missing")
    s_where = f"tensor {scale_sibling(name)!r} ({s.file.name})"
    if s.dtype not in SCALE_DTYPES:
        raise CheckpointError(f"{s_where} has dtype {s.dtype}, expected F8_E8M0")
    if s.shape != want_s:
        raise CheckpointError(
            f"{s_where} has shape {shape_str(s.shape)}, expected {shape_str(want_s)} for {name!r} "
            f"{shape_str(spec.shape)} (one scale per {_scale_unit(kind, block)})"
        )
    return LoadItem(name, kind, spec.shape, w, s)


def _scale_unit(kind: str, block: tuple[int, int]) -> str:
    return f"{block[0]}x{block[1]} block" if kind == FP8_BLOCK else f"row and {ROW_BLOCK} columns"
