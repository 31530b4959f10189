"""The CLI's checks of a job's inputs and directories, made before anything runs (the Preflight callback,
deepinfer/cli/hydra_callbacks.py, calls them for every job): a user error is one ConfigError line."""

from __future__ import annotations

from pathlib import Path

from deepinfer.cli.requests import read_requests
from deepinfer.config.errors import ConfigError


def check_inputs(settings) -> None:
    """prompts / input_path / output_file of resolved settings: each request line parsed, the output directory
    writable (a relative output_file is checked in the run directory, cli/outputs.py)."""
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
