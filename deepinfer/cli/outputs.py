"""Where the CLI writes a job's outputs (output_file, one JSON line per request, in the run directory)."""

from __future__ import annotations

import json
from pathlib import Path

from deepinfer.cli.checks import check_writable_dir
from deepinfer.config.errors import ConfigError


def output_path(settings, run_dir: Path) -> Path:
    """Where outputs go, checked writable before any work (a bad path used to surface after generating)."""
    out_path = run_dir / settings.output_file
    check_writable_dir(out_path.parent, "output_file")
    if out_path.is_dir():
        raise ConfigError(f"output_file={settings.output_file!r} is a directory; allowed: a file path")
    return out_path


def write_outputs(out_path: Path, outputs) -> None:
    with out_path.open("w") as f:
        for o in outputs:
            f.write(json.dumps(o.to_json()) + "\n")
