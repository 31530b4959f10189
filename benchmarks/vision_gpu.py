#!/usr/bin/env python3
"""Image input on the GPU (issue 27): ViT tokens/s and image-to-first-token time at the released vision config
(VISION_SPEC.md §1.1: 32 layers, width 1024, 16 heads, SwiGLU 2816, patch 14, 3x3 aligner into 5120, at most 1024
span tokens; random weights, bf16), for 1 and 16 images of 1024 x 1024 (a 74 x 74 patch grid: 5476 ViT tokens and a
652-token span each).

    source benchmarks/gpu_env.sh && python3 benchmarks/vision_gpu.py --out $OUT/vision_gpu_h200.json
    python3 benchmarks/vision_gpu.py --tiny --out vision_tiny.json          # the CPU smoke run (tiny configs)

Per image count N (distinct smooth random PNGs, seeded):
- preprocess: the frontend's host half per image (Pillow decode, plan, resize; frontend/images.py), host clock;
- vit: the tower alone on patches already on the device (CUDA events), and `vit tokens/s` = N x 5476 over it;
- vision path: resized pixels -> span rows (upload, centre / normalise / patchify on the device, ViT, unshuffle,
  aligner, span rows: VisionModel.forward as the model runner calls it), CUDA events;
- image-to-first-token: N requests of one image each (8 text tokens, the image, 4 text tokens), submitted at once
  through the engine (LLMEngine: frontend preprocessing, scheduler, ViT at prefill, the text prefill, sampling),
  max_tokens 1, host clock from the call to the last first token; beside it the same with N text-only prompts of the
  same expanded length (what the image adds is the difference). Text model: the Flash-width synthetic model of
  benchmarks/decode_gpu.py (`flash`: six layers, TileLang kernels preferred), its routers given a random bias_vl;
  --tiny: embedded:tiny-random-vision on the CPU.
Medians over --reps timed runs after one warm-up (TileLang JIT, allocator).

Issue 27 names no numeric target for these: they are listed under `measurements`. `targets` holds the checks, each
met or not: the ViT ran in bf16 on the device, torch SDPA's flash kernel can run the ViT's attention shapes (the
`vision_attention` op kind has no TileLang kernel: the run summary says "torch (fallback)", recorded in meta), the
TileLang rms_norm handed no ViT call to torch, every span row is finite, no request failed. Any check not met, or a
failed stage, exits 1 after the JSON is written.
"""

from __future__ import annotations

import argparse
import io
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent

RELEASED = {  # config.json keys of the released checkpoint's image path (VISION_SPEC.md §1.1)
    "image_token_id": 129264,
    "text_config": {"hidden_size": 5120, "vocab_size": 129280},
    "vision_config": {"num_hidden_layers": 32, "hidden_size": 1024, "num_attention_heads": 16,
                      "intermediate_size": 2816, "patch_size": 14, "rope_theta": 10000.0, "downsample_ratio": 3,
                      "max_image_tokens": 1024, "min_pixels": 295936, "max_wh_ratio": None},
}
SM90 = {"default": ["tilelang-sm90", "torch"]}
SIDE = 1024


def images(n: int, side: int = SIDE, seed: int = 0) -> list[bytes]:
    """n distinct PNGs of side x side: seeded low-resolution noise upsampled (smooth, so they compress like photos
    rather than like white noise)."""
    from PIL import Image

    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        small = (torch.rand(16, 16, 3, generator=gen) * 255).to(torch.uint8).numpy()
        img = Image.fromarray(small, "RGB").resize((side, side), Image.Resampling.BICUBIC)
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


class Timer:
    """CUDA events on a CUDA device (the device time of the enqueued work), the host clock elsewhere; seconds."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def __call__(self, fn):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return out, start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0


def median_time(timer, fn, reps: int) -> tuple[object, float]:
    fn()  # warm-up
    runs = [timer(fn) for _ in range(reps)]
    return runs[-1][0], statistics.median(t for _, t in runs)


# ---- the models -------------------------------------------------------------------------------------------------
def vision_model(tiny: bool, device: str, dtype):
    """The released-config VisionModel with random weights (nn.Linear's default init; norms at 1; seeded) on the
    device's op set, or with --tiny the embedded tiny one's config."""
    from deepinfer.kernels.registry import OpSet
    from deepinfer.models.vision import VisionConfig
    from deepinfer.models.vision.model import VisionModel

    if tiny:
        from deepinfer.embedded import config_json
        from deepinfer.models.vision import tiny as tiny_vision

        cfg = VisionConfig.from_dict(tiny_vision.with_vision(config_json()))
    else:
        cfg = VisionConfig.from_dict(RELEASED)
    torch.manual_seed(0)
    with torch.device(device):
        model = VisionModel(cfg)
    with torch.no_grad():
        for p in (model.image_start, model.image_end, model.image_newline):
            p.normal_()
    ops = OpSet.build(torch.device(device).type, SM90 if device.startswith("cuda") else None)
    return model.to(dtype).eval().use_ops(ops), ops


def text_model(tiny: bool, device: str, vision):
    """(model with `vision` attached, the engine's VisionConfig): --tiny: embedded:tiny-random-vision (its own tiny
    image path); else the six-layer Flash-width synthetic model with the released-config ViT and a random bias_vl."""
    if tiny:
        from deepinfer.embedded import materialize
        from deepinfer.models import load_model

        model = load_model(materialize("tiny-random-vision"), device=device, dtype=torch.float32)
        return model, model.vision.cfg
    sys.path.insert(0, str(HERE))
    from decode_gpu import build

    model = build("flash", device, SM90)
    gen = torch.Generator(device).manual_seed(1)
    for lw in model.layers:  # the synthetic weights draw no bias_vl (an optional tensor): image tokens route with it
        gate = lw.ffn.gate
        if gate.bias is None:
            gate.bias = torch.zeros(gate.weight.shape[0], device=device)
        gate.bias_vl = gate.bias + torch.randn(gate.bias.shape, generator=gen, device=device)
    assert vision.cfg.text_hidden_size == model.config.hidden_size and vision.cfg.vocab_size == model.config.vocab_size
    model.vision = vision
    return model, vision.cfg


def engine_for(model, vcfg, max_seqs: int, prompt_len: int):
    """An in-process engine for `max_seqs` prompts of `prompt_len` tokens in one prefill step, prefix caching off
    (the same images again would hit), eager (max_tokens 1: no decode step to graph)."""
    from deepinfer.config.schema import Settings
    from deepinfer.engine import EngineOptions
    from deepinfer.engine.backend import backend_from_model
    from deepinfer.frontend import LLMEngine

    block = 64
    layout = model.cache_layout(block)
    max_len = prompt_len + 2 * block
    per_seq = layout.slot_bytes() + math.ceil(max_len / block) * layout.block_bytes()
    budget = int(max_seqs * per_seq * 1.01) + (1 << 20)
    backend = backend_from_model(model)
    opts = EngineOptions.for_settings(Settings(), max_num_seqs=max_seqs, max_num_batched_tokens=max_seqs * prompt_len,
                                      max_model_len=max_len, memory_budget=budget, block_size=block,
                                      process="inproc", enforce_eager=True, prefix_caching=False, seed=0)
    return LLMEngine(lambda: backend, opts, vision=vcfg)


# ---- the stages -------------------------------------------------------------------------------------------------
def stage_vision(model, data: list[bytes], device: str, reps: int) -> tuple[dict, list[str], dict]:
    """Preprocess, ViT and vision-path timings for these images; (row, failures, checks)."""
    from deepinfer.kernels.registry import fallback_counts
    from deepinfer.models.vision import ImageProcessor
    from deepinfer.models.vision.decode import decode_image

    proc = ImageProcessor(model.cfg)
    pre, resized = [], []
    for d in data:
        t0 = time.perf_counter()
        resized.append(proc.resize(decode_image(d)))
        pre.append(time.perf_counter() - t0)
    layout = resized[0].layout
    n = len(data)
    timer = Timer(device)
    with torch.inference_mode():
        patches = [r.patches(model.cfg.patch_size, device) for r in resized]
        pix = torch.cat([p.pixel_values for p in patches])
        pos = torch.cat([p.positions for p in patches])
        counts = [p.layout.num_patches for p in patches]
        before = fallback_counts()
        feats, vit_s = median_time(timer, lambda: model.vision(pix, pos, counts), reps)
        rows, path_s = median_time(timer, lambda: model(resized), reps)
        after = fallback_counts()
    norm_fallbacks = sum(after.get("rms_norm", {}).values()) - sum(before.get("rms_norm", {}).values())
    finite = bool(feats.isfinite().all()) and all(bool(r.isfinite().all()) for r in rows)
    row = {
        "images": n, "image_size": [SIDE, SIDE], "patches_per_image": layout.num_patches,
        "span_tokens_per_image": layout.num_tokens,
        "preprocess_ms_per_image": 1e3 * statistics.median(pre),
        "vit_ms": 1e3 * vit_s, "vit_tokens_per_s": n * layout.num_patches / vit_s,
        "vision_path_ms": 1e3 * path_s,
        "rows_dtype": str(rows[0].dtype), "rows_device": str(rows[0].device),
    }
    failures = [] if finite else [f"{n} images: non-finite ViT features or span rows"]
    checks = {"finite": finite, "norm_fallbacks": norm_fallbacks}
    return row, failures, checks


def flash_eligible(model, device: str) -> bool:
    """Whether torch SDPA's flash kernel takes the ViT's attention at one image's shapes (bf16 [1, heads, 5476, 64]):
    the kernel the vision_attention op picks by default; a shape it refuses would fall to a slower backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = model.cfg
    q = torch.randn(1, cfg.num_attention_heads, 5476, cfg.head_dim, device=device, dtype=torch.bfloat16)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, q, q)
        return True
    except RuntimeError:
        return False


def stage_first_token(engine, vcfg, data: list[bytes], reps: int, seed: int) -> tuple[dict, list[str]]:
    """Image-to-first-token for len(data) one-image requests at once, and text-only prompts of the same length."""
    from deepinfer import SamplingParams

    n = len(data)
    gen = torch.Generator().manual_seed(seed)
    hi = min(500, vcfg.vocab_size)
    text = [torch.randint(3, hi, (12,), generator=gen).tolist() for _ in range(n)]
    prompts = [t[:8] + [vcfg.image_token_id] + t[8:] for t in text]
    mm = [{"image_bytes": [d]} for d in data]
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    failures, lengths = [], []

    def run(ps, m):
        t0 = time.perf_counter()
        outs = [u.output for u in engine.stream(prompt_token_ids=ps, sampling_params=sp, tokens=False,
                                                multi_modal_data=m)]
        wall = time.perf_counter() - t0
        failures.extend(o.error for o in outs if o.error is not None)
        lengths[:] = [len(o.prompt_token_ids) for o in outs]
        return wall, [o.metrics.time_to_first_token for o in outs if o.metrics is not None]

    run(prompts, mm)  # warm-up: JIT, allocator
    image_runs = [run(prompts, mm) for _ in range(reps)]
    expanded = lengths[0]
    plain = [torch.randint(3, hi, (expanded,), generator=gen).tolist() for _ in range(n)]
    run(plain, None)
    text_runs = [run(plain, None) for _ in range(reps)]
    row = {
        "prompt_tokens": expanded,
        "image_to_first_token_ms": 1e3 * statistics.median(w for w, _ in image_runs),
        "image_request_ttft_ms_median": 1e3 * statistics.median(t for _, ts in image_runs for t in ts),
        "text_same_length_first_token_ms": 1e3 * statistics.median(w for w, _ in text_runs),
    }
    return row, [f"{n} images: request failed: {e}" for e in failures]


# ---- main -------------------------------------------------------------------------------------------------------
def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/vision_gpu_h200.json")
    ap.add_argument("--tiny", action="store_true", help="the CPU smoke run: tiny vision and text models, on the CPU")
    ap.add_argument("--device", default=None, help="default: cuda, or cpu with --tiny")
    ap.add_argument("--images", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-engine", action="store_true", help="skip image-to-first-token (the vision stages only)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    device = args.device or ("cpu" if args.tiny else "cuda")
    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("vision_gpu: no CUDA device; allowed: --tiny (or --device cpu) on a machine without one", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if cuda else torch.float32
    t_start = time.perf_counter()
    model, ops = vision_model(args.tiny, device, dtype)
    data = images(max(args.images))
    rows, failures, targets = [], [], []
    norm_fallbacks, finite = 0, True
    for n in args.images:
        row, fails, checks = stage_vision(model, data[:n], device, args.reps)
        rows.append(row)
        failures += fails
        norm_fallbacks += checks["norm_fallbacks"]
        finite = finite and checks["finite"]
        print(f"{n:>3} images: preprocess {row['preprocess_ms_per_image']:.1f} ms/image, ViT {row['vit_ms']:.2f} ms "
              f"({row['vit_tokens_per_s']:.4g} tokens/s), vision path {row['vision_path_ms']:.2f} ms", flush=True)
    if not args.no_engine:
        text, vcfg = text_model(args.tiny, device, model)  # --tiny: the embedded model's own tiny image path
        prompt_len = 12 + max(r["span_tokens_per_image"] for r in rows)
        engine = engine_for(text, vcfg, max(args.images), prompt_len)
        try:
            for row, n in zip(rows, args.images):
                extra, fails = stage_first_token(engine, vcfg, data[:n], max(1, args.reps // 2), seed=n)
                row.update(extra)
                failures += fails
                print(f"{n:>3} images: image-to-first-token {extra['image_to_first_token_ms']:.1f} ms (text prompt "
                      f"of the same length: {extra['text_same_length_first_token_ms']:.1f} ms)", flush=True)
        finally:
            engine.close()
    on_device = all(r["rows_device"].startswith(device) for r in rows)
    targets.append({"name": f"span rows computed on {device} in {str(dtype).split('.')[-1]}", "measured":
                    rows[0]["rows_dtype"], "target": str(dtype), "unit": "dtype",
                    "met": on_device and all(r["rows_dtype"] == str(dtype) for r in rows)})
    targets.append({"name": "non-finite ViT features or span rows", "measured": 0 if finite else 1, "target": 0,
                    "unit": "runs", "met": finite})
    failed = sum("request failed" in f for f in failures)
    targets.append({"name": "image or text requests that failed", "measured": failed, "target": 0,
                    "unit": "requests", "met": failed == 0})
    if cuda:
        eligible = flash_eligible(model, device)
        targets.append({"name": "torch SDPA flash kernel takes the ViT attention (bf16, 5476 tokens, head dim 64)",
                        "measured": eligible, "target": True, "unit": "bool", "met": eligible})
        targets.append({"name": "ViT rms_norm calls the TileLang backend handed to torch", "measured": norm_fallbacks,
                        "target": 0, "unit": "calls", "met": norm_fallbacks == 0})
    measurements = []
    for r in rows:
        n = r["images"]
        measurements += [
            {"name": f"ViT tokens/s, {n} image(s) of {SIDE}x{SIDE}", "measured": r["vit_tokens_per_s"],
             "unit": "tokens/s"},
            {"name": f"pixels -> span rows on the device, {n} image(s)", "measured": r["vision_path_ms"], "unit": "ms"},
            {"name": "host preprocessing per image (decode + resize)", "measured": r["preprocess_ms_per_image"],
             "unit": "ms"},
        ]
        if "image_to_first_token_ms" in r:
            measurements.append({"name": f"image-to-first-token, {n} one-image request(s) at once",
                                 "measured": r["image_to_first_token_ms"], "unit": "ms"})
    failures += [f"check not met: {t['name']}" for t in targets if not t["met"]]
    from deepinfer.kernels.registry import kernel_stats

    out = {
        "meta": {
            "command": " ".join(sys.argv), "device": torch.cuda.get_device_name() if cuda else platform.machine(),
            "torch": torch.__version__, "dtype": str(dtype), "tiny": args.tiny, "reps": args.reps,
            "vision_config": {k: getattr(model.cfg, k) for k in ("num_hidden_layers", "hidden_size",
                                                               "num_attention_heads", "intermediate_size",
                                                               "max_image_tokens", "text_hidden_size")},
            "ops": {k: ops.summary()[k] for k in ("rms_norm", "vision_attention")},
            "text_model": None if args.no_engine else ("embedded:tiny-random-vision" if args.tiny else "flash"),
            "kernels": kernel_stats(),
            "elapsed_s": time.perf_counter() - t_start,
            "note": "issue 27 names no numeric target: the timings are measurements; targets are checks",
        },
        "rows": rows, "targets": targets, "measurements": measurements, "failures": failures,
    }
    sys.path.insert(0, str(HERE))
    from decode_gpu import portable_json

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(portable_json(out))
    print(f"wrote {args.out} ({out['meta']['elapsed_s']:.0f} s); vision ops: {out['meta']['ops']}")
    for f in failures:
        print(f"FAILED: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
