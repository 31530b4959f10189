"""The frontend's client for a multi-rank layout, beside the in-process and subprocess clients: start the ranks,
talk to rank 0, watch the others.

`python -m deepinfer parallel=dep2` (or `LLM(parallel="dep2")`) on one machine: the frontend picks a free TCP port
on 127.0.0.1 and starts the ranks as torchrun would, with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
MASTER_PORT in their environment: ranks 1.. as `python -m deepinfer.engine.core_process --follower` (their settings
typed on stdin), rank 0 as the usual engine-core process (deepinfer.engine.core_process), which the frontend talks to
over its private signed sockets as for one core (ProcessClient: typed messages, heartbeats, bounded waits).

Under torchrun (RANK and WORLD_SIZE already set) the ranks exist already: rank 0's frontend starts only its own
engine core, which inherits the environment and so joins as rank 0; the other torchrun processes run
deepinfer.engine.core_process.run_rank themselves.

A rank that exits ends the run: between its waits the frontend polls the ranks it started, rank 0 included, and an
exit (or rank 0's report that a collective failed) becomes one EngineDeadError naming the rank that died (one killed
by a signal before one that exited because its peer was gone) and the ranks stopped because of it; close() stops
them all, bounded.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from deepinfer.config.errors import ConfigError
from deepinfer.distributed.world import check_launch
from deepinfer.engine.client import ProcessClient
from deepinfer.engine.options import EngineOptions
from deepinfer.engine.startup import encode_rank

DEATH_WAIT_S = 1.0  # after rank 0 reports a failed collective: how long to wait for the rank that caused it to exit


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the rendezvous binds it moments later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def death_message(exited: list[tuple[int, object, int]], world_size: int) -> str:
    """One line for ranks that exited, as (rank, process, exit code): the cause first (a rank killed by a signal
    before one that exited on its own, which is what a rank does when a peer is gone; then the lowest rank), the
    others named as stopped because of it."""
    ordered = sorted(exited, key=lambda e: (e[2] >= 0, e[0]))
    rank, proc, code = ordered[0]
    line = f"data-parallel rank {rank} of {world_size} (pid {proc.pid}) {_how(code)}"
    if len(ordered) > 1:
        line += "; stopped because of it: " + ", ".join(f"rank {r} {_how(c)}" for r, _, c in ordered[1:])
    return line + "; the other ranks cannot run without it, so every unfinished request ended"


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class DataParallelClient(ProcessClient):
    def __init__(self, factory, options: EngineOptions, parallel):
        self.parallel = parallel
        self.followers: list[tuple[int, subprocess.Popen]] = []
        env = None
        launched = check_launch(parallel)
        if launched is not None and launched[0] != 0:
            raise ConfigError(f"RANK={launched[0]}: under torchrun only rank 0 runs the frontend (LLM, the CLI's "
                              "prompts, the server); allowed: `python -m deepinfer ...` on every rank, whose ranks "
                              "other than 0 follow rank 0 (deepinfer.engine.core_process.run_rank)")
        if launched is None:  # not under torchrun: start ranks 1.. here
            n = parallel.world_size
            base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(n),
                        LOCAL_WORLD_SIZE=str(n))
            payload = encode_rank(factory.settings, options)
            try:
                for r in range(1, n):
                    proc = subprocess.Popen([sys.executable, "-m", "deepinfer.engine.core_process", "--follower"],
                                            stdin=subprocess.PIPE, close_fds=True,
                                            env=dict(base, RANK=str(r), LOCAL_RANK=str(r)))
                    self.followers.append((r, proc))
                    proc.stdin.write(payload)
                    proc.stdin.close()
            except BaseException:
                self._stop_followers()
                raise
            env = dict(base, RANK="0", LOCAL_RANK="0")
        try:
            super().__init__(factory, options, env=env)  # on failure it has closed rank 0 already
        except BaseException:
            self._stop_followers()
            raise

    # ---- liveness: rank 0 through ProcessClient, every rank's exit here ------------------------------------------
    def _check_health(self, what: str) -> None:
        dead = self._dead_rank()
        if dead is not None:
            self._mark_dead(f"{dead} while the frontend waited for the engine's {what}")
        super()._check_health(what)

    def _dead_rank(self, wait_s: float = 0.0) -> str | None:
        """The rank that died, named (None while every rank runs): rank 0 is polled with the others, so a killed
        rank 0 is not reported as the follower that exited because its peer was gone."""
        deadline = time.monotonic() + wait_s
        while True:
            ranks = [(0, self.process), *self.followers]
            exited = [(r, proc, proc.poll()) for r, proc in ranks if proc.poll() is not None]
            if exited:
                return death_message(exited, self.parallel.world_size)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _mark_dead(self, message: str, details: str | None = None) -> None:
        # rank 0 often notices first (its collective fails): name the rank that caused it when one exited
        if not self._closed and not message.startswith("data-parallel rank"):
            dead = self._dead_rank(DEATH_WAIT_S) or self._stopped_follower()
            if dead is not None:
                message, details = dead, f"rank 0: {message}\n{details or ''}"
        super()._mark_dead(message, details)

    def _stopped_follower(self) -> str | None:
        """A rank that is stopped (SIGSTOP, a debugger): rank 0's collectives with it time out (Linux /proc)."""
        for r, proc in self.followers:
            try:
                with open(f"/proc/{proc.pid}/stat") as f:
                    state = f.read().rpartition(")")[2].split()[0]
            except (OSError, IndexError):
                continue
            if state in ("T", "t"):
                return (f"data-parallel rank {r} of {self.parallel.world_size} (pid {proc.pid}) is stopped and "
                        f"rank 0's collectives with it timed out (parallel.timeout={self.parallel.timeout:g} s); "
                        "every unfinished request ended")
        return None

    def close(self) -> None:
        """Rank 0 first (asked to stop, it tells the others), then the other ranks: waited for, then terminated,
        then killed, each step bounded by close_grace_s."""
        try:
            super().close()
        finally:
            self._stop_followers()

    def _stop_followers(self) -> None:
        for stop in (None, "terminate", "kill"):
            alive = [p for _, p in self.followers if p.poll() is None]
            if not alive:
                return
            for p in alive:
                if stop is not None:
                    getattr(p, stop)()
            deadline = time.monotonic() + self.options.close_grace_s
            for p in alive:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))  # reaps it
                except subprocess.TimeoutExpired:
                    pass
