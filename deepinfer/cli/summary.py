"""The run summary of one CLI job: result.json (read by the sweep summary) and the lines printed after it."""

from __future__ import annotations

from pathlib import Path


def make_summary(llm, outputs, load_s: float, gen_s: float, overrides: list[str], out_path: Path) -> dict:
    s, prog = llm.settings, llm.program.summary()
    generated = sum(len(o.token_ids) for o in outputs)
    return {
        "overrides": overrides,
        "recipe": s.recipe,
        "model": s.model.path,
        "dtype": s.model.dtype,
        "hardware": s.hardware.name,
        "device": s.hardware.device,
        "parallel": _layout(s.parallel),
        "stages": prog["stages"],
        "ops": prog["ops"],
        "fallbacks": prog["fallbacks"],
        "requests": len(outputs),
        "errors": sum(o.finish_reason == "error" for o in outputs),
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
        "generated_tokens": generated,
        "load_s": round(load_s, 3),
        "generate_s": round(gen_s, 3),
        "tokens_per_s": round(generated / gen_s, 2) if gen_s > 0 else None,
        "first_text": outputs[0].text if outputs else "",
        "outputs": str(out_path),
        # the engine process's counters: per-call fallbacks to torch, JIT compiles; decode steps graph-replayed
        "kernels": (llm.last_metrics or {}).get("kernels"),
        "steps": (llm.last_metrics or {}).get("steps"),
        "graph_steps": (llm.last_metrics or {}).get("graph_steps"),
        "draft_graph_steps": (llm.last_metrics or {}).get("draft_graph_steps"),
        "speculative": (llm.last_metrics or {}).get("speculative"),
        "prefix_cache": (llm.last_metrics or {}).get("prefix_cache"),
        "replay_rows_saved": (llm.last_metrics or {}).get("replay_rows_saved"),
    }


def _layout(p) -> str:
    if p.world_size == 1:
        return p.name
    return (f"{p.name}: {p.world_size} ranks (data {p.data_parallel_size} x expert {p.expert_parallel_size} x "
            f"context {p.context_parallel_size})")


def print_summary(s: dict) -> None:
    from deepinfer.engine.metrics import kernel_lines

    by_backend: dict[str, list[str]] = {}
    for kind, backend in s["ops"].items():
        by_backend.setdefault(backend, []).append(kind)
    backends = "; ".join(
        f"{b}: all {len(k)} op kinds" if len(by_backend) == 1 else f"{b}: {', '.join(k)}" for b, k in by_backend.items()
    )
    lines = [
        ("model", f"{s['model']} ({s['dtype']})"),
        ("hardware", f"{s['hardware']} ({s['device']})" + (f", recipe {s['recipe']}" if s["recipe"] else "")),
        *([("parallel", s["parallel"])] if s.get("parallel", "single") != "single" else []),
        ("stages", " -> ".join(f"{k}={v}" for k, v in s["stages"].items())),
        ("backends", backends),
    ]
    if s["fallbacks"]:
        lines.append(("fallbacks", "; ".join(f"{k}: {v}" for k, v in s["fallbacks"].items())))
    lines += kernel_lines(s.get("kernels"))
    if s.get("device") == "cuda" and s.get("steps"):
        drafted = f", drafting replayed one in {s['draft_graph_steps']}" if s.get("speculative") else ""
        lines.append(("graphs", f"{s.get('graph_steps') or 0} of {s['steps']} steps replayed a CUDA graph{drafted}"))
    if s.get("speculative"):
        lines.append(("dspark", "{accepted_tokens}/{draft_tokens} drafts accepted ({acceptance_rate:.1%}), mean "
                                "accepted length {mean_accepted_length:.2f} tokens/step, accepted per step "
                                "{histogram}".format(**s["speculative"])))
    if s.get("prefix_cache"):
        lines.append(("prefix cache", "{hit_tokens}/{query_tokens} prompt tokens cached ({hit_rate:.1%}), "
                                      "{checkpoints} window checkpoints ({checkpoint_bytes} B), {evicted_blocks} "
                                      "blocks evicted".format(**s["prefix_cache"])))
    if "replay" in s["stages"]:  # YOCO bounded replay: what compact skipped (mask computes every row)
        lines.append(("replay", f"{s['stages']['replay']}: {s.get('replay_rows_saved') or 0} decoder-layer rows not "
                                "computed (rows x decoder layers)"))
    lines += [
        ("requests", f"{s['requests']} ({s['errors']} errors)"),
        ("tokens", f"{s['prompt_tokens']} prompt, {s['generated_tokens']} generated"),
        ("speed", f"{s['tokens_per_s']} tokens/s ({s['generate_s']} s generating, {s['load_s']} s loading)"),
        ("outputs", s["outputs"]),
    ]
    print("---- summary")
    width = max(10, max(len(k) for k, _ in lines) + 1)
    for k, v in lines:
        print(f"{k:<{width}}{v}")
