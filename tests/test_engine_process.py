"""The engine core in its own process: private ipc sockets, a clear error when it dies, no process left behind."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from deepinfer.engine import EngineDeadError
from deepinfer.frontend import LLMEngine
from deepinfer.engine.ipc import PrivateEndpoints
from deepinfer.sampling import SamplingParams
from options_helpers import settings_for

MODEL = str(Path(__file__).parent / "fixtures" / "deepseek_v41" / "tiny-swa-csa2")


def subprocess_engine() -> LLMEngine:
    return LLMEngine.for_settings(settings_for(MODEL, process="subprocess", memory_budget=1 << 22))


def gone(pid: int) -> bool:
    """No such process, or only a zombie waiting for a reaper that is not us."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_socket_endpoints_live_in_a_fresh_directory_only_this_user_can_enter():
    endpoints = PrivateEndpoints()
    try:
        assert stat.S_IMODE(os.stat(endpoints.dir).st_mode) == 0o700
        assert endpoints.control.startswith(f"ipc://{endpoints.dir}/")
        assert endpoints.heartbeat.startswith(f"ipc://{endpoints.dir}/")
    finally:
        endpoints.remove()
    assert not os.path.exists(endpoints.dir)


def test_subprocess_engine_serves_over_a_private_socket_and_cleans_up():
    cases = load_file(f"{MODEL}/cases.safetensors")
    prompts = [cases[f"case{i}.input_ids"].tolist() for i in range(3)]
    engine = subprocess_engine()
    sock_dir = engine.client._endpoints.dir
    assert engine.client._endpoints.control == f"ipc://{sock_dir}/control.sock"
    assert not os.path.exists(sock_dir), "once connected, the socket directory is gone"
    outputs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for i, out in enumerate(outputs):
        assert out.token_ids == cases[f"case{i}.greedy_ids"].tolist()
    proc = engine.client.process
    engine.close()
    assert proc.poll() is not None, "close() ends and reaps the engine process"
    assert not os.path.exists(sock_dir)


def test_killing_the_engine_process_during_generate_raises_engine_dead_and_cleans_up():
    engine = subprocess_engine()
    proc = engine.client.process
    killed_at = []

    def kill_on_first_token(index, token_ids):
        if not killed_at:
            os.kill(proc.pid, signal.SIGKILL)
            killed_at.append(time.monotonic())

    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    with pytest.raises(EngineDeadError, match="exited with code"):
        engine.generate([[0, 5, 6, 7]] * 4, params, use_tqdm=False, on_update=kill_on_first_token)
    assert killed_at and time.monotonic() - killed_at[0] < 60  # only catches a hang (quiet machine: < 1 s)
    assert proc.poll() is not None and not os.path.exists(engine.client._endpoints.dir)
    with pytest.raises(EngineDeadError):
        engine.generate([[0, 5]], params, use_tqdm=False)
    engine.close()


FRONTEND = textwrap.dedent(
    """
    import sys
    from deepinfer.api import load_settings
    from deepinfer.frontend import LLMEngine
    settings = load_settings(["hardware=cpu", f"model.path='{sys.argv[1]}'", "engine.process=subprocess",
                              "cache.memory_budget=4194304"])
    engine = LLMEngine.for_settings(settings)
    print(engine.client.process.pid, engine.client._endpoints.dir, flush=True)
    if sys.argv[2] == "hang":
        sys.stdin.read()
    """
)  # no `if __name__ == "__main__"` guard on purpose: the engine must not need one


@pytest.mark.parametrize("how", ["killed", "exits_without_close"])
def test_the_engine_process_does_not_outlive_its_frontend(how):
    mode = "hang" if how == "killed" else "exit"
    front = subprocess.Popen([sys.executable, "-c", FRONTEND, MODEL, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        first = front.stdout.readline().split()
        engine_pid, sock_dir = int(first[0]), first[1].decode()
        if how == "killed":
            front.kill()
        front.wait(timeout=30)
        assert wait_until(lambda: gone(engine_pid), timeout=60), "the engine process outlived its frontend"
        assert not os.path.exists(sock_dir), "no socket directory is left behind"
    finally:
        if front.poll() is None:
            front.kill()
            front.wait()
