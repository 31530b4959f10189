#!/usr/bin/env python3
"""Census of the GPU launches of ONE captured decode step, counted on the CPU: which launches are TileLang
kernels and which are "glue" (torch copies, casts, index ops, fills, small elementwise ops), and the source lines
that make them.

    python3 benchmarks/decode_launch_census.py [--model flash_reduced|flash40] [--batches 1 8] [--context 4096]
        [--drafting greedy sampled cut]
        [--top 40] [--out benchmarks/results/decode_launch_census.json]

No GPU is needed (~15 s a run). The synthetic V4.1-Flash-width model (deepinfer.models.synthetic: FLASH_REDUCED,
one layer of each of the six kinds, or FLASH_FULL's 40; random weights in the released formats; backends
["tilelang-sm90", "torch"] as on the GPU) is built on *fake* CUDA tensors (torch FakeTensorMode: shapes, dtypes
and strides, no memory, no arithmetic). A decode step of B rows then runs through the code a CUDA graph captures
(engine/cuda_graphs.py DecodeGraphs: `derive` of the graph's static inputs, then `model.run`, inside
registry.no_host_reads() with the stream reported as capturing), twice: once uncounted, as the warm-up before a
capture (what launchers cache, e.g. moe.py's _shared_table, is made there), then counted. Every TileLang launch
goes through kernels/tilelang/_build.jit; `_build._compiled` is replaced by a recorder, so nothing is compiled and
each call of the returned kernel counts one launch of its builder (the outputs stay the torch.empty tensors the
launchers allocated), by the leading dim of its first argument too (`tilelang_rows_by_builder`: x's tokens for the
mixes and the MoE's up pass, e.g. DSpark's drafting at five tokens a call). Every aten op that reaches the fake
tensors is classified:

    tilelang   a TileLang kernel launch (by builder name)
    glue       an aten op that launches a CUDA kernel: cast, strided copy, index, fill, elementwise, scan...
    gemm       a cuBLAS matmul (dense bf16 weights: indexer / compressor projections, the lm head)
    memcpy     a same-dtype copy between contiguous tensors (cudaMemcpyAsync D2D, no kernel)
    h2d        a host-to-device copy (a memcpy, not a kernel)
    (views, metadata and allocations launch nothing and are not counted, nor is an op with an empty result)

each with the innermost frame of this checkout that issued it (file:line, function), the innermost frame outside
that file (the caller), the innermost frame in deepinfer/ (the model line behind a launcher's glue), the
'dtype[shape] -> dtype[shape]' it moved, and the region it ran in: `derive` (the step metadata, inside the
captured graph), `pre` (embedding, Engram hash, window positions), `layer i` (model.layer_hook) and `head` (final
collapse, norm, lm head). `stage` is the host-side staging DecodeGraphs.run does before each replay (the step's
ids / positions / slots / block table copied into the static buffers), outside the graph and reported apart.

--drafting MODE... also counts one DSpark drafting step per batch (DraftGraphs' graph body: the three draft layers
over the block, the heads, each position's choice) in each mode: greedy, sampled (temperature 0.8) and cut (also
top-p 0.9; deepinfer.sampling.static_drafts). The model then carries V4.1-Flash's draft layers. The body runs under
registry.no_host_reads, as the decode step's does: a host read in it raises, so a run that completes says the mode
can be captured as far as reads go (torch's own kernels' capturability is the GPU test's to show).

Checked against the H200 profile of the 40-layer B=1 step (benchmarks/results/decode_flash40_s13_rcp_h200.json.xz):
`--model flash40` gives the profile's TileLang counts builder by builder, its 219 direct_copy / bfloat16_copy
casts, 96 one-byte index_copy and 42 + 16 fill kernels; the ~40 kernels the census does not list are cuBLAS's
second kernels (split-K reduce), the sampler's and the staging's copies.

Limits: one launch per aten op (a few launch more: sort, topk, cuBLAS split-K; constant_pad_nd is counted as its
fill plus its copy). The sampler and the logits' read-back after the step are not counted. Values are never
computed, so a path that depends on tensor values cannot be followed: a host read raises (a captured decode step
has none), except the once-per-weight scale-range checks a warm-up leaves cached (tilelang linear.py / moe.py
_scales_in_range), answered True before the run (random_weights draws in-range scales). Patched while the census
runs: torch.cuda's device, stream and capture queries (an H200: sm_90, 132 SMs); `.to` / `.cuda` / `pin_memory`
and tensor indexing (__getitem__ / __setitem__, emulated with the aten ops the C++ indexing uses), which a
CPU-only torch refuses for a CUDA tensor before dispatch, as are a few other bindings (called as their aten op);
torch.Generator("cuda") while the weights are drawn (the draws drop it); FakeTensor.data_ptr (the storage offset
in bytes: launchers test 16-byte alignment); the driver's tensor-map encoding (zeros). Imports pin deepinfer.kernels
to this checkout (kernels/), whatever an editable install points it at.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import linecache
import os
import sys
import time
import traceback
import types
import warnings
from collections import Counter, defaultdict
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
THIS = str(Path(__file__).resolve())
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402


def _pin_checkout() -> None:
    """Import deepinfer.kernels (top-level kernels/) from this checkout, whatever an editable install maps it to:
    `deepinfer` comes from ROOT (sys.path), and ROOT on its __path__ makes kernels/ its `kernels` subpackage."""
    import deepinfer

    if "deepinfer.kernels" in sys.modules:
        return
    if str(ROOT) not in list(deepinfer.__path__):
        deepinfer.__path__.append(str(ROOT))


_pin_checkout()

H200 = types.SimpleNamespace(name="NVIDIA H200 (fake)", major=9, minor=0, multi_processor_count=132,
                             total_memory=141 * 2**30, L2_cache_size=60 * 2**20, warp_size=32)

# aten ops that launch nothing on the device: allocation and metadata (views are recognised by OpOverload.is_view)
NO_LAUNCH = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "_unsafe_view", "detach",
             "alias", "lift_fresh", "lift_fresh_copy", "resize_", "set_", "record_stream", "_reshape_alias",
             "view", "as_strided", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
             "_has_compatible_shallow_copy_type", "is_pinned", "_pin_memory"}
FILL = {"zeros", "ones", "full", "fill_", "zero_", "zeros_like", "ones_like", "full_like", "new_zeros", "new_ones",
        "new_full", "scalar_tensor"}
INDEX = {"index", "index_select", "gather", "index_copy_", "index_copy", "index_put_", "index_put", "scatter",
         "scatter_", "scatter_add_", "scatter_add", "take", "embedding", "_index_put_impl_", "index_add_",
         "index_fill_", "masked_fill_", "masked_fill"}
GEMM = {"mm", "addmm", "bmm", "baddbmm", "matmul", "_scaled_mm", "addmv", "mv", "dot", "linear"}
HOST_READ = {"_local_scalar_dense", "item", "nonzero", "unique", "_unique2", "masked_select"}


def _cuda(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cuda"


def _tensors(x):
    return (t for t in tree_leaves(x) if isinstance(t, torch.Tensor))


def _memcpy_like(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """copy_'s memcpy test on CUDA: same dtype, both non-overlapping and dense with the same strides."""
    return (dst.dtype == src.dtype and dst.shape == src.shape and dst.stride() == src.stride()
            and dst.is_contiguous() and src.is_contiguous())


def _frames(stack) -> tuple[str, str, str]:
    """(site, caller, origin) as 'path:line function': the innermost frame of this checkout (not this script), the
    innermost one outside the site's file, and the innermost one in deepinfer/ (the model code that asked for it;
    the site itself when it is there)."""
    mine = [f for f in stack if f.filename.startswith(str(ROOT) + os.sep) and f.filename != THIS]
    if not mine:
        return "?", "?", "?"
    site = mine[-1]
    caller = next((f for f in reversed(mine) if f.filename != site.filename), None)
    origin = next((f for f in reversed(mine) if f.filename.startswith(str(ROOT / "deepinfer") + os.sep)), None)

    def name(f):
        return f"{os.path.relpath(f.filename, ROOT)}:{f.lineno} {f.name}" if f is not None else "-"

    return name(site), name(caller), name(origin)


class Census:
    """What one phase launched: per (phase, region) counters of TileLang builders and aten ops, and per source
    site the glue launches."""

    def __init__(self):
        self.region = "build"  # derive | pre | layer N | head | stage
        self.on = False
        self.tilelang = defaultdict(Counter)          # region -> builder -> launches
        self.aten = defaultdict(Counter)              # region -> (kind, op) -> launches
        self.sites = Counter()                        # (region, kind, op, site, caller) -> launches
        self.tl_sites = Counter()                     # (region, builder, site, caller) -> launches
        self.tl_rows = defaultdict(Counter)           # (region, builder) -> leading dim of its first argument -> n
        self.code = {}                                # site -> source line
        self.details = {}                             # sites key -> Counter of 'dtype[shape] -> dtype[shape]'
        self.origins = {}                             # sites key -> Counter of the model line behind it
        self.origin = "?"

    def _site(self):
        site, caller, origin = _frames(traceback.extract_stack()[:-3])
        self.origin = origin
        if site not in self.code and site != "?":
            path, rest = site.split(":", 1)
            self.code[site] = linecache.getline(str(ROOT / path), int(rest.split()[0])).strip()
        return site, caller

    def launch(self, builder: str, rows: int | None = None) -> None:
        if not self.on:
            return
        self.tilelang[self.region][builder] += 1
        if rows is not None:
            self.tl_rows[(self.region, builder)][rows] += 1
        site, caller = self._site()
        self.tl_sites[(self.region, builder, site, caller)] += 1

    def op(self, kind: str, name: str, detail: str = "") -> None:
        if not self.on:
            return
        self.aten[self.region][(kind, name)] += 1
        site, caller = self._site()
        key = (self.region, kind, name, site, caller)
        self.sites[key] += 1
        self.origins.setdefault(key, Counter())[self.origin] += 1
        self.details.setdefault(key, Counter())[detail] += 1


class CountOps(TorchDispatchMode):
    """Classifies every aten op that reaches the fake tensors (entered inside the FakeTensorMode)."""

    def __init__(self, census: Census):
        super().__init__()
        self.census = census

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "aten":
            return func(*args, **kwargs)  # prim::device and the like: metadata
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            # seen above the fake mode before its decomposition (linear, reshape, contiguous, pad, ...): count the
            # ops it decomposes into (reshape / contiguous copy only when they must)
            with self:
                return func.decompose(*args, **kwargs)
        out = func(*args, **kwargs)
        if self.census.on:
            name = func.overloadpacket.__name__
            for kind in self.classify(func, args, kwargs, out):
                self.census.op(kind, name, self.detail(args, out))
        return out

    @staticmethod
    def detail(args, out) -> str:
        """'dtype[shape]' of the first input tensor -> of the output: what a launch moves (e.g. a weight cast)."""
        def d(t):
            return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"

        src = next(_tensors(args), None)
        dst = next(_tensors(out), None)
        return " -> ".join(d(t) for t in (src, dst) if t is not None)

    @staticmethod
    def classify(func, args, kwargs, out) -> list[str]:
        """The launches of one aten op by kind ([] for none)."""
        name = func.overloadpacket.__name__
        if name in NO_LAUNCH or getattr(func, "is_view", False):
            return []
        ins = list(_tensors(args)) + list(_tensors(kwargs))
        outs = list(_tensors(out))
        if not any(_cuda(t) for t in ins + outs):
            return []  # host-only arithmetic
        if name in HOST_READ:
            return ["host_read"]
        if outs and all(t.numel() == 0 for t in outs):
            return []  # an empty result launches nothing
        if name in ("index_copy_", "index_put_", "index_add_") and all(t.numel() == 0 for t in ins[1:]):
            return []
        if name == "constant_pad_nd":  # empty + fill_ of the padded shape, then a copy of the input into it
            return ["fill"] + (["copy"] if args[0].numel() else [])
        if name == "copy_":
            dst, src = args[0], args[1]
            if _cuda(dst) and not _cuda(src):
                return ["h2d"]
            if _cuda(src) and not _cuda(dst):
                return ["d2h"]
            if dst.dtype != src.dtype:
                return ["cast"]
            return ["memcpy" if _memcpy_like(dst, src) else "copy"]
        if name in ("_to_copy", "clone"):
            src = args[0]
            dst = outs[0]
            if _cuda(dst) and not _cuda(src):
                return ["h2d"] if dst.dtype == src.dtype else ["h2d", "cast"]
            if _cuda(src) and not _cuda(dst):
                return ["d2h"]
            if dst.dtype != src.dtype:
                return ["cast"]
            return ["memcpy" if _memcpy_like(dst, src) else "copy"]
        if name in FILL:
            return ["fill"]
        if name in INDEX:
            return ["index"]
        if name in GEMM:
            return ["gemm"]
        return ["elementwise"]


class FakeCudaRedirect(TorchFunctionMode):
    """What a CPU-only torch refuses before dispatch, redirected onto fake CUDA: `.to(cuda)` / `.cuda()` become
    aten._to_copy, `pin_memory()` returns the tensor, a fake "cuda" generator is dropped from random draws."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        gen = kwargs.get("generator")
        if isinstance(gen, _FakeGenerator) and gen.device.type == "cuda":
            kwargs.pop("generator")
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.__getitem__ and _cuda(args[0]):
            return _getitem(*args)
        if func is torch.Tensor.__setitem__ and _cuda(args[0]):
            return _setitem(*args)
        if func is torch.Tensor.cuda:
            return self._to(args[0], torch.device("cuda"), None, False)
        if func is torch.Tensor.to:
            copy = kwargs.get("copy", False)
            device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(
                *args[1:], **{k: v for k, v in kwargs.items() if k != "copy"})
            t = args[0]
            if device is not None and torch.device(device).type == "cuda" or _cuda(t):
                if copy or memory_format not in (None, torch.preserve_format):
                    return func(*args, **kwargs)
                return self._to(t, device, dtype, non_blocking)
        try:
            return func(*args, **kwargs)
        except RuntimeError as exc:  # the Python binding's CUDA device guard, before any dispatch
            if "not linked with support for cuda" not in str(exc):
                raise
            return self._aten(func, args, kwargs, exc)

    DTYPE_METHODS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64,
                     "long": torch.int64, "int": torch.int32, "short": torch.int16, "bool": torch.bool,
                     "byte": torch.uint8, "char": torch.int8}
    DUNDER = {"__add__": "add", "__radd__": "add", "__sub__": "sub", "__mul__": "mul", "__rmul__": "mul",
              "__truediv__": "div", "__floordiv__": "floor_divide", "__mod__": "remainder", "__neg__": "neg",
              "__and__": "bitwise_and", "__or__": "bitwise_or", "__xor__": "bitwise_xor", "__invert__": "bitwise_not",
              "__lshift__": "bitwise_left_shift", "__rshift__": "bitwise_right_shift", "__iadd__": "add_",
              "__isub__": "sub_", "__imul__": "mul_", "__itruediv__": "div_", "__iand__": "bitwise_and_",
              "__ior__": "bitwise_or_", "__eq__": "eq", "__ne__": "ne", "__lt__": "lt", "__le__": "le", "__gt__": "gt",
              "__ge__": "ge", "__pow__": "pow", "__matmul__": "matmul", "__abs__": "abs"}

    def _aten(self, func, args, kwargs, exc):
        """A torch function whose binding refused the CUDA device, called as its aten op (the dispatcher itself
        takes fake CUDA tensors)."""
        name = getattr(func, "__name__", "")
        if name in self.DTYPE_METHODS:
            return self._to(args[0], None, self.DTYPE_METHODS[name], False)
        if name == "__rsub__":
            return torch.ops.aten.rsub(args[0], args[1])
        if name == "__rtruediv__":  # as torch does it: reciprocal, then the product
            return torch.ops.aten.mul(torch.ops.aten.reciprocal(args[0]), args[1])
        packet = getattr(torch.ops.aten, self.DUNDER.get(name, name), None)
        if packet is None:
            raise RuntimeError(f"decode_launch_census: {name} refused fake CUDA and has no aten op") from exc
        return packet(*args, **kwargs)

    @staticmethod
    def _to(t, device, dtype, non_blocking):
        device = t.device if device is None else torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", 0)
        dtype = t.dtype if dtype is None else dtype
        if t.device == device and t.dtype == dtype:
            return t
        return torch.ops.aten._to_copy.default(t, dtype=dtype, device=device, non_blocking=non_blocking)


_Generator = torch.Generator


def _basic_index(x: torch.Tensor, idx) -> tuple[torch.Tensor, list]:
    """x[idx]'s basic part (ints, slices, None, Ellipsis) as the aten views the C++ indexing uses (select, slice,
    unsqueeze), and the advanced indices (tensors, lists) aligned to the result's dims, None elsewhere."""
    idx = idx if isinstance(idx, tuple) else (idx,)
    used = sum(0 if i is None or i is Ellipsis else 1 for i in idx)  # dims the index consumes (no bool masks)
    out, dim, adv = x, 0, []
    for i in idx:
        if i is Ellipsis:
            skip = x.dim() - used
            dim += skip
            adv += [None] * skip
        elif i is None:
            out = out.unsqueeze(dim)
            adv.append(None)
            dim += 1
        elif isinstance(i, bool):
            raise NotImplementedError("decode_launch_census: a bool scalar index")
        elif isinstance(i, (int, torch.SymInt)):
            out = torch.ops.aten.select.int(out, dim, i)
        elif isinstance(i, slice):
            step = 1 if i.step is None else i.step
            out = torch.ops.aten.slice.Tensor(out, dim, i.start, i.stop, step)
            adv.append(None)
            dim += 1
        else:
            t = i if isinstance(i, torch.Tensor) else torch.tensor(i)
            if t.device != x.device:
                t = FakeCudaRedirect._to(t, x.device, None, False)  # the C++ indexing moves the index too
            if t.dtype == torch.bool:
                raise RuntimeError("decode_launch_census: a bool mask index reads its count back to the host")
            adv.append(t)
            dim += 1
    return out, adv


def _getitem(x, idx):
    out, adv = _basic_index(x, idx)
    if any(a is not None for a in adv):
        while adv and adv[-1] is None:
            adv.pop()
        out = torch.ops.aten.index.Tensor(out, adv)
    elif out is x:
        out = torch.ops.aten.alias.default(x)
    return out


def _setitem(x, idx, value):
    out, adv = _basic_index(x, idx)
    if any(a is not None for a in adv):
        while adv and adv[-1] is None:
            adv.pop()
        if not isinstance(value, torch.Tensor):  # as the C++ indexing does for a CUDA tensor: a CPU scalar
            value = torch.ops.aten.scalar_tensor.default(value, dtype=x.dtype, device="cpu")
        torch.ops.aten.index_put_.default(out, adv, value)
    elif isinstance(value, torch.Tensor):  # as aten ops: the Python bindings' CUDA guard refuses a fake CUDA tensor
        torch.ops.aten.copy_.default(out, value)
    else:
        torch.ops.aten.fill_.Scalar(out, value)


class _FakeGenerator(_Generator):
    """torch.Generator("cuda") on a CPU-only torch: a CPU generator that reports the CUDA device (its draws drop it:
    fake tensors hold no values)."""

    def __new__(cls, device="cpu"):
        g = _Generator.__new__(cls, "cpu")
        g._fake_device = torch.device(device)
        return g

    def __init__(self, device="cpu"):
        pass

    @property
    def device(self):
        return self._fake_device


class _Stream:
    """torch.cuda.Stream / current_stream stand-in: launches on a side stream still count."""

    cuda_stream = 0

    def __init__(self, *a, **k):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event

    def synchronize(self):
        pass


@contextlib.contextmanager
def fake_cuda(census: Census):
    """Fake CUDA for the census: device queries answered as an H200, TileLang compiles replaced by launch
    recorders, tensors on the FakeTensorMode, ops counted by `census` while census.on."""
    from deepinfer.kernels.tilelang import _build, tensor_map

    capturing = {"on": False}
    _import_real()  # module-level tables are built as real tensors, before the fake mode

    def compiled(builder, *args):
        name = getattr(builder, "__name__", str(builder))

        def kernel(*a, **k):
            first = a[0] if a else None  # a launch's tokens where its first argument is [tokens, ...] (x)
            census.launch(name, int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() else None)

        return kernel

    def stream_ctx(stream=None):
        return contextlib.nullcontext()

    patches = [
        mock.patch.object(_build, "_compiled", compiled),
        mock.patch.object(_build, "_MANIFEST_STARTED", True),
        # the driver's tensor-map encoding (libcuda) for moe_bulk_kernel: its bytes are never read as values here
        mock.patch.object(tensor_map, "encode_2d_u8", lambda *a, **k: bytes(128)),
        mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: (9, 0)),
        mock.patch.object(torch.cuda, "get_device_properties", lambda device=None: H200),
        mock.patch.object(torch.cuda, "get_device_name", lambda device=None: H200.name),
        mock.patch.object(torch.cuda, "current_device", lambda: 0),
        mock.patch.object(torch.cuda, "device_count", lambda: 1),
        mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: capturing["on"]),
        mock.patch.object(torch.cuda, "Stream", _Stream),
        mock.patch.object(torch.cuda, "current_stream", lambda device=None: _Stream()),
        mock.patch.object(torch.cuda, "stream", stream_ctx),
        mock.patch.object(torch.cuda, "synchronize", lambda device=None: None),
        mock.patch.object(FakeTensor, "data_ptr", lambda self: self.storage_offset() * self.element_size(),
                          create=True),
    ]
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        _build.sm_count.cache_clear()
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        stack.enter_context(CountOps(census))
        stack.enter_context(FakeCudaRedirect())
        yield capturing
    _build.sm_count.cache_clear()


def _import_real() -> None:
    import importlib
    import pkgutil

    import deepinfer.engine.cuda_graphs  # noqa: F401
    import deepinfer.kernels.tilelang
    import deepinfer.kernels.torch
    import deepinfer.models.synthetic  # noqa: F401

    for pkg in (deepinfer.kernels.torch, deepinfer.kernels.tilelang):
        for m in pkgutil.iter_modules(pkg.__path__):
            importlib.import_module(f"{pkg.__name__}.{m.name}")


# ---- the step -----------------------------------------------------------------------------------------------------
BLOCK_SIZE = 64
DRAFT_LINES = 12  # glue lines a drafting entry keeps in the JSON
DRAFTS = 5  # DSpark's block: drafts a drafting step makes per request (V4.1-Flash's num_draft_tokens)


def build_model(name: str, drafts: bool = False):
    from deepinfer.models import synthetic

    cfg = synthetic.config(synthetic.DSPARK_FLASH if drafts else None, full_depth=name == "flash40")
    prefs = {"default": ["tilelang-sm90", "torch"]}
    with mock.patch.object(torch, "Generator", _FakeGenerator):  # random_weights draws with a "cuda" generator
        return synthetic.build_model(cfg, "cuda", torch.bfloat16, backends=prefs, seed=0)


def warm_weight_checks(model) -> int:
    """What the warm-up before a graph capture leaves behind and a fake tensor cannot compute: the once-per-weight
    scale-range checks of the FP8 linears (tilelang/linear.py _scales_in_range) and the packed experts
    (tilelang/moe.py _scales_in_range), each a device read, answered True (random_weights draws in-range scales)."""
    from deepinfer.kernels.fp8_weight import Fp8BlockWeight
    from deepinfer.kernels.packed_experts import PackedExperts

    seen, n = set(), 0

    def walk(o, depth=0):
        nonlocal n
        if id(o) in seen or depth > 8 or isinstance(o, (torch.Tensor, str, int, float, type(None))):
            return
        seen.add(id(o))
        if isinstance(o, Fp8BlockWeight):
            object.__setattr__(o, "_scales_ok", True)
            n += 1
        elif isinstance(o, PackedExperts):
            o._scales_ok = True
            n += 1
        items = list(getattr(o, "__dict__", {}).values())  # RowGroups: a list with its `whole`
        if isinstance(o, dict):
            items += list(o.values())
        elif isinstance(o, (list, tuple)):
            items += list(o)
        for x in items:
            walk(x, depth + 1)

    walk(model.layers)
    walk([model.head, model.embed, getattr(model, "drafter", None)])  # the draft layers' weights too
    return n


def census_step(model, census: Census, capturing: dict, batch: int, context: int, drafts: bool = False) -> dict:
    """One decode step of `batch` sequences of `context` tokens as DecodeGraphs captures and replays it (`drafts`:
    in DSpark's pools, so the step also writes the draft layers' context rings, as every DSpark step does)."""
    from deepinfer.engine.cuda_graphs import DecodeGraphs
    from deepinfer.kernels.registry import no_host_reads
    from deepinfer.models.cache import SequenceCache, derive

    extra = 16  # decoded tokens the pools leave room for (decode_gpu.py: max_model_len = context + max_tokens + 64)
    max_model_len = context + extra + BLOCK_SIZE
    blocks_per_seq = -(-(context + extra) // BLOCK_SIZE)
    extra_pools = dict(max_rollback=DRAFTS, drafts=True) if drafts else {}
    pools = model.allocate_cache(batch, batch * blocks_per_seq, BLOCK_SIZE, **extra_pools)
    graphs = DecodeGraphs(model, pools, batch, 8, -(-max_model_len // BLOCK_SIZE))
    states = [SequenceCache(pools, i, range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
    for s in states:
        s.num_tokens = context
    tokens = [[3 + i] for i in range(batch)]
    key = graphs.key_for(tokens, states)
    if key is None:
        raise RuntimeError(f"no graph bucket serves B={batch} (sizes {graphs.sizes}, widths {graphs.block_sizes})")
    size, width, length = key

    class _Replay:
        def replay(self):
            pass

    layers = len(model.layers)

    def hook(i):
        census.region = f"layer {i}" if i < layers else "head"

    # the captured graph's body: derive the metadata from the static inputs, then the forward, no host reads; first
    # uncounted, as DecodeGraphs' warm-up before its capture (what a launcher caches, e.g. moe.py's _shared_table,
    # is made there and only read by the graph), then counted with the stream reported as capturing
    host = graphs._host(size, width, length)
    model.layer_hook = hook
    try:
        for counted in (False, True):
            capturing["on"] = counted
            with torch.inference_mode(), no_host_reads():
                census.on, census.region = counted, "derive"
                meta = derive(host, pools)
                census.region = "pre"
                out = model.run(meta, pools)
                census.on = False
    finally:
        capturing["on"] = False
        model.layer_hook = None
    # the host staging before each replay (outside the graph): DecodeGraphs.run with the graph replaced by a no-op
    graphs._graphs[key] = (_Replay(), out)
    with torch.inference_mode():
        census.on, census.region = True, "stage"
        graphs.run(tokens, states, key)
        census.on = False
    return dict(bucket=dict(batch=size, table_width=width, tokens_per_seq=length), layers=layers,
                blocks_per_seq=blocks_per_seq)


def census_drafting(model, census: Census, capturing: dict, batch: int, context: int, mode: str) -> dict:
    """One DSpark drafting step of `batch` requests as DraftGraphs captures and replays it in `mode` (greedy,
    sampled: temperature 0.8, cut: also top-p 0.9): the block's draft layers, heads and each position's choice
    over the static inputs, under registry.no_host_reads (a host read in the graph body raises)."""
    from deepinfer.engine.cuda_graphs import DraftGraphs
    from deepinfer.kernels.registry import no_host_reads
    from deepinfer.sampling import SamplingParams
    from deepinfer.sampling.speculative import DraftChooser, DraftRequest

    blocks_per_seq = -(-(context + 16) // BLOCK_SIZE)
    pools = model.allocate_cache(batch, batch * blocks_per_seq, BLOCK_SIZE, max_rollback=DRAFTS, drafts=True)
    graphs = DraftGraphs(model.drafter, pools, batch, 8, DRAFTS, model.config.vocab_size)
    size = next(s for s in graphs.sizes if s >= batch)
    params = {"greedy": SamplingParams(temperature=0.0), "sampled": SamplingParams(temperature=0.8),
              "cut": SamplingParams(temperature=0.8, top_p=0.9)}[mode]
    chooser = DraftChooser([DraftRequest(params, 1 + r, 0) for r in range(batch)], model.config.vocab_size)
    if DraftGraphs.mode(chooser) != mode:
        raise RuntimeError(f"drafting census: the requests of mode {mode} took {DraftGraphs.mode(chooser)}")
    if mode != "greedy":
        from deepinfer.sampling.static_drafts import StaticDraftChooser

        graphs.static = StaticDraftChooser(graphs.sizes[-1], DRAFTS, model.config.vocab_size, pools.device)
        graphs.static.fill(chooser, size)
    try:
        for counted in (False, True):  # the capture's warm-up, then the captured body
            capturing["on"] = counted
            with torch.inference_mode(), no_host_reads():
                census.on, census.region = counted, "draft"
                graphs._draft(size, mode)
                census.on = False
    finally:
        capturing["on"] = False
    return dict(bucket=dict(batch=size, mode=mode, drafts=DRAFTS), layers=model.drafter.num_layers,
                blocks_per_seq=blocks_per_seq)


# ---- report -------------------------------------------------------------------------------------------------------
GLUE = ("cast", "copy", "index", "fill", "elementwise", "host_read")  # aten kinds counted as glue kernels


def summarize(census: Census, info: dict, top: int) -> dict:
    """One batch's census as JSON: totals of the step (the graph body) and of the staging before a replay, per
    region (derive / pre / layer i / head), by TileLang builder and by aten op, and the glue by source line."""
    regions = list(dict.fromkeys(list(census.tilelang) + list(census.aten)))
    step_regions = [r for r in regions if r != "stage"]

    def totals(rs):
        k = Counter()
        for r in rs:
            for (kind, _), n in census.aten.get(r, {}).items():
                k[kind] += n
        tl = sum(sum(census.tilelang.get(r, {}).values()) for r in rs)
        glue = sum(n for kd, n in k.items() if kd in GLUE)
        return dict(kernels=tl + glue + k["gemm"], tilelang=tl, glue=glue, gemm=k["gemm"], memcpy_d2d=k["memcpy"],
                    h2d=k["h2d"], by_kind=dict(k.most_common()))

    by_builder, by_op, stage_ops = Counter(), Counter(), Counter()
    for r in step_regions:
        by_builder.update(census.tilelang.get(r, {}))
        for (kind, op), n in census.aten.get(r, {}).items():
            by_op[f"{op} [{kind}]"] += n
    for (kind, op), n in census.aten.get("stage", {}).items():
        stage_ops[f"{op} [{kind}]"] += n
    # glue by source line (and by line and op; layers together), the staging left out; memcpy listed beside glue
    def cls(region):
        return "layer" if region.startswith("layer") else region

    merged, details, origins, by_region_line = Counter(), {}, {}, defaultdict(Counter)
    for (region, kind, op, site, caller), n in census.sites.items():
        if region == "stage" or kind not in GLUE + ("memcpy", "gemm"):
            continue
        key = (cls(region), kind, op, site, caller)
        merged[key] += n
        details.setdefault(key, Counter()).update(census.details[(region, kind, op, site, caller)])
        origins.setdefault(key, Counter()).update(census.origins[(region, kind, op, site, caller)])
        if kind in GLUE:
            by_region_line[region][site] += n
    lines: dict[str, dict] = {}
    sites, gemm_sites = [], []
    for key, n in merged.most_common():
        rc, kind, op, site, caller = key
        detail = [d for d, _ in details[key].most_common(2)]
        row = dict(site=site, caller=caller, origin=dict(origins[key].most_common()), op=op, kind=kind, region=rc,
                   count=n, detail=detail, code=census.code.get(site, ""))
        if kind == "gemm":
            gemm_sites.append(row)
            continue
        sites.append(row)
        line = lines.setdefault(site, dict(site=site, count=0, ops=Counter(), regions=Counter(), callers=Counter(),
                                           code=census.code.get(site, ""), detail=detail))
        if kind != "memcpy":
            line["count"] += n
        line["ops"][f"{op} [{kind}]"] += n
        line["callers"][caller] += n
    for region, counts in by_region_line.items():
        for site, n in counts.items():
            lines[site]["regions"][region] += n
    glue_lines = sorted(lines.values(), key=lambda x: -x["count"])
    for x in glue_lines:
        x["ops"], x["regions"], x["callers"] = (dict(x[k].most_common()) for k in ("ops", "regions", "callers"))
    tl_sites = Counter()
    for (region, b, site, caller), n in census.tl_sites.items():
        if region != "stage":
            tl_sites[(cls(region), b, site, caller)] += n
    tl_sites = [dict(builder=b, site=s, caller=c, region=rc, count=n) for (rc, b, s, c), n in tl_sites.most_common()]
    # launches by builder and the leading dim of their first argument (the tokens of a call where that is x)
    rows_by_builder = defaultdict(Counter)
    for (region, b), counts in census.tl_rows.items():
        if region != "stage":
            rows_by_builder[b].update(counts)
    rows_by_builder = {b: {str(r): n for r, n in sorted(c.items())} for b, c in sorted(rows_by_builder.items())}
    per_region = [dict(region=r, **{k: v for k, v in totals([r]).items()},
                       builders=dict(census.tilelang.get(r, Counter()).most_common()),
                       glue_lines=dict(by_region_line[r].most_common()))
                  for r in step_regions]
    return dict(info, step=totals(step_regions), stage=totals(["stage"]) | dict(ops=dict(stage_ops.most_common())),
                tilelang_by_builder=dict(by_builder.most_common()), tilelang_rows_by_builder=rows_by_builder,
                aten_by_op=dict(by_op.most_common()),
                per_region=per_region, glue_lines=glue_lines[:top], glue_line_count=len(glue_lines),
                glue_sites=sites[:2 * top], gemm_sites=gemm_sites, tilelang_sites=tl_sites)


def by_batch(results: dict) -> list[dict]:
    """Every glue line of any batch with its launches per step at each batch (does it grow with B?)."""
    rows: dict[str, dict] = {}
    for b, res in results.items():
        for x in res["glue_lines"]:
            row = rows.setdefault(x["site"], dict(site=x["site"], code=x["code"], ops=x["ops"], counts={}))
            row["counts"][b] = x["count"]
    out = sorted(rows.values(), key=lambda r: -max(r["counts"].values()))
    for r in out:
        r["grows_with_batch"] = len(set(r["counts"].get(b, 0) for b in results)) > 1
    return out


def print_report(batch, res: dict, top: int) -> None:
    s, st = res["step"], res["stage"]
    print(f"\n=== B={batch}: graph bucket {res['bucket']}; one step (the graph body): {s['kernels']} kernel launches = "
          f"{s['tilelang']} TileLang + {s['glue']} glue + {s['gemm']} cuBLAS (+{s['memcpy_d2d']} D2D memcpy); "
          f"glue by kind {dict((k, v) for k, v in s['by_kind'].items() if k in GLUE)}")
    print(f"    staging before the replay (outside the graph): {st['kernels']} kernels, {st['memcpy_d2d']} D2D memcpy, "
          f"{st['h2d']} H2D copies: {st['ops']}")
    print(f"    {'region':9s} {'kernels':>7s} {'TileLang':>8s} {'glue':>5s} {'cuBLAS':>6s}")
    for row in res["per_region"]:
        print(f"    {row['region']:9s} {row['kernels']:7d} {row['tilelang']:8d} {row['glue']:5d} {row['gemm']:6d}")
    print("    TileLang by builder:", res["tilelang_by_builder"])
    print("    cuBLAS:", [f"{x['count']} {x['op']} {x['detail'][0]} from {x['origin']}" for x in res["gemm_sites"]])
    print("    per-call fallbacks to torch ops (warm-up and counted step):", res["torch_fallbacks"] or "none")
    print("    aten launches by op:", res["aten_by_op"])
    print(f"    glue by source line (top {min(top, res['glue_line_count'])} of {res['glue_line_count']}):")
    for x in res["glue_lines"][:top]:
        print(f"    {x['count']:5d}  {x['site']}  {x['ops']}  {x['regions']}\n           {x['code'][:120]}")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("flash_reduced", "flash40"), default="flash_reduced",
                    help="synthetic FLASH_REDUCED (6 layers, one of each kind) or FLASH_FULL (the released 40)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--top", type=int, default=40, help="glue source sites kept in the JSON / printed")
    ap.add_argument("--drafting", nargs="+", default=[], choices=("greedy", "sampled", "cut"),
                    help="also count one DSpark drafting step per batch in these modes (the model then carries "
                         "V4.1-Flash's three draft layers, so the decode step writes their context too)")
    ap.add_argument("--out", default="benchmarks/results/decode_launch_census.json")
    return ap.parse_args(argv)


def targets(results: dict) -> list[dict]:
    """Issue 21's launch target, from the counted step: at most 50 kernels per layer of a decode step (the graph
    body over the layers), per batch counted. The GPU profile's count is a few percent higher (cuBLAS's second
    kernels, the sampler: see Limits)."""
    out = []
    for b, res in results.items():
        per_layer = round(res["step"]["kernels"] / res["layers"], 1)
        out.append(dict(name=f"decode B={b}: kernels per layer of a step (CPU census)", measured=per_layer,
                        target=50, unit="kernels/layer", met=per_layer <= 50))
    return out


def _delta(before: dict, after: dict) -> dict:
    return {f"{kind}: {why}": n - before.get(kind, {}).get(why, 0) for kind, reasons in after.items()
            for why, n in reasons.items() if n != before.get(kind, {}).get(why, 0)}


def main(argv=None) -> int:
    from deepinfer.kernels.registry import fallback_counts

    a = parse(argv)
    t0 = time.time()
    census = Census()
    results, drafting = {}, {}
    with fake_cuda(census) as capturing:
        model = build_model(a.model, drafts=bool(a.drafting))
        warmed = warm_weight_checks(model)
        print(f"model {a.model} built on fake CUDA in {time.time() - t0:.1f} s ({warmed} weight scale checks "
              "answered as a warm-up would); ops: "
              + ", ".join(f"{k}={v}" for k, v in model.ops.summary().items()), flush=True)
        for b in a.batches:
            census.__init__()
            before = fallback_counts()
            info = census_step(model, census, capturing, b, a.context, drafts=bool(a.drafting))
            info["torch_fallbacks"] = _delta(before, fallback_counts())  # warm-up + counted step: 2 calls each
            results[str(b)] = summarize(census, info, a.top)
            print_report(b, results[str(b)], a.top)
        for b in a.batches:
            for mode in a.drafting:
                census.__init__()
                before = fallback_counts()
                info = census_drafting(model, census, capturing, b, a.context, mode)
                info["torch_fallbacks"] = _delta(before, fallback_counts())
                res = summarize(census, info, a.top)
                print_report(f"{b}, DSpark drafting ({mode})", res, a.top)
                # one region: the totals, the builders and the glue by line say it (the .log has the rest)
                drafting[f"{b} {mode}"] = {k: v for k, v in res.items()
                                           if k not in ("per_region", "glue_sites", "gemm_sites", "tilelang_sites")}
                drafting[f"{b} {mode}"]["glue_lines"] = res["glue_lines"][:DRAFT_LINES]
    lines = by_batch(results)
    if len(results) > 1:
        print(f"\nglue lines by batch ({', '.join('B=' + b for b in results)}):")
        for r in lines[:a.top]:
            counts = " ".join(f"{r['counts'].get(b, 0):4d}" for b in results)
            grows = "  grows" if r["grows_with_batch"] else "       "
            print(f"    {counts}{grows}  {r['site']}  {r['code'][:90]}")
    meta = dict(model=a.model, context=a.context, torch=torch.__version__, backends=["tilelang-sm90", "torch"],
                device="fake CUDA (FakeTensorMode), device queries as an H200: sm_90, 132 SMs",
                path="DecodeGraphs capture body: derive(static inputs) + model.run under registry.no_host_reads",
                time=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), seconds=round(time.time() - t0, 1),
                limits=next(p for p in __doc__.split("\n\n") if p.startswith("Limits")).replace("\n", " "))
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(dict(meta=meta, targets=targets(results), batches=results, glue_lines_by_batch=lines,
                       **({"drafting": drafting} if drafting else {})), f,
                  separators=(",", ":"))  # compact: the .log is the readable form
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
