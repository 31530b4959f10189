"""The engine-core process: builds the backend, then loops receive requests -> step -> send outputs.

Started as `python -m deepinfer.engine.core_process` with its typed start-up message on stdin
(deepinfer.engine.startup: MessagePack, not pickle; not multiprocessing): a fresh interpreter that never
re-imports the user's main script, so `LLM(...)` works in scripts without an `if __name__ == "__main__"` guard,
and no fork ever copies a process holding torch threads. The stdin pipe also carries the channel key
(deepinfer.engine.ipc): only the frontend that started us holds it. Every frame it then receives is decoded
against the frontend's message types (deepinfer.engine.messages.TO_CORE); anything else is dropped and logged.

Liveness: a heartbeat thread (it runs no steps) sends, every heartbeat_interval_s, how long ago the step loop last
turned. The frontend declares the core dead when heartbeats stop (killed, SIGSTOPped, a GIL held forever) or
report a loop stuck past its deadline (a deadlock in a step).

It exits when told to, and also on its own when the frontend process disappears (parent pid changes, and on Linux
the kernel sends SIGKILL via PR_SET_PDEATHSIG), so a killed frontend never leaves a busy engine behind. Ctrl-C in
a terminal reaches the whole process group: the core ignores SIGINT and lets the frontend decide.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback

import zmq

from deepinfer.engine import messages as m
from deepinfer.engine.ipc import CORE, FRONTEND, HEARTBEAT, Signer, Verifier, make_socket
from deepinfer.engine.messages import CoreOutputs
from deepinfer.engine.options import EngineOptions

log = logging.getLogger("deepinfer.engine.core")

IDLE_POLL_MS = 200


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            PR_SET_PDEATHSIG = 1
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass  # best effort; the parent-pid check below still ends the loop


class _LoopClock:
    """When the step loop last turned (None while the core still starts)."""

    def __init__(self):
        self.last: float | None = None

    def tick(self) -> None:
        self.last = time.monotonic()


def _heartbeat(ctx, addr: str, key: bytes, options: EngineOptions, clock: _LoopClock, stop: threading.Event):
    sock = make_socket(ctx, zmq.PUSH, addr, bind=False)
    signer = Signer(key, HEARTBEAT)
    try:
        while not stop.is_set():
            last = clock.last
            age = None if last is None else time.monotonic() - last
            try:
                sock.send(signer.pack(m.Heartbeat(time.monotonic(), age)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # nobody reading yet; the next beat replaces it anyway
            stop.wait(options.heartbeat_interval_s)
    finally:
        sock.close()


def run_engine_core(factory, options: EngineOptions, endpoints: tuple[str, str], key: bytes, parent_pid: int) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    control, heartbeat = endpoints
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.DEALER, control, bind=False, send_timeout_s=options.send_timeout_s)
    signer, verifier = Signer(key, CORE), Verifier(key, FRONTEND, m.TO_CORE)
    clock, stop = _LoopClock(), threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(ctx, heartbeat, key, options, clock, stop), daemon=True,
                            name="deepinfer-heartbeat")
    beat.start()

    def send(msg) -> None:
        sock.send(signer.pack(msg))  # zmq.Again after send_timeout_s: the frontend is gone, so are we

    try:
        send(m.Hello(os.getpid()))  # lets the frontend learn which connection is ours
        try:
            from deepinfer.parallel.lockstep import build_core

            def build():
                from deepinfer.config.hardware import set_cpu_threads

                set_cpu_threads(options.num_threads)  # on the thread that runs the model
                return factory()

            # an EngineCore; with a multi-rank layout, rank 0 of the world driving the others (parallel/lockstep.py)
            core = build_core(factory, build, options)
        except BaseException as exc:
            send(m.Failure(summary(exc), traceback.format_exc(), startup=True))
            return
        send(m.Ready(core.info()))
        try:
            _loop(core, sock, verifier, send, parent_pid, clock)
        except BaseException as exc:
            try:
                send(m.Failure(summary(exc), traceback.format_exc(), startup=False))  # the frontend raises with these
            except zmq.ZMQError:
                pass
            if getattr(exc, "frontend_reports", False):
                return  # an expected end (a data-parallel rank died): the frontend prints the line, no traceback here
            raise
        finally:
            core.close()
    finally:
        stop.set()
        beat.join(timeout=2)
        sock.close()
        ctx.term()


def summary(exc: BaseException) -> str:
    """One line for the user: the message alone for the errors that are written as one line (bad checkpoint,
    config), else the exception's type and message; the full traceback travels beside it."""
    from deepinfer.config.errors import ConfigError
    from deepinfer.models.config import ModelConfigError
    from deepinfer.models.loading.errors import CheckpointError

    text = " ".join(str(exc).split())
    if isinstance(exc, (CheckpointError, ModelConfigError, ConfigError)):
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _loop(core, sock: zmq.Socket, verifier: Verifier, send, parent_pid: int, clock: _LoopClock) -> None:
    steps = 0
    while True:
        clock.tick()
        busy = core.has_work()
        if busy and steps % 64 == 0 or not busy:
            if os.getppid() != parent_pid:
                return  # orphaned: the frontend is gone
        if sock.poll(0 if busy else IDLE_POLL_MS):
            immediate = []
            while True:
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = verifier.unpack(frame)
                if msg is None:
                    continue  # not signed by our frontend, or not a message: dropped (and logged) unread
                if isinstance(msg, m.Shutdown):
                    return
                if isinstance(msg, m.Ping):
                    send(m.Pong())
                elif isinstance(msg, m.Add):
                    for wire in msg.requests:
                        req = m.from_wire(wire)  # a malformed request ends alone, with its one-line error
                        upd = core.add_request(req) if isinstance(req, m.AddRequest) else req
                        if upd is not None:
                            immediate.append(upd)
                elif isinstance(msg, m.Abort):
                    immediate += [u for u in map(core.abort, msg.request_ids) if u is not None]
            if immediate:
                send(m.Outputs(CoreOutputs(immediate)))
        if core.has_work():
            out = core.step()
            steps += 1
            if out.updates or out.stats:
                send(m.Outputs(out))


def main() -> None:
    from deepinfer.engine import startup

    try:
        args = startup.decode(sys.stdin.buffer.read())
        factory = startup.factory_from(args.backend)
    except Exception as exc:  # nobody to tell over the socket yet (no key): stderr and a non-zero exit
        print(f"deepinfer engine core: bad start-up message: {' '.join(str(exc).split())}", file=sys.stderr)
        sys.exit(2)
    run_engine_core(factory, args.options, (args.control, args.heartbeat), args.key, args.parent_pid)


if __name__ == "__main__":
    main()
