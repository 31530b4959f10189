"""`python -m deepinfer [overrides]`: run the configured model on prompts and report.

    python -m deepinfer                                   # the embedded tiny model on the CPU, built-in prompts
    python -m deepinfer prompts='["def f(", "import os"]' sampling.max_tokens=64
    python -m deepinfer input_path=prompts.jsonl          # one {"prompt": ...} or {"prompt_token_ids": [...]} a line,
                                                         # plus any SamplingParams field ({"prompt": "x", "max_tokens": 8})
    python -m deepinfer --multirun sampling.temperature=0,0.7
    python -m deepinfer --cfg job                         # the effective config (--resolve is implied)

Hydra (`hydra.main`) composes each job's config; DeepInfer composes nothing of its own. Before a run, or before
the first job of a sweep, the Preflight callback (deepinfer/config/hydra_callbacks.py) resolves every job (types,
ranges, hardware, memory) and checks its inputs, so a user error costs one line on stderr and exit code 2, never a
traceback, and nothing has run. `--cfg job` only composes and prints: no hardware is needed to read a recipe.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

EXIT_USER_ERROR = 2
BUILTIN_PROMPTS = (
    "def fibonacci(n):",
    "import os\nimport sys\n\n",
    "class Config:\n    def __init__(self",
    "The quick brown fox",
)


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "the input is wrong", reported in one line (anything else is a bug: traceback)."""
    from deepinfer.config.errors import ConfigError
    from deepinfer.kernels.registry import BackendError
    from deepinfer.models.config import ModelConfigError
    from deepinfer.models.loading.errors import CheckpointError

    from deepinfer.engine import EngineDeadError

    return (ConfigError, CheckpointError, ModelConfigError, BackendError, FileNotFoundError, EngineDeadError)


EXIT_INTERRUPTED = 130  # the shell's code for a run ended by SIGINT


class Interrupted(Exception):
    """Ctrl-C during a job: the message says what was kept."""


def _fail(exc: BaseException) -> int:
    from deepinfer.engine import EngineDeadError

    text = str(exc)
    if isinstance(exc, EngineDeadError):  # its message may carry the core's traceback: the first line says what
        text = text.splitlines()[0] if text.strip() else "the engine core died"
    print(f"deepinfer: error: {' '.join(text.split())}", file=sys.stderr)
    return EXIT_USER_ERROR


def _interrupted(message: str = "interrupted") -> int:
    print(f"deepinfer: {message}", file=sys.stderr)
    return EXIT_INTERRUPTED


# ---- checks made before a job runs (called by the Preflight callback) ---------------------------------------
def check_inputs(settings) -> None:
    from deepinfer.config.errors import ConfigError

    if settings.prompts is not None and settings.input_path is not None:
        raise ConfigError("prompts and input_path are both set; allowed: one of them")
    if settings.prompts is not None and len(settings.prompts) == 0:
        raise ConfigError("prompts=[] is empty; allowed: a non-empty list of prompts, or null for the built-in ones")
    if settings.input_path is not None and not Path(settings.input_path).is_file():
        raise ConfigError(f"input_path={settings.input_path!r} is not a file")
    read_requests(settings)  # a malformed line fails here, before any model loads
    if Path(settings.output_file).is_absolute():  # a relative one lands in the run directory, checked below
        check_writable_dir(Path(settings.output_file).parent, "output_file")


def check_writable_dir(path: Path, key: str) -> None:
    """The directory exists (or can be made) and takes files: found before any work, not after generating."""
    from deepinfer.config.errors import ConfigError

    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".deepinfer-write-check"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"{key}={str(path)!r} is not a writable directory ({exc.strerror or exc})") from None


def check_run_dir(argv_overrides: list[str]) -> None:
    """hydra.run.dir / hydra.sweep.dir given on the command line (Hydra itself makes them, with a traceback on
    failure); without one, Hydra writes under the current directory."""
    given = {k: v for k, _, v in (o.partition("=") for o in argv_overrides) if k in ("hydra.run.dir", "hydra.sweep.dir")}
    for key, value in given.items():
        if "${" not in value:  # an interpolation (e.g. ${now:...}) is Hydra's to expand
            check_writable_dir(Path(value), key)
    if not given:
        check_writable_dir(Path.cwd() / "outputs", "hydra.run.dir (default: ./outputs)")


def follower_rank(settings) -> bool:
    """Whether this process is a torchrun rank other than 0 (checked: a WORLD_SIZE other than the layout's ranks
    is a one-line ConfigError)."""
    if settings.parallel.world_size == 1 and "WORLD_SIZE" not in os.environ:
        return False  # the common case: no torch.distributed import
    from deepinfer.distributed.world import check_launch

    launched = check_launch(settings.parallel)
    return launched is not None and launched[0] != 0


# ---- one Hydra job -------------------------------------------------------------------------------------------
def read_requests(settings) -> list[dict]:
    """[{"prompt": str} | {"prompt_token_ids": [...]}] from input_path, prompts= or the built-in prompts."""
    from deepinfer.config.errors import ConfigError

    if settings.input_path is None:
        return [{"prompt": p} for p in (settings.prompts or BUILTIN_PROMPTS)]
    where = f"input_path={settings.input_path!r}"
    raw = Path(settings.input_path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{where} line {line}: not UTF-8 text (byte {exc.start}); allowed: UTF-8 JSON lines") from None
    requests = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as exc:
            why = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
            raise ConfigError(f"{where} line {n}: not JSON ({why})") from None
        if isinstance(item, str):
            item = {"prompt": item}
        error = _request_error(item)
        if error is not None:
            raise ConfigError(
                f"{where} line {n}: {error}; allowed: a string, "
                '{"prompt": "..."} or {"prompt_token_ids": [int, ...]}'
            )
        requests.append(item)
    if not requests:
        raise ConfigError(f"{where} has no requests; allowed: at least one line")
    return requests


def _request_error(item) -> str | None:
    if not isinstance(item, dict) or not ({"prompt", "prompt_token_ids"} & set(item)):
        return f"{type(item).__name__ if not isinstance(item, dict) else 'an object without prompt'} is not a request"
    if "prompt_token_ids" in item:
        ids = item["prompt_token_ids"]
        if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
            return f"prompt_token_ids={json.dumps(ids)[:60]} is not a non-empty list of token ids >= 0"
    elif not isinstance(item["prompt"], str):
        return f"prompt={json.dumps(item['prompt'])[:60]} is not a string"
    return None


REQUEST_KEYS = ("prompt", "prompt_token_ids")


def request_params(llm, item: dict):
    """(SamplingParams, None) for one input line: the config's sampling section, then the line's own
    SamplingParams fields (any of them, so_args included); or (None, one-line error) for an unknown field or a
    bad value, which ends that line's request only."""
    import dataclasses

    from deepinfer.sampling.params import params_from_dict

    fields = {k: v for k, v in item.items() if k not in REQUEST_KEYS}
    if not fields:
        return llm.default_sampling_params(), None
    base = llm.default_sampling_params()
    return params_from_dict({**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}, **fields})


def generate_requests(llm, requests: list[dict]) -> list:
    """One output per request, in order; a line whose settings cannot apply gets an error output of its own."""
    from deepinfer.outputs import error_output

    outputs: list = [None] * len(requests)
    run, params = [], []
    for i, item in enumerate(requests):
        sp, error = request_params(llm, item)
        if error is not None:
            ids = item.get("prompt_token_ids") or []
            outputs[i] = error_output(i, item.get("prompt"), ids, f"request {i}: {error}")
        else:
            run.append(i)
            params.append(sp)
    if run:
        done = llm.generate([{k: requests[i][k] for k in REQUEST_KEYS if k in requests[i]} for i in run], params,
                            use_tqdm=False)
        for i, out in zip(run, done):
            outputs[i] = out
    return outputs


def output_path(settings, run_dir: Path) -> Path:
    """Where outputs go, checked writable before any work (a bad path used to surface after generating)."""
    from deepinfer.config.errors import ConfigError

    out_path = run_dir / settings.output_file
    check_writable_dir(out_path.parent, "output_file")
    if out_path.is_dir():
        raise ConfigError(f"output_file={settings.output_file!r} is a directory; allowed: a file path")
    return out_path


def write_outputs(out_path: Path, outputs) -> None:
    with out_path.open("w") as f:
        for o in outputs:
            f.write(json.dumps(o.to_json()) + "\n")


def run_job(settings, run_dir: Path, overrides: list[str]) -> dict:
    from deepinfer.api import LLM
    from deepinfer.engine import EngineDeadError

    out_path = output_path(settings, run_dir)
    requests = read_requests(settings)
    t0 = time.perf_counter()
    llm = LLM.from_settings(settings)
    try:
        load_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        try:
            outputs = generate_requests(llm, requests)
        except KeyboardInterrupt as exc:
            finished = getattr(exc, "finished_outputs", [])
            write_outputs(out_path, finished)
            raise Interrupted(f"interrupted; {len(finished)} of {len(requests)} requests had finished, their "
                              f"outputs are in {out_path}") from None
        except EngineDeadError as exc:  # e.g. a data-parallel rank died: every request, unfinished ones as errors
            write_outputs(out_path, getattr(exc, "outputs", []))
            raise
        gen_s = time.perf_counter() - t1
        write_outputs(out_path, outputs)
        for o in outputs:
            shown = o.prompt if o.prompt is not None else f"<{len(o.prompt_token_ids)} token ids>"
            result = o.text if o.finish_reason != "error" else f"<error: {o.error}>"
            print(f"[{o.request_id}] {shown!r} -> {result!r} ({o.finish_reason})")
        summary = make_summary(llm, outputs, load_s, gen_s, overrides, out_path)
        print_summary(summary)
        (run_dir / "result.json").write_text(json.dumps(summary, indent=2) + "\n")
    finally:
        llm.close()  # bounded: the engine core is killed if it does not stop within seconds
    return summary


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
        "replay_rows_saved": (llm.last_metrics or {}).get("replay_rows_saved"),
    }


def _layout(p) -> str:
    if p.world_size == 1:
        return p.name
    return (f"{p.name}: {p.world_size} ranks (data {p.data_parallel_size} x expert {p.expert_parallel_size} x "
            f"context {p.context_parallel_size})")


def print_summary(s: dict) -> None:
    from deepinfer.engine.metrics import kernel_lines, speculative_line

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
    lines += speculative_line(s.get("speculative"))
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
    for k, v in lines:
        print(f"{k:<10}{v}")


def _hydra_task(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig

    from deepinfer.config.hydra_callbacks import resolved_settings
    from deepinfer.config.resolve import resolve

    try:
        hc = HydraConfig.get()
        settings = resolved_settings(hc.overrides.task)  # resolved by the Preflight callback before the run
        if settings is None:  # a job Preflight did not see (its callback removed, or beyond a sweep's first 64)
            settings = resolve(cfg)
            check_inputs(settings)
        if follower_rank(settings):  # torchrun: ranks other than 0 run no frontend, they follow rank 0's steps
            from deepinfer.engine.core_process import run_rank_or_exit

            return run_rank_or_exit(settings)
        if settings.serve.name != "offline":  # serve=openai: the HTTP server, until SIGTERM / Ctrl-C
            from deepinfer.serving import serve

            return serve(settings)
        run_job(settings, Path(hc.runtime.output_dir), list(hc.overrides.task))
    except _user_errors() as exc:
        raise SystemExit(_fail(exc))
    except Interrupted as exc:
        raise SystemExit(_interrupted(str(exc)))
    except KeyboardInterrupt:
        raise SystemExit(_interrupted())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    except KeyboardInterrupt:
        return _interrupted()


def _main(argv: list[str]) -> int:
    import hydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from deepinfer.config.compose import check_group_env  # importing it registers the schema and the recipes
    from deepinfer.config.errors import explain
    from deepinfer.config.hydra_callbacks import PreflightFailed

    try:
        check_group_env()  # DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE picks a group option: named if it is not one
    except _user_errors() as exc:
        return _fail(exc)
    if any(a in ("--cfg", "-c") or a.startswith("--cfg=") for a in argv) and "--resolve" not in argv:
        argv.append("--resolve")  # show effective values: env variables are read through interpolations
    app = hydra.main(config_path="pkg://deepinfer.conf", config_name="config", version_base=None)(_hydra_task)
    saved_argv, saved_full_error = sys.argv, os.environ.get("HYDRA_FULL_ERROR")
    sys.argv = [saved_argv[0] if saved_argv else "deepinfer", *argv]
    # Hydra's documented switch: its errors (a composition error above all) reach us as exceptions instead of
    # being printed over several lines with exit code 1; they are reworded below into one line and exit code 2.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        app()
    except PreflightFailed as stop:  # a job's config or inputs, checked before anything ran
        if isinstance(stop.error, _user_errors()):
            return _fail(stop.error)
        raise stop.error
    except (HydraException, OmegaConfBaseException) as exc:  # composing the config (or showing it: --cfg)
        return _fail(explain(exc, argv))
    except _user_errors() as exc:
        return _fail(exc)
    finally:
        sys.argv = saved_argv
        if saved_full_error is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = saved_full_error
    return 0


if __name__ == "__main__":
    sys.exit(main())
