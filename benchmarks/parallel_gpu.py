#!/usr/bin/env python3
"""Issue 13's benchmark: dep2 (attention data parallel x MoE expert parallel over 2 ranks) against `single` on the
same per-rank model slice; the expert-parallel all-to-all time per decode step against the rank-to-rank bandwidth
measured in the same run; EPLB's imbalance before/after on a skewed synthetic routing.

    # 2 H200s (NVLink), device kind nvidia-h200-x2, from the repo root:
    source benchmarks/gpu_env.sh
    python3 benchmarks/parallel_gpu.py --device cuda --model flash --out $OUT/parallel_gpu.json
    # CPU smoke (gloo, 2 processes, the embedded test model):
    python3 benchmarks/parallel_gpu.py --device cpu --model tiny --batch 8 --context 64 --steps 4 --out outputs/parallel_cpu.json

STRUCTURE. torch.multiprocessing starts 2 rank processes (spawn); each joins a process group of 2 through
deepinfer.distributed.groups.init_group (NCCL on CUDA, one GPU a rank; gloo on the CPU) and runs, in this order:
  1. bandwidth: `all_to_all_single` of a --bw-mib MiB buffer split evenly over the 2 ranks (each rank sends half
     of it to the other and keeps half), 2 untimed + --bw-reps timed, median; bandwidth = bytes sent to the peer
     / time (per direction, both directions at once);
  2. `single`: a model of the same layers with HALF the routed experts (n_routed_experts = E / 2, same top-k, no
     process group): exactly the per-rank slice dep2 holds, run alone on the rank's device (both ranks run it
     at the same time, each its own copy; no collective inside);
  3. `dep2`: the full model in expert-parallel mode (ExpertParallel, ExpertPlacement.initial(E, 2): rank r holds
     experts [r*E/2, (r+1)*E/2), no redundant copies), every MoE layer going through
     deepinfer.distributed.expert_parallel.ep_moe_experts over the world group.
Both variants: the rank's own batch of --batch sequences (different tokens per rank), context --context FILLED, not
prefilled (layer_gpu.filled_sequences -> decode_gpu.fill_step: random valid cache codes), then --warmup untimed and
--steps timed decode steps of one token per sequence through `model.forward`, eager on both sides (the all-to-alls are
bracketed one by one, which a graph replay would hide; benchmarks/ep_gpu.py times the EP path with graphs on one GPU).
dep2's decode steps take the static-capacity dispatch (--dispatch static, the default: buffers for --batch tokens a
rank, 3 equal-split all-to-alls per MoE layer, the path the engine's graphs capture; each forward first agrees the
path on a gloo group), or --dispatch variable (4 per layer: the row counts first). The engine (lockstep loop,
scheduler, sampler) is NOT in the loop: its turns add a few small gloo collectives per step that the issue's target is
not about, and its StepStats do not split out the all-to-alls. Models have random weights in the released formats
(synthetic.random_weights: FP4 experts and FP8 projections held as stored on CUDA), bf16 on CUDA, fp32 on the CPU;
TileLang preferred on CUDA.

WHAT IS TIMED. step = CUDA events around one `model.forward` on the rank's current stream (perf_counter on the
CPU), synchronised after the step; medians over the timed steps. tok/s per rank = batch / median step. Ratio =
mean over ranks of dep2 tok/s / mean of single tok/s. All-to-all per step = the sum over the step's
`all_to_all_single` calls made by ep_moe_experts (per MoE layer: [row counts,] hidden rows, slot+weight, combine)
of CUDA events recorded right before and after each call on the current stream (perf_counter on the CPU; gloo is
synchronous). The calls are wrapped by replacing the module's `dist` with a forwarding shim; the time includes
waiting for the peer to arrive at the collective (rank skew), which is part of what a step pays. Bytes per step
= rows sent to the OTHER rank x row bytes, summed over the calls (static: the whole per-peer segments, used or not,
as equal splits move them; `dispatched_rows_to_peer` counts the used ones); floor = those bytes / the measured
bandwidth.

EPLB: deepinfer.distributed.eplb_runtime.skewed_imbalance_report for this model's expert count, 2 ranks,
--redundant redundant slots, top-k of the model, --batch tokens per rank (no model, no process group; the
runtime's own re-placement and dispatch rule).

Roofline (context only, CUDA only): benchmarks/roofline.py's step floor of the per-rank slice (E / 2 experts) at
batch x context, over the copy bandwidth / bf16 GEMM rate measured by rank 0 (kernels_gpu.ceilings).

Exit status non-zero, after the JSON is written, when a variant did not run as asked: a rank failed or wrote no
result, fewer timed steps than asked, EP made no all-to-all or sent no token rows to the other rank, or (CUDA) a
per-call fallback to torch of an attention / MoE / linear / indexer / top-k kind in either variant.
Under dep2 the rows a rank receives go through the registered moe_experts op (the TileLang grouped GEMM over the
rank's PackedExperts on CUDA), as `single`'s tokens do (`dep2_moe_path` in the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from decode_gpu import STRICT_KINDS, _fallback_delta, ceilings, load_roofline, portable_json  # noqa: E402
from decode_gpu import roofline_config, step_roofline  # noqa: E402
from layer_gpu import BLOCK_SIZE, decode_blocks, filled_sequences, token_ids  # noqa: E402
from target_card import on_card  # noqa: E402

TARGET_RATIO = 0.80
# ep_moe_experts' all-to-alls per MoE layer, in order: the variable path's four, the static path's three
A2A_KINDS = ("counts", "dispatch", "meta", "combine")
A2A_KINDS_STATIC = ("dispatch", "meta", "combine")
FILLED_NOTE = "decode context filled with random valid cache codes (decode_gpu.fill_step), not prefilled by the model"


# ---- models -----------------------------------------------------------------------------------------------------
def model_config(name: str, n_experts: int | None = None):
    """The ModelConfig of `flash` (synthetic.FLASH_REDUCED) or `tiny` (embedded:tiny-random's config.json), with
    n_routed_experts replaced by `n_experts` (the per-rank slice) when given."""
    from deepinfer.models import synthetic

    over = {"n_routed_experts": n_experts} if n_experts else {}
    if name == "flash":
        return synthetic.config(over)
    from deepinfer.embedded import materialize
    from deepinfer.models.config import ModelConfig

    data = json.loads((Path(materialize("tiny-random")) / "config.json").read_text())
    data["text_config"].update(over)
    return ModelConfig.from_dict(data)


def tokenizer_for(name: str):
    from deepinfer.models import synthetic

    if name == "flash":
        return synthetic.package_tokenizer()
    from tokenizers import Tokenizer

    from deepinfer.embedded import materialize

    return Tokenizer.from_file(str(Path(materialize("tiny-random")) / "tokenizer.json"))


def build_model(name: str, device: str, n_experts: int | None, ep=None):
    """Random weights in the released formats (FP4 experts / FP8 projections held as stored on CUDA) for the
    config; `ep` (ExpertParallel): the model keeps only its rank's expert slots (the rest are dropped here)."""
    from deepinfer.kernels.registry import OpSet
    from deepinfer.models import synthetic
    from deepinfer.models.deepseek_v41 import DeepseekV41Model

    cuda = device.startswith("cuda")
    cfg = model_config(name, n_experts)
    dtype = torch.bfloat16 if cuda else torch.float32
    ops = OpSet.build(torch.device(device).type, {"default": ["tilelang-sm90", "torch"]} if cuda else ["torch"])
    weights = synthetic.random_weights(cfg, device, dtype, seed=0, packed_experts=cuda, draft_layers=False)
    model = DeepseekV41Model(cfg, weights, tokenizer_for(name), ops, device, dtype, expert_parallel=ep)
    del weights
    if cuda:
        torch.cuda.empty_cache()
    return model


def held_gb(model) -> float:
    return model.weight_bytes() / 1e9


# ---- timing -----------------------------------------------------------------------------------------------------
class Clock:
    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


class TimedDist:
    """Stands in for `torch.distributed` inside deepinfer.distributed.expert_parallel and ep_dispatch: every
    all_to_all_single is bracketed by two clock marks and its bytes to the other ranks recorded (`kinds`: the calls
    of one MoE layer, in order); everything else is forwarded. Static path: the metadata call also counts, on the
    device, the rows to the other ranks that are used (read after the step)."""

    def __init__(self, clock: Clock, me: int, world: int, kinds=A2A_KINDS):
        import torch.distributed as dist

        self._dist, self.clock, self.me, self.world, self.calls, self.kinds = dist, clock, me, world, [], kinds

    def __getattr__(self, name):
        return getattr(self._dist, name)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        rows = input.shape[0] if input.dim() else 1
        splits = list(input_split_sizes) if input_split_sizes is not None else [rows // self.world] * self.world
        row_bytes = (input.numel() // rows if rows else 0) * input.element_size()
        peer_rows = sum(splits) - splits[self.me]
        a = self.clock.mark()
        work = self._dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group,
                                            async_op=async_op)
        b = self.clock.mark()
        kind = self.kinds[len(self.calls) % len(self.kinds)]
        call = dict(kind=kind, a=a, b=b, peer_rows=peer_rows, peer_bytes=peer_rows * row_bytes)
        if kind == "meta" and input_split_sizes is None:  # static: a used row's metadata is >= 0
            used = (input.view(self.world, -1) >= 0).sum(1)
            call["used_peer_rows"] = used.sum() - used[self.me]
        self.calls.append(call)
        return work


def measure_bandwidth(device: str, mib: int, reps: int, clock: Clock) -> dict:
    """all_to_all_single of `mib` MiB split evenly: each rank sends half to its peer (2 ranks)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    n = mib << 20
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    times = []
    for i in range(2 + reps):
        dist.barrier()
        if clock.cuda:
            torch.cuda.synchronize()
        a = clock.mark()
        dist.all_to_all_single(dst, src)
        b = clock.mark()
        if clock.cuda:
            torch.cuda.synchronize()
        if i >= 2:
            times.append(clock.ms(a, b))
    peer_bytes = n - n // world
    med = statistics.median(times)
    return dict(buffer_bytes=n, peer_bytes=peer_bytes, ms=med, ms_all=times, bytes_per_s=peer_bytes / (med / 1e3),
                collective="all_to_all_single, even split")


def decode(model, states, warmup: int, steps: int, gen, clock: Clock, timer: TimedDist | None = None) -> list[dict]:
    """warmup + steps decode steps (one random token per sequence); the timed steps' records."""
    from deepinfer.models import ForwardBatch

    out = []
    for s in range(warmup + steps):
        toks = token_ids(model, len(states), gen)
        batch = ForwardBatch([[t] for t in toks], states)
        if timer is not None:
            timer.calls.clear()
        a = clock.mark()
        model.forward(batch)
        b = clock.mark()
        if clock.cuda:
            torch.cuda.synchronize()
        rec = dict(step_ms=clock.ms(a, b))
        if timer is not None:
            calls = timer.calls
            static = timer.kinds == A2A_KINDS_STATIC
            rows = (sum(int(c["used_peer_rows"]) for c in calls if c["kind"] == "meta") if static else
                    sum(c["peer_rows"] for c in calls if c["kind"] == "dispatch"))
            rec.update(a2a_calls=len(calls), a2a_ms=sum(clock.ms(c["a"], c["b"]) for c in calls),
                       a2a_peer_bytes=sum(c["peer_bytes"] for c in calls), dispatched_rows_to_peer=rows,
                       a2a_ms_by_kind={k: sum(clock.ms(c["a"], c["b"]) for c in calls if c["kind"] == k)
                                       for k in timer.kinds})
        if s >= warmup:
            out.append(rec)
    return out


def run_variant(name: str, model, a, rank: int, clock: Clock, timer=None) -> dict:
    from deepinfer.kernels.registry import kernel_stats

    gen = torch.Generator().manual_seed(1000 + 17 * rank)
    fill_gen = torch.Generator(model.device).manual_seed(rank)
    blocks = decode_blocks(a.context, a.warmup + a.steps + 1)
    pools = model.allocate_cache(a.batch, a.batch * blocks, BLOCK_SIZE)
    states = filled_sequences(model, pools, a.batch, a.context, blocks, gen, fill_gen, {})
    if clock.cuda:
        torch.cuda.synchronize()
    before = kernel_stats()["fallbacks"]
    steps = decode(model, states, a.warmup, a.steps, gen, clock, timer)
    fallbacks = _fallback_delta(before, kernel_stats()["fallbacks"])
    med = statistics.median(r["step_ms"] for r in steps) if steps else float("nan")
    row = dict(variant=name, rank=rank, batch=a.batch, context=a.context, timed_steps=len(steps),
               step_ms=med, step_ms_all=[r["step_ms"] for r in steps], tok_s=a.batch / (med / 1e3),
               n_routed_experts_held=(model.expert_parallel.placement.per_rank if model.expert_parallel
                                      else model.config.n_routed_experts),
               weights_gb=held_gb(model), fallbacks=fallbacks, ops=model.ops.summary())
    if timer is not None:
        row.update(a2a_calls_per_step=[r["a2a_calls"] for r in steps],
                   a2a_ms=statistics.median(r["a2a_ms"] for r in steps),
                   a2a_ms_all=[r["a2a_ms"] for r in steps],
                   a2a_peer_bytes_per_step=statistics.median(r["a2a_peer_bytes"] for r in steps),
                   dispatched_rows_to_peer=sum(r["dispatched_rows_to_peer"] for r in steps),
                   a2a_ms_by_kind={k: statistics.median(r["a2a_ms_by_kind"][k] for r in steps)
                                   for k in timer.kinds})
    del states, pools
    return row


# ---- one rank ---------------------------------------------------------------------------------------------------
def rank_main(rank: int, world: int, port: int, a, outdir: str) -> None:
    import torch.distributed as dist

    from deepinfer.distributed import ep_dispatch
    from deepinfer.distributed import expert_parallel as ep_mod
    from deepinfer.distributed import groups
    from deepinfer.distributed.expert_parallel import ExpertParallel
    from deepinfer.distributed.placement import ExpertPlacement

    cuda = a.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    else:
        from deepinfer.config.hardware import set_cpu_threads

        set_cpu_threads(max(1, a.threads))
        device = "cpu"
    clock = Clock(cuda)
    result = dict(rank=rank, device=torch.cuda.get_device_name(rank) if cuda else "cpu", rows=[])
    path = Path(outdir) / f"rank{rank}.json"
    groups.init_group(rank, world, f"tcp://127.0.0.1:{port}", device, timeout_s=a.timeout)
    try:
        result["bandwidth"] = measure_bandwidth(device, a.bw_mib, a.bw_reps, clock)
        if rank == 0 and cuda:  # the roofline's rates; on the CPU there is no meaningful floor to report
            result["ceilings"] = ceilings(device, None)
        full = model_config(a.model).n_routed_experts
        if full % world:
            raise ValueError(f"{full} routed experts do not split over {world} ranks")
        t0 = time.time()
        model = build_model(a.model, device, full // world)
        result["single_build_s"] = time.time() - t0
        result["rows"].append(run_variant("single", model, a, rank, clock))
        del model
        if cuda:
            torch.cuda.empty_cache()
        dist.barrier()
        t0 = time.time()
        placement = ExpertPlacement.initial(full, world, 0)
        ep = ExpertParallel(placement, rank, None)
        model = build_model(a.model, device, None, ep)
        if a.dispatch == "static":  # buffers for this rank's decode steps; the agreement on a gloo group
            agree = dist.new_group(backend="gloo") if cuda else None
            ep.plan_static(a.batch, model.config.num_experts_per_tok, model.config.hidden_size, model.dtype,
                           device, agree)
        result["dep2_build_s"] = time.time() - t0
        timer = TimedDist(clock, rank, world, A2A_KINDS_STATIC if a.dispatch == "static" else A2A_KINDS)
        saved = ep_mod.dist, ep_dispatch.dist
        ep_mod.dist = ep_dispatch.dist = timer
        try:
            result["rows"].append(run_variant(f"dep{world}", model, a, rank, clock, timer))
        finally:
            ep_mod.dist, ep_dispatch.dist = saved
        del model
        dist.barrier()
    except BaseException:
        result["error"] = traceback.format_exc()
        raise
    finally:
        path.write_text(json.dumps(result, default=str))
        groups.destroy()


# ---- main -------------------------------------------------------------------------------------------------------
def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--model", choices=("flash", "tiny"), default="flash",
                    help="flash: synthetic.FLASH_REDUCED (6 layers, 384 experts); tiny: embedded:tiny-random's config")
    ap.add_argument("--batch", type=int, default=64, help="decode sequences per rank")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--world", type=int, default=2, help="ranks (the target is for 2)")
    ap.add_argument("--dispatch", choices=("static", "variable"), default="static",
                    help="dep2's decode steps: static-capacity buffers (what graphs capture) or the variable path")
    ap.add_argument("--bw-mib", type=int, default=None, help="bandwidth buffer (default 1024 on CUDA, 16 on the CPU)")
    ap.add_argument("--bw-reps", type=int, default=5)
    ap.add_argument("--redundant", type=int, default=None, help="EPLB report's redundant slots (default E // 12, >= 2)")
    ap.add_argument("--eplb-steps", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank on the CPU")
    ap.add_argument("--timeout", type=float, default=600.0, help="collective timeout, s")
    ap.add_argument("--out", default="benchmarks/results/parallel_gpu.json")
    a = ap.parse_args(argv)
    if a.bw_mib is None:
        a.bw_mib = 1024 if a.device == "cuda" else 16
    return a


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def targets(summary: dict, batch: int, world: int) -> list[dict]:
    """Issue 13's one bound, when this run has its shape (2 ranks, batch 64 per rank): dep2 decode tok/s per rank
    over single's. The issue asks the all-to-all time and EPLB's imbalance reported, not bounded (summary, eplb)."""
    if "ratio" not in summary or (world, batch) != (2, 64):
        return []
    return [dict(name=f"dep2 decode tok/s per rank at batch {batch}, % of single on the same per-rank slice",
                 measured=round(summary["ratio"] * 100, 1), target=TARGET_RATIO * 100, unit="%",
                 met=summary["ratio"] >= TARGET_RATIO)]


def main(argv=None) -> int:
    import torch.multiprocessing as mp

    from deepinfer.distributed.eplb_runtime import skewed_imbalance_report

    a = parse(argv)
    t_start = time.time()
    cuda = a.device == "cuda"
    if cuda and torch.cuda.device_count() < a.world:
        print(f"FAILED: {a.world} ranks need {a.world} GPUs; this machine has {torch.cuda.device_count()}",
              file=sys.stderr)
        return 1
    cfg = model_config(a.model)
    E = cfg.n_routed_experts
    redundant = a.redundant if a.redundant is not None else max(2, E // 12)
    eplb = skewed_imbalance_report(num_experts=E, num_ranks=a.world, redundant_experts=redundant,
                                   top_k=cfg.num_experts_per_tok, tokens_per_rank=a.batch, steps=a.eplb_steps,
                                   layers=min(4, cfg.num_hidden_layers))
    print(eplb["log_line"], flush=True)

    failures: list[str] = []
    ranks: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="parallel_gpu_") as tmp:
        try:
            mp.start_processes(rank_main, args=(a.world, free_port(), a, tmp), nprocs=a.world, join=True,
                               start_method="spawn")
        except Exception as exc:  # a rank raised or died: its traceback is in its JSON, or in stderr above
            failures.append(f"a rank failed: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}")
        for r in range(a.world):
            p = Path(tmp) / f"rank{r}.json"
            if not p.is_file():
                failures.append(f"rank {r} wrote no result")
                continue
            ranks.append(json.loads(p.read_text()))
    for r in ranks:
        if "error" in r:
            failures.append(f"rank {r['rank']}: {r['error'].strip().splitlines()[-1]}")

    ep_name = f"dep{a.world}"
    rows = [row for r in ranks for row in r["rows"]]
    by = {v: [row for row in rows if row["variant"] == v] for v in ("single", ep_name)}
    for row in rows:
        name = f"{row['variant']} rank {row['rank']}"
        if row["timed_steps"] < a.steps:
            failures.append(f"{name}: {row['timed_steps']} timed steps, wanted {a.steps}")
        if cuda:
            strict = {k: v for k, v in row["fallbacks"].items() if k in STRICT_KINDS}
            if strict:
                failures.append(f"{name}: per-call fallbacks to torch in a TileLang run: {strict}")
        if row["variant"] == ep_name:
            calls = row["a2a_calls_per_step"]
            per_layer = len(A2A_KINDS_STATIC if a.dispatch == "static" else A2A_KINDS)
            if not calls or min(calls) == 0 or any(c % per_layer for c in calls):
                failures.append(f"{name}: expert-parallel all-to-all calls per step {calls} (want {per_layer} per "
                                "MoE layer)")
            if row["dispatched_rows_to_peer"] <= 0:
                failures.append(f"{name}: EP sent no token rows to the other rank in {row['timed_steps']} steps")
    for v in ("single", ep_name):
        if len(by[v]) != a.world and not any("rank" in f for f in failures):
            failures.append(f"{v}: {len(by[v])} rank rows, wanted {a.world}")

    summary: dict = dict(target=f"{ep_name} decode tok/s per rank >= {TARGET_RATIO:.0%} of single on the same "
                                f"per-rank slice (batch {a.batch}, context {a.context})")
    bw_rows = [r["bandwidth"] for r in ranks if "bandwidth" in r]
    if bw_rows:
        summary["bandwidth_bytes_per_s"] = min(b["bytes_per_s"] for b in bw_rows)
    if by["single"] and by[ep_name]:
        single = statistics.mean(r["tok_s"] for r in by["single"])
        dep = statistics.mean(r["tok_s"] for r in by[ep_name])
        ratio = dep / single
        summary.update(single_tok_s_per_rank=single, dep_tok_s_per_rank=dep, ratio=ratio,
                       single_step_ms=statistics.mean(r["step_ms"] for r in by["single"]),
                       dep_step_ms=statistics.mean(r["step_ms"] for r in by[ep_name]),
                       target_met=ratio >= TARGET_RATIO,
                       a2a_ms_per_step=statistics.mean(r["a2a_ms"] for r in by[ep_name]),
                       a2a_peer_bytes_per_step=statistics.mean(r["a2a_peer_bytes_per_step"] for r in by[ep_name]),
                       dispatched_rows_to_peer=sum(r["dispatched_rows_to_peer"] for r in by[ep_name]),
                       a2a_calls_per_step=by[ep_name][0]["a2a_calls_per_step"][0] if by[ep_name][0][
                           "a2a_calls_per_step"] else 0)
        summary["a2a_share_of_step"] = summary["a2a_ms_per_step"] / summary["dep_step_ms"]
        if summary.get("bandwidth_bytes_per_s") and summary["a2a_ms_per_step"] > 0:  # none with one rank
            floor = summary["a2a_peer_bytes_per_step"] / summary["bandwidth_bytes_per_s"] * 1e3
            summary.update(a2a_floor_ms=floor, a2a_pct_of_bandwidth=floor / summary["a2a_ms_per_step"] * 100)
        ceil = next((r["ceilings"] for r in ranks if "ceilings" in r), None)
        if ceil:
            roofline = load_roofline()
            c = roofline_config(roofline, model_config(a.model, E // a.world))
            roof = step_roofline(roofline, c, ceil[0], ceil[1], a.batch, a.context)
            summary.update(slice_floor_ms=roof["floor_ms"],
                           single_pct_roofline=roof["floor_ms"] / summary["single_step_ms"] * 100,
                           dep_pct_roofline=roof["floor_ms"] / summary["dep_step_ms"] * 100)

    meta = dict(device=a.device, gpu=ranks[0]["device"] if ranks else None, torch=torch.__version__, model=a.model,
                world=a.world, batch_per_rank=a.batch, context=a.context, steps=a.steps, warmup=a.warmup,
                n_routed_experts=E, top_k=cfg.num_experts_per_tok, layers=cfg.num_hidden_layers,
                backend="nccl" if cuda else "gloo", cmd=" ".join(sys.argv), host=platform.node(),
                time=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), note=FILLED_NOTE,
                dep2_moe_path=f"deepinfer.distributed.expert_parallel.ep_moe_experts, {a.dispatch} dispatch, the "
                              "received rows through model.ops.moe_experts (TileLang grouped GEMM on CUDA), eager",
                single_moe_path="model.ops.moe_experts (TileLang grouped GEMM on CUDA), eager",
                wall_s=time.time() - t_start)
    out = dict(meta=meta, targets=on_card(targets(summary, a.batch, a.world), str(meta["gpu"])), summary=summary,
               eplb=eplb, bandwidth=[r.get("bandwidth") for r in ranks], rows=rows,
               failures=failures)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        f.write(portable_json(out))
    print(report(out), flush=True)
    print("wrote", a.out, flush=True)
    if failures:
        print("\nFAILED: these variants did not run as asked:\n  " + "\n  ".join(failures), file=sys.stderr, flush=True)
        return 1
    return 0


def report(out) -> str:
    m, s, e = out["meta"], out["summary"], out["eplb"]
    lines = [f"\n{m['gpu']} x {m['world']} ({m['backend']}), model {m['model']} ({m['layers']} layers, "
             f"{m['n_routed_experts']} experts top-{m['top_k']}), batch {m['batch_per_rank']} per rank, context "
             f"{m['context']} ({FILLED_NOTE}); eager model.forward steps"]
    for r in out["rows"]:
        extra = ""
        if "a2a_ms" in r:
            extra = (f" | all-to-all {r['a2a_ms']:8.3f} ms/step ({r['a2a_calls_per_step'][0] if r['a2a_calls_per_step'] else 0}"
                     f" calls, {r['a2a_peer_bytes_per_step'] / 1e6:.3f} MB to the peer)")
        lines.append(f"  {r['variant']:6s} rank {r['rank']}: step {r['step_ms']:9.3f} ms | {r['tok_s']:10.1f} tok/s | "
                     f"{r['n_routed_experts_held']} experts/layer, weights {r['weights_gb']:.3f} GB{extra}")
    if s.get("bandwidth_bytes_per_s"):
        lines.append(f"  rank-to-rank bandwidth (all_to_all_single, {out['bandwidth'][0]['buffer_bytes'] >> 20} MiB): "
                     f"{s['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s per direction")
    if "ratio" in s:
        lines.append(f"  all-to-all per step: {s['a2a_ms_per_step']:.3f} ms ({s['a2a_share_of_step'] * 100:.1f}% of the "
                     f"dep step); its bytes at the measured bandwidth: {s.get('a2a_floor_ms', float('nan')):.4f} ms "
                     f"({s.get('a2a_pct_of_bandwidth', float('nan')):.2f}% of the link's rate)")
        if "slice_floor_ms" in s:
            lines.append(f"  slice roofline {s['slice_floor_ms']:.3f} ms: single {s['single_pct_roofline']:.1f}%, "
                         f"dep {s['dep_pct_roofline']:.1f}%")
        lines.append(f"  TARGET {s['target']}: {s['dep_tok_s_per_rank']:.1f} / {s['single_tok_s_per_rank']:.1f} = "
                     f"{s['ratio'] * 100:.1f}% -> {'pass' if s['target_met'] else 'MISS'}")
    lines.append(f"  EPLB (skewed synthetic routing): imbalance {e['policy_before']:.3f} -> {e['policy_after']:.3f} "
                 f"(policy), {e['dispatched_before']:.3f} -> {e['dispatched_after']:.3f} (as dispatched)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
