"""Random weights for a V4.1 config in the released storage formats, in memory (`load_model(load_format="dummy")`
and the synthetic benchmark models): routed experts as random FP4 e2m1 codes with ue8m0 scales per row and 32 columns
and the shared expert FP8 e4m3 with 32x32 block scales, both kept as stored (QuantizedWeight -> PackedExperts);
FP8 projections e4m3 with 32x32 block scales, kept as stored (Fp8BlockWeight) when `fp8_linears` and otherwise
dequantised once (the same values); Engram tables carry values an FP8 checkpoint can hold; the rest is bf16 / fp32
as the release stores it. Scales keep activations at unit variance through every projection (the golden fixtures'
initialisation, `fixture_init`); the routers' selection bias is zero (SELECTION_BIAS: routing as even as a trained
model's)."""

from __future__ import annotations

import math
import re

import torch

from deepinfer.kernels.fp8_weight import Fp8BlockWeight
from deepinfer.kernels.packed_experts import QuantizedWeight
from deepinfer.kernels.torch.quant import FP8_MAX, ceil_pow2

from .config import ModelConfig
from .loading import tensors as kinds
from .loading.names import keeps_float32

_LAYER = re.compile(r"layers\.(\d+)\.(.*)")
# The routers' selection bias (ffn.gate.bias) is zero here, not the fixtures' N(0, 0.2): a trained model's bias is
# what balances its experts' load, and a random one favours some experts in every token's choice (beside
# sqrt-softplus scores of spread ~0.3). At V4.1-Flash's width a 64-token decode step then touched ~143 distinct
# experts of 384 where even routing touches 244 (roofline.py's count), so the benchmark models read fewer expert
# bytes than the release would and % of the roofline overstated (benchmarks/routing_spread.py; with the bias zero:
# 238-247, 241.5 on average). The image positions' bias_vl stays drawn (only image spans select with it).
SELECTION_BIAS = "ffn.gate.bias"


def random_weights(cfg: ModelConfig, device, dtype=torch.bfloat16, seed: int = 0, packed_experts: bool = True,
                   fp8_linears: bool | None = None, draft_layers: bool = True, share_layers: bool = False):
    """Canonical name -> tensor (or QuantizedWeight for experts when `packed_experts`, Fp8BlockWeight for the FP8
    projections when `fp8_linears`; default: on CUDA) for `cfg`, with the DSpark draft layers when `draft_layers`
    and the config has them. The values do not depend on `packed_experts` or `fp8_linears` (dense weights are the
    stored formats dequantised). A tied config's head is its embedding (as the checkpoint loader does).

    `share_layers`: backbone layers of the same kind (the same tensor names and shapes) hold the first such layer's
    tensors by reference, so a full-depth model fits one GPU (V4.1-Flash's routed experts alone are ~290 GB) while
    a step still reads every layer's weights from HBM (the loader packs shared experts once: weights.arrange)."""
    if fp8_linears is None:
        fp8_linears = torch.device(device).type == "cuda"
    gen = torch.Generator(device).manual_seed(seed)
    specs = kinds.expected_tensors(cfg, draft_layers)
    alias = shared_layer_names(specs) if share_layers else {}
    out = {}
    for name, spec in sorted(specs.items()):
        if spec.optional or name in alias:
            continue
        expert = ".ffn.experts." in name or ".ffn.shared_experts." in name
        if expert and kinds.FP4_ROWS in spec.allowed:
            q = _fp4_rows(spec.shape, gen)
            out[name] = q if packed_experts else q.dense(dtype)
            continue
        w = fixture_init(name, spec.shape, cfg.hidden_size, gen)
        if name.endswith(SELECTION_BIAS):  # drawn all the same, so every other tensor keeps its values
            w = torch.zeros_like(w)
        if packed_experts and expert:
            out[name] = _fp8_blocks(w)
        elif fp8_linears and not expert and kinds.FP8_BLOCK in spec.allowed:
            q = _fp8_blocks(w)
            out[name] = Fp8BlockWeight(q.weight, q.scale)
        elif kinds.FP8_BLOCK in spec.allowed or kinds.FP8_ROWS in spec.allowed:
            out[name] = _fp8_values(w, (32, 32) if kinds.FP8_BLOCK in spec.allowed else (1, 32)).to(dtype)
        else:
            out[name] = w.float() if keeps_float32(name) else w.to(dtype)
    for name, first in alias.items():
        if first in out:  # optional tensors are not drawn
            out[name] = out[first]
    if "head.weight" not in out:  # tie_word_embeddings
        out["head.weight"] = out["embed.weight"]
    return out


def _fp4_rows(shape, gen) -> QuantizedWeight:
    """Uniform e2m1 codes (RMS 2.93) with a scale of about 1 / (2.93 sqrt(fan_in)): unit-variance outputs."""
    rows, cols = shape
    centre = 127 + round(math.log2(1.0 / (2.93 * math.sqrt(cols))))
    w = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=gen, device=gen.device)
    s = torch.randint(centre - 1, centre + 2, (rows, cols // 32), dtype=torch.uint8, generator=gen, device=gen.device)
    return QuantizedWeight("fp4", w, s, (rows, cols))


def _block_scales(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    r, c = w.shape
    amax = w.float().view(r // block[0], block[0], c // block[1], block[1]).abs().amax(dim=(1, 3))
    return ceil_pow2(amax.clamp_min(1e-30) / FP8_MAX)


def _fp8_blocks(w: torch.Tensor) -> QuantizedWeight:
    s = _block_scales(w, (32, 32))
    full = s.repeat_interleave(32, 0).repeat_interleave(32, 1)
    codes = (w.float() / full).to(torch.float8_e4m3fn).view(torch.uint8)
    return QuantizedWeight("fp8", codes, (torch.log2(s).round() + 127).to(torch.uint8), tuple(w.shape))


def _fp8_values(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    s = _block_scales(w, block)
    full = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return (w.float() / full).to(torch.float8_e4m3fn).float() * full


def shared_layer_names(specs: dict) -> dict[str, str]:
    """name -> the same tensor's name in the first backbone layer of its kind, for every layer that is not the first
    of its kind (a kind: the layer's tensor names, shapes and allowed formats)."""
    by_layer: dict[int, dict[str, object]] = {}
    for name, spec in specs.items():
        m = _LAYER.fullmatch(name)
        if m:
            by_layer.setdefault(int(m.group(1)), {})[m.group(2)] = spec
    first: dict[tuple, int] = {}
    alias = {}
    for layer in sorted(by_layer):
        kind = tuple(sorted((k, tuple(s.shape), tuple(map(str, s.allowed)), s.optional)
                            for k, s in by_layer[layer].items()))
        rep = first.setdefault(kind, layer)
        if rep != layer:
            alias.update({f"layers.{layer}.{k}": f"layers.{rep}.{k}" for k in by_layer[layer]})
    return alias


def fixture_init(name: str, shape: tuple[int, ...], hidden: int, gen: torch.Generator) -> torch.Tensor:
    """The golden fixtures' initialisation (tests/fixtures/deepseek_v41/*/README.md): unit-variance activations
    through every projection, so the tiny model's logits are neither flat nor saturated."""

    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=gen.device) * std

    def uniform(lo: float, hi: float) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(shape, generator=gen, device=gen.device)

    leaf = name.rsplit(".", 2)
    if name in ("embed.weight",) or name.endswith("engram.embed.weight"):
        return normal(1.0)
    if name == "head.weight":
        return normal(1.0 / math.sqrt(hidden))
    if name.endswith("norm.weight"):
        return uniform(0.6, 1.4)
    if name.endswith(("hc_attn_base", "hc_ffn_base")):
        return normal(0.5)
    if name.endswith(("hc_attn_scale", "hc_ffn_scale")):
        return uniform(0.5, 1.5)
    if name.endswith("attn.attn_sink"):
        return normal(1.0)
    if name.endswith("ffn.gate.bias"):
        return normal(0.2)
    if name.endswith("ffn.gate.bias_vl"):
        return normal(1.0)
    if leaf[-1] in ("q_weight", "k_weight"):
        return uniform(0.5, 1.5)
    return normal(1.0 / math.sqrt(shape[-1]))  # projections, router, hc_*_fn: N(0, 1/fan_in)
