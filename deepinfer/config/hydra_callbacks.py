"""Hydra callbacks wired in conf/config.yaml. SweepSummary: after --multirun, one table over all jobs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

COLUMNS = ("job", "overrides", "generated_tokens", "tokens_per_s", "errors", "first_text")


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
