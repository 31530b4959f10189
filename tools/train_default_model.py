"""Train a small DeepSeek-V4.1-architecture model on the Python standard library and export it in the released
checkpoint format (issue 15, the backbone; the DSpark draft layers come later).

    python tools/train_default_model.py --preset h200 --device cuda --out outputs/default-v41   # the real run
    python tools/train_default_model.py --smoke                                              # CPU, < 60 s

Steps: the stdlib's files, split by file (held-out ~2.5%) -> a byte-level BPE with DeepSeek-V4.1's special tokens
-> training of tools/v41_train/model.py (every V4.1 mechanism, differentiable; the indexer by a KL to its layer's
attention, the router bias by the noaux_tc rule) -> export through deepinfer.embedded.write_release (FP8 / FP4 /
BF16 / F32 as released) -> measurements on the export: held-out loss vs a unigram baseline (training forward),
greedy completions and the plausibility rate by the inference engine, and the largest logit difference between
the training forward and deepinfer.models.load_model on the exported checkpoint. `report.json` in --out holds all
of it. Deterministic given --seed (on CUDA up to what torch's deterministic mode covers; see docs/training.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/v41_train, when run as a script

import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from v41_train import config as presets  # noqa: E402
from v41_train import data, evaluate  # noqa: E402
from v41_train.draft import DraftModel, draft_loss, random_anchors, teacher_logits  # noqa: E402
from v41_train.model import TrainModel  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(presets.PRESETS), default="h200")
    ap.add_argument("--smoke", action="store_true", help="= --preset smoke --device cpu, and assert the loss falls")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, help="override the preset's step count")
    ap.add_argument("--draft-steps", type=int, help="override the preset's draft-layer step count")
    ap.add_argument("--out", type=Path, help="export directory (default: outputs/train-default-v41-<preset>)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--no-eval", action="store_true", help="skip the engine completions and plausibility")
    ap.add_argument("--drafts-from", type=Path, metavar="DIR",
                    help="train only the draft layers, on the backbone and tokenizer of the export in DIR")
    ap.add_argument("--evaluate", type=Path, metavar="DIR",
                    help="only the engine completions and plausibility of an export made with --no-eval (e.g. on "
                         "a GPU machine), added to DIR/report.json")
    args = ap.parse_args(argv)
    if args.smoke:
        args.preset, args.device = "smoke", "cpu"
    args.out = args.out or Path("outputs") / f"train-default-v41-{args.preset}"  # outputs/ is git-ignored
    return args


def set_determinism(seed: int, device: torch.device) -> None:
    torch.manual_seed(seed)
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS reductions
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 as on the CPU the model is checked on
        torch.backends.cudnn.allow_tf32 = False
        torch.use_deterministic_algorithms(True, warn_only=True)


def lr_at(step: int, run: presets.Run, steps: int) -> float:
    """Linear warm-up, then cosine decay to 10%."""
    if step < run.warmup:
        return run.lr * (step + 1) / run.warmup
    t = (step - run.warmup) / max(1, steps - run.warmup)
    return run.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train(model: TrainModel, batches: data.Batches, run: presets.Run, steps: int, device, log) -> list[float]:
    decay = [p for n, p in model.params.items() if p.dim() >= 2 and "norm" not in n and "hc_" not in n]
    rest = [p for n, p in model.params.items() if not (p.dim() >= 2 and "norm" not in n and "hc_" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=run.lr, betas=(0.9, 0.95), eps=1e-8)
    losses = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, run, steps)
        x, y = (t.to(device) for t in batches.next())
        logits, kl, counts, _ = model(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        (loss + kl).backward()  # the KL reaches only the indexer's own weights (its inputs are detached)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        model.update_router_bias(counts, 1e-3)
        losses.append(loss.item())
        if step % max(1, steps // 20) == 0 or step == steps - 1:
            log(f"step {step:5d}  loss {losses[-1]:.4f}  indexer-kl {kl.item():.4f}  lr {lr_at(step, run, steps):.2e}")
    return losses


def train_drafts(drafter: DraftModel, backbone: TrainModel, batches: data.Batches, run: presets.Run, device, log,
                 gen: torch.Generator) -> list[float]:
    """The DSpark draft layers on the frozen backbone: each step, the backbone's context features of a batch
    (no gradient) and `draft_anchors` random drafting blocks per sequence, distilled from the backbone's own
    next-token distributions (draft.py)."""
    backbone.requires_grad_(False)
    with torch.no_grad():
        w = backbone.weights()
        embed, head = w["embed.weight"], w["head.weight"]
    targets = drafter.cfg.dspark_target_layer_ids
    sched = replace(run, lr=run.draft_lr, warmup=max(1, run.draft_steps // 20))
    params = list(drafter.parameters())
    opt = torch.optim.AdamW(params, lr=run.draft_lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    losses = []
    for step in range(run.draft_steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, sched, run.draft_steps)
        x, y = batches.next()
        ids = torch.cat([x, y[:, -1:]], 1).to(device)  # the targets of the last block positions
        blk = drafter.cfg.dspark_block_size
        with torch.no_grad():
            res = backbone(x.to(device), features_at=targets)
        anchors = random_anchors(x.shape[0], x.shape[1], run.draft_anchors, blk, gen).to(device)
        out = drafter(ids, [res.features[t] for t in targets], anchors, embed, head)
        loss, conf, hit = draft_loss(out, teacher_logits(res.logits, anchors, blk))
        opt.zero_grad(set_to_none=True)
        (loss + conf).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        drafter.update_router_bias(out.expert_counts, 1e-3)
        losses.append(loss.item())
        if step % max(1, run.draft_steps // 10) == 0 or step == run.draft_steps - 1:
            log(f"draft step {step:4d}  loss {losses[-1]:.4f}  confidence {conf.item():.4f}  "
                f"greedy hits by position {[round(h, 3) for h in hit.tolist()]}")
    return losses


@torch.no_grad()
def logit_agreement(model: TrainModel, out_dir: Path, inputs: torch.Tensor, device) -> dict:
    """The training forward vs the inference model loaded from the export (CPU, float32), on held-out windows:
    the largest |logit difference| and the greedy (argmax) agreement. What makes the trained model meaningful:
    the engine runs exactly the model that was trained."""
    from deepinfer.models import ForwardBatch, load_model

    engine_model = load_model(out_dir)
    diffs, agree, total, scale = [], 0, 0, 0.0
    for row in inputs:
        mine = model(row[None].to(device)).logits[0].cpu()
        theirs = engine_model.forward(ForwardBatch([row.tolist()], [engine_model.new_state()], all_logits=True))
        diffs.append(float((mine - theirs).abs().max()))
        agree += int((mine.argmax(-1) == theirs.argmax(-1)).sum())
        total += len(row)
        scale = max(scale, float(theirs.abs().max()))
    return {"max_abs_logit_diff": max(diffs), "max_abs_logit": scale, "argmax_agreement": agree / total}


def engine_evaluation(out: Path, held_files, n_headers: int, log) -> dict:
    """Greedy completions of evaluate.PROMPTS and the plausibility rate by the inference engine on the export."""
    completions = evaluate.generate(out, evaluate.PROMPTS, 48)
    for prompt, (text, _) in zip(evaluate.PROMPTS, completions):
        log(f"{prompt!r} -> {text!r}")
    headers = evaluate.function_headers(held_files, n_headers)
    rate, samples = evaluate.plausibility(out, headers)
    log(f"plausibility: {rate:.2%} of {len(headers)} held-out function headers")
    return dict(completions={p: t for p, (t, _) in zip(evaluate.PROMPTS, completions)}, plausibility=rate,
                plausibility_headers=len(headers), plausibility_samples=samples[:10],
                evaluated_with_python=platform.python_version())


def main(argv=None) -> dict:
    from deepinfer.config.hardware import set_cpu_threads

    args = parse_args(argv)
    set_cpu_threads(args.threads)
    if args.evaluate is not None:
        report = json.loads((args.evaluate / "report.json").read_text())
        preset = presets.PRESETS[report["preset"]]
        _, held_files = data.split(data.stdlib_files(), preset.max_bytes)
        report.update(engine_evaluation(args.evaluate, held_files, preset.plausibility_prompts, print))
        (args.evaluate / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        return report
    device = torch.device(args.device)
    run = presets.PRESETS[args.preset]
    if args.steps is not None:
        run = replace(run, steps=args.steps)
    if args.draft_steps is not None:
        run = replace(run, draft_steps=args.draft_steps)
    set_determinism(args.seed, device)
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {msg}", flush=True)

    files = data.stdlib_files()
    train_files, held_files = data.split(files, run.max_bytes)
    log(f"stdlib: {len(train_files)} training files, {len(held_files)} held out")
    if args.drafts_from is not None:  # the backbone (and its tokenizer) of an export, as it was exported
        tok = Tokenizer.from_file(str(args.drafts_from / "tokenizer.json"))
        cfg = json.loads((args.drafts_from / "config.json").read_text())
    else:
        tok = data.train_tokenizer([text for _, text in train_files], run.vocab_size)
        cfg = presets.config_json(run, tok)
    train_stream, held_stream = data.token_stream(tok, train_files), data.token_stream(tok, held_files)
    log(f"tokens: {len(train_stream)} training, {len(held_stream)} held out (vocab {run.vocab_size})")

    model = TrainModel(cfg, tok, args.seed)
    batches = data.Batches(train_stream, run.seq_len, run.batch_size, torch.Generator().manual_seed(args.seed))
    if args.drafts_from is not None:
        model.load_export(args.drafts_from)
        model, losses = model.to(device), []
        log(f"backbone: {args.drafts_from} (not trained again)")
    else:
        model = model.to(device)
        log(f"model: {sum(p.numel() for p in model.parameters())} parameters; {run.steps} steps of "
            f"{run.batch_size} x {run.seq_len} tokens on {device}")
        losses = train(model, batches, run, run.steps, device, log)
    train_seconds = time.perf_counter() - started
    weights = model.export_weights()
    drafter, draft_losses = None, []
    if run.draft_steps:
        drafter = DraftModel(cfg, args.seed).to(device)
        log(f"draft layers: {sum(p.numel() for p in drafter.parameters())} parameters; {run.draft_steps} steps of "
            f"{run.batch_size} x {run.draft_anchors} blocks of {drafter.cfg.dspark_block_size}")
        draft_losses = train_drafts(drafter, model, batches, run, device, log,
                                    torch.Generator().manual_seed(args.seed + 1))
        weights.update(drafter.export_weights())
    draft_seconds = time.perf_counter() - started - train_seconds

    from deepinfer.embedded import write_release

    args.out.mkdir(parents=True, exist_ok=True)
    write_release(args.out, cfg, tok.to_str().encode(), weights)
    log(f"exported to {args.out} ({(args.out / 'model.safetensors').stat().st_size / 1e6:.2f} MB of weights)")

    model.eval()
    held_in, held_tg = data.eval_windows(held_stream, run.seq_len, run.eval_windows)
    held = evaluate.heldout_loss(model, held_in, held_tg, run.batch_size, device)
    unigram = evaluate.unigram_loss(train_stream, held_tg, run.vocab_size)
    log(f"held-out loss {held:.4f} (ppl {math.exp(held):.2f}) vs unigram {unigram:.4f} (ppl {math.exp(unigram):.2f})")
    agreement = logit_agreement(model.cpu(), args.out, held_in[:2], "cpu")
    log(f"training forward vs engine on the export: {agreement}")
    drafting = {}
    if drafter is not None:
        drafter.eval()
        drafting = evaluate.draft_heldout(drafter.to(device), model.to(device), held_in, run.batch_size, device)
        log(f"draft layers on held-out text (teacher-forced): {drafting}")
        drafting["vs_engine"] = evaluate.draft_logits_vs_engine(drafter.cpu(), model.cpu(), args.out, held_in[0])
        log(f"draft layers, training forward vs engine on the export: {drafting['vs_engine']}")
    report = {
        "preset": args.preset, "seed": args.seed, "device": str(device), "steps": run.steps,
        "python": platform.python_version(), "torch": torch.__version__, "run": asdict(run),
        "train_files": len(train_files), "heldout_files": len(held_files),
        "train_tokens": len(train_stream), "heldout_tokens": int(held_tg.numel()),
        "first_losses": losses[:5], "last_losses": losses[-5:],
        "backbone_from": str(args.drafts_from) if args.drafts_from else None, "train_seconds": round(train_seconds, 1),
        "heldout_loss": held, "heldout_ppl": math.exp(held), "unigram_loss": unigram,
        "unigram_ppl": math.exp(unigram), "logits_vs_engine": agreement,
        "draft_first_losses": draft_losses[:5], "draft_last_losses": draft_losses[-5:],
        "draft_seconds": round(draft_seconds, 1), "drafting": drafting,
    }
    if not args.no_eval:
        report.update(engine_evaluation(args.out, held_files, run.plausibility_prompts, log))
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    if args.smoke and losses:
        head, tail = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
        assert tail < head - 0.5, f"smoke: the loss did not fall ({head:.3f} -> {tail:.3f})"
    log("done")
    return report


if __name__ == "__main__":
    main()
