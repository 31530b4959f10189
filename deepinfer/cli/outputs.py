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
    """One JSON line per output, each flushed as it is written: a full disk loses only the line being written, and
    is one line naming the file and how many outputs it holds (a ConfigError: exit 2, no traceback)."""
    written = 0
    try:
        with out_path.open("w") as f:
            for o in outputs:
                f.write(json.dumps(o.to_json()) + "\n")
                f.flush()
                written += 1
    except OSError as exc:
        raise ConfigError(f"output_file={str(out_path)!r} could not be written ({exc.strerror or exc}); "
                          f"{written} of {len(outputs)} outputs were written before it") from None
