"""benchmarks/device/*.sh, the device calls: each parses as bash, and every benchmark it runs exists and takes the
flags it is given (a stale flag would cost a device call)."""

import importlib
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks" / "device").glob("*.sh"))


def test_there_are_device_scripts():
    assert {p.name for p in SCRIPTS} >= {"kernels.sh", "decode40.sh", "prefill40.sh"}


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_device_script_parses(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_benchmark_a_device_script_runs_takes_its_flags(script):
    text = script.read_text().replace("\\\n", " ")
    runs = 0
    for line in text.splitlines():
        found = re.findall(r"benchmarks/(\w+)\.py", line)
        if not found or line.lstrip().startswith("#"):
            continue
        target = ROOT / "benchmarks" / f"{found[-1]}.py"  # the last one named is the one run (after with_attrs.py)
        assert target.exists(), f"{script.name}: {target.name} does not exist"
        src = target.read_text()
        args = line.split(f"benchmarks/{found[-1]}.py", 1)[1]
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*", args.split("|")[0]):
            assert f'"{flag}"' in src, f"{script.name}: {target.name} has no option {flag}"
        runs += 1
    assert runs


@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="the kernel modules need tilelang")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_module_constant_a_device_script_overrides_exists(script):
    """with_attrs.py arms name module constants (deepinfer.....NAME, or $VAR.NAME for VAR=deepinfer....): a stale
    one would cost a device call."""
    text = script.read_text()
    for var, module in re.findall(r"^\s*(\w+)=(deepinfer[\w.]*\w)\s*$", text, flags=re.M):
        text = re.sub(r"\$\{?" + var + r"\b\}?", module, text)
    names = set(re.findall(r"(deepinfer(?:\.\w+)+)\.([A-Z][A-Z0-9_]*)\b", text))
    for module, name in sorted(names):
        assert hasattr(importlib.import_module(module), name), f"{script.name}: {module}.{name} does not exist"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_step_of_a_device_script_is_checked_and_the_call_ends_with_the_failures(script):
    """A step cut by its timeout printed nothing and the call still said 'done' (prefill40.sh's kernel step, session
    34): each `timeout` pipeline is followed by `check NAME`, and the script ends with `finish NAME`."""
    text = script.read_text()
    assert "source benchmarks/device_steps.sh" in text
    lines = [ln.strip() for ln in text.replace("\\\n", " ").splitlines()]
    steps = [i for i, ln in enumerate(lines) if "timeout " in ln and not ln.startswith("#")]
    assert steps
    for i in steps:
        assert re.match(r"check \S", lines[i + 1]), f"{script.name}: a step without `check`: {lines[i][:80]}"
    assert text.rstrip().splitlines()[-1] == f"finish {script.name}"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_failed_or_timed_out_step_is_named_and_the_call_exits_nonzero():
    steps = ROOT / "benchmarks" / "device_steps.sh"
    run = lambda body: subprocess.run(["bash", "-c", f"source {steps}\n{body}"],  # noqa: E731
                                      capture_output=True, text=True)
    ok = run("echo hi | tail -1; check first\n[ 1 = 1 ] || false | tail -1; check skipped\nfinish x.sh")
    assert ok.returncode == 0 and "STEP FAILED" not in ok.stdout and "x.sh done in" in ok.stdout
    bad = run("bash -c 'exit 124' | grep . | tail -1; check slow\nfalse | cat; check broken\necho after\nfinish x.sh")
    assert bad.returncode == 1
    lines = bad.stdout.splitlines()
    assert "STEP FAILED: slow (timed out)" in lines and "STEP FAILED: broken (exit 1)" in lines
    assert "after" in lines and lines[-2:] == ["STEP FAILED: slow (timed out)", "STEP FAILED: broken (exit 1)"]
