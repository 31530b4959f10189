#!/usr/bin/env python3
"""Where a DSpark step's time goes, by phase: the engine's runner (ModelRunner.execute) with every phase bracketed
by torch.cuda.synchronize(), so each phase's wall time is its own device work plus its own host work, and what
execute spends outside the phases is host time the GPU waits for.

    source benchmarks/gpu_env.sh
    python3 benchmarks/dspark_phases.py flash40 64 2     # model, batch, drafts accepted a step (varlen, rigged)
    python3 benchmarks/dspark_phases.py flash40 1 2 --temperature 0.8 --top-p 0.9  # sampled requests

Phases: the forward (graph replay), the sampler's verification, the runner's _verify (verification plus
bookkeeping), drafting (_draft, with its graph replay). With sampled requests (--temperature) also the parts only
they take: the verification's processed weights and acceptance tests (speculative.accept_sampled_rows), and the
drafting graph's parameter fill and the draft distributions' hand-over. Same setup as dspark_gpu.py --varlen (a
filled 4K context, the drafter's own guesses, confidences 1.0 for the first j and j of them passed by the runner's
accept_override).
The synchronisations cost a little overlap, so the phases sum to about the step, not exactly to it. A diagnosis:
no targets.
"""
import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_gpu import build, make_engine  # noqa: E402
from dspark_gpu import GREEDY, forced, run  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", choices=("flash", "flash40", "tiny"))
    ap.add_argument("batch", type=int)
    ap.add_argument("accepted", type=int, help="drafts passed a verification (0..5)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--temperature", type=float, default=GREEDY["temperature"])
    ap.add_argument("--top-p", type=float, default=GREEDY["top_p"])
    a = ap.parse_args()
    if a.temperature < 0 or not 0 < a.top_p <= 1 or (a.top_p < 1 and a.temperature == 0):
        ap.error(f"--temperature {a.temperature}, --top-p {a.top_p}; allowed: temperature >= 0, 0 < top-p <= 1, "
                 "top-p < 1 only with temperature > 0")
    sampling = dict(temperature=a.temperature, top_p=a.top_p)
    from deepinfer.models import synthetic

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model = build(a.model, "cuda" if cuda else "cpu", {"default": ["tilelang-sm90", "torch"]} if cuda else ["torch"],
                  overrides=synthetic.DSPARK_FLASH)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(a.batch * 7919 + a.context)
    prompts = torch.randint(3, min(500, vocab), (a.batch, a.context), generator=g).tolist()
    engine, tap, _ = make_engine(model, fill=True, max_seqs=a.batch, context=a.context, max_tokens=60, graphs=cuda,
                                 interval=8, batched_tokens=max(a.batch * (a.context + 1), 8192), num_draft=5,
                                 seed=1, same_fill=True, varlen=True)
    runner, j = engine.client.core.runner, a.accepted
    runner.confidence_override = forced(j)
    runner.accept_override = (lambda ids, num_prompt, drafts: j) if j else None
    times = collections.defaultdict(list)

    def wrap(obj, name, label):
        inner = getattr(obj, name)

        def call(*args, **kwargs):
            sync()
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                sync()
                times[label].append(time.perf_counter() - t0)
        setattr(obj, name, call)

    try:
        run(engine, tap, prompts, 24, 2, 6, sampling)  # warm: graphs captured, the planner settled
        wrap(runner, "execute", "execute (the step)")
        if runner.graphs is not None:
            wrap(runner.graphs, "run", "  forward (graph replay)")
        wrap(runner.backend.sampler, "verify", "  sampler.verify")
        if a.temperature > 0:
            from deepinfer.sampling import sampler as sampler_module, speculative

            wrap(sampler_module, "processed_weights", "    the target's processed weights")
            wrap(speculative, "accept_sampled_rows", "    accept_sampled_rows")
        wrap(runner, "_verify", "  _verify (incl. sampler.verify)")
        wrap(runner, "_draft", "  _draft")
        if runner.draft_graphs is not None:
            wrap(runner.draft_graphs, "run", "    drafting (graph replay)")
            if runner.draft_graphs.static is not None:  # made by the first sampled batch
                wrap(runner.draft_graphs.static, "fill", "      the sampled rows' parameters (fill)")
                wrap(runner.draft_graphs.static, "hand_over", "      the draft distributions (hand_over)")
        times.clear()
        _, timed, fallbacks, _ = run(engine, tap, prompts, 24, 2, 8, sampling)
    finally:
        engine.close()
    n = len(times["execute (the step)"])
    step = statistics.median([t.device_end - t.device_start for t in timed]) * 1e3
    print(f"{a.model} B={a.batch} j={j} {'sampled' if a.temperature > 0 else 'greedy'}: {n} steps; the engine's "
          f"timed step (median) {step:.2f} ms; "
          f"fallbacks {fallbacks or 'none'}")
    for label, v in times.items():
        print(f"  {label:<44} calls {len(v):3d}  median {statistics.median(v) * 1e3:8.2f} ms")
    return 1 if fallbacks else 0


if __name__ == "__main__":
    sys.exit(main())
