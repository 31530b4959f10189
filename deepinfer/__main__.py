"""`python -m deepinfer [overrides]`: run the configured model on prompts and report.

    python -m deepinfer                                   # the embedded tiny model on the CPU, built-in prompts
    python -m deepinfer prompts='["def f(", "import os"]' sampling.max_tokens=64
    python -m deepinfer input_path=prompts.jsonl          # one {"prompt": ...} or {"prompt_token_ids": [...]} a line,
                                                         # plus any SamplingParams field ({"prompt": "x", "max_tokens": 8})
    python -m deepinfer --multirun sampling.temperature=0,0.7
    python -m deepinfer --cfg job                         # the effective config (--resolve is implied)

Hydra (`hydra.main`) composes each job's config; DeepInfer composes nothing of its own. Before a run, or before
the first job of a sweep, the Preflight callback (deepinfer/cli/hydra_callbacks.py) resolves every job (types,
ranges, hardware, memory) and checks its inputs, so a user error costs one line on stderr and exit code 2, never a
traceback, and nothing has run. `--cfg job` only composes and prints: no hardware is needed to read a recipe.

This module is the entry point only (compose, resolve, dispatch); the CLI's parts live in deepinfer/cli/: the
requests (requests.py), the checks made before a run (checks.py), one offline job (job.py), its outputs
(outputs.py) and its summary (summary.py). Nothing imports this module.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

EXIT_ALL_FAILED = 1  # the job ran, and every request ended in an error
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # the shell's code for a run ended by SIGINT


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "the input is wrong", reported in one line (anything else is a bug: traceback)."""
    from deepinfer.config.errors import ConfigError
    from deepinfer.kernels.registry import BackendError
    from deepinfer.models.config import ModelConfigError
    from deepinfer.models.loading.errors import CheckpointError

    from deepinfer.engine import EngineDeadError

    return (ConfigError, CheckpointError, ModelConfigError, BackendError, FileNotFoundError, EngineDeadError)


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


def _hydra_task(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig

    from deepinfer.cli.checks import check_inputs
    from deepinfer.cli.job import Interrupted, follower_rank, run_job
    from deepinfer.cli.hydra_callbacks import resolved_settings
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
        summary = run_job(settings, Path(hc.runtime.output_dir), list(hc.overrides.task))
        if summary["requests"] and summary["errors"] == summary["requests"]:
            print(f"deepinfer: error: every request failed ({summary['errors']} of {summary['requests']}); their "
                  f"errors are in {summary['outputs']}", file=sys.stderr)
            raise SystemExit(EXIT_ALL_FAILED)
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
    from deepinfer.cli.hydra_callbacks import PreflightFailed

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
