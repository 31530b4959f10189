"""Hydra callbacks wired in conf/config.yaml.

Preflight: before a run (or before the first job of a --multirun), each job's config, as Hydra composed it, goes
through the resolve step (types, ranges, hardware, memory) and the CLI's input checks, so a user error stops
everything before a run directory is made or a model loads. The resolved settings are kept for the job itself
(`resolved_settings`): nothing is resolved twice. SweepSummary: after --multirun, one table over all jobs.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, open_dict, read_write

COLUMNS = ("job", "overrides", "generated_tokens", "tokens_per_s", "errors", "first_text")
MAX_CHECKED_JOBS = 64  # a sweep's first 64 jobs are checked before any runs


class PreflightFailed(BaseException):
    """A job cannot run; `error` says why. A BaseException because Hydra turns an Exception raised by a callback
    into a warning and carries on; the CLI (deepinfer/__main__.py) catches this and reports `error`."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


_RESOLVED: dict[tuple[str, ...], Any] = {}


def resolved_settings(task_overrides) -> Any:
    """The Settings Preflight resolved for the job with these task overrides (once: taken out), or None."""
    return _RESOLVED.pop(tuple(task_overrides), None)


def job_overrides(task_overrides: list[str], config_loader=None, sweeper_params=None) -> list[list[str]]:
    """The override list of each job of a sweep, as Hydra's basic sweeper expands it (its own split_arguments, its
    params first: the key under which the job finds its resolved settings); at most MAX_CHECKED_JOBS."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    arguments = [f"{k}={v}" for k, v in (sweeper_params or {}).items()] + list(task_overrides)
    parsed = OverridesParser.create(config_loader=config_loader).parse_overrides(arguments)
    jobs = [job for batch in BasicSweeper.split_arguments(parsed, MAX_CHECKED_JOBS) for job in batch]
    return jobs[:MAX_CHECKED_JOBS]


def _job_config(config: DictConfig) -> DictConfig:
    """The config a job's task function receives: without the hydra node (as Hydra's run_job makes it)."""
    cfg = copy.deepcopy(config)
    with read_write(cfg), open_dict(cfg):
        del cfg["hydra"]
    return cfg


class Preflight(Callback):
    """Resolve and check every job before anything runs (see the module docstring)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        hydra_overrides = list(config.hydra.overrides.hydra)
        self._check([(list(config.hydra.overrides.task), lambda: config)], hydra_overrides)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra.core.global_hydra import GlobalHydra

        loader = GlobalHydra.instance().config_loader()  # the app's own search path (--config-dir included)
        try:
            jobs = job_overrides(list(config.hydra.overrides.task), loader, config.hydra.sweeper.get("params"))
        except Exception as exc:
            raise PreflightFailed(_explained(exc, config.hydra.overrides.task)) from None
        # Each job composed as the sweeper will compose it (ConfigLoader.load_sweep_config)
        self._check([(job, lambda job=job: loader.load_sweep_config(config, job)) for job in jobs], None)

    @staticmethod
    def _check(jobs, hydra_overrides: list[str] | None) -> None:
        from deepinfer.cli.checks import check_inputs, check_run_dir
        from deepinfer.config import hardware
        from deepinfer.config.resolve import resolve

        found = hardware.detect()  # once for all jobs
        for overrides, composed in jobs:
            try:
                settings = resolve(_job_config(composed()), found)
                check_inputs(settings)
            except Exception as exc:
                raise PreflightFailed(_explained(exc, overrides)) from None
            _RESOLVED[tuple(overrides)] = settings
        if hydra_overrides is not None:  # a run (a sweep's directories are Hydra's to make)
            try:
                check_run_dir(hydra_overrides)
            except Exception as exc:
                raise PreflightFailed(exc) from None


def _explained(exc: BaseException, overrides) -> BaseException:
    """A Hydra/OmegaConf composition error as its one-line ConfigError; any other exception as it is."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from deepinfer.config.errors import explain

    if isinstance(exc, (HydraException, OmegaConfBaseException)):
        return explain(exc, list(overrides))
    return exc


class SweepSummary(Callback):
    """Reads each job's result.json (written by the CLI) and writes sweep_summary.md + .json in the sweep dir."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = []
        for result in sorted(sweep_dir.glob("*/result.json"), key=lambda p: _job_number(p.parent.name)):
            data = json.loads(result.read_text())
            data["job"] = result.parent.name
            rows.append(data)
        if not rows:
            return
        table = render(rows)
        (sweep_dir / "sweep_summary.md").write_text(table + "\n")
        (sweep_dir / "sweep_summary.json").write_text(json.dumps(rows, indent=2) + "\n")
        print(f"---- sweep summary ({len(rows)} jobs, {sweep_dir / 'sweep_summary.md'})")
        print(table)


def render(rows: list[dict]) -> str:
    # The overrides every job shares say nothing about the sweep: show only those that vary.
    common = set.intersection(*(set(r.get("overrides") or []) for r in rows)) if len(rows) > 1 else set()

    def cell(row, col):
        v = row.get(col)
        if col == "overrides":
            v = " ".join(o for o in v or [] if o not in common) or "(defaults)"
        if col == "first_text":
            v = repr((v or "")[:40])
        return str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r, c) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def _job_number(name: str) -> int:
    return int(name) if name.isdigit() else 1 << 30
