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

It exits when told to, and also on its own when the frontend process disappears (a watcher thread sees the parent
pid change and SIGKILLs the process; the step loop checks too), so a killed frontend never leaves a busy engine
behind. The parent is a process, not the thread that started the core: an LLM built in a thread that then exits
keeps its engine. Ctrl-C in
a terminal reaches the whole process group: the core ignores SIGINT and lets the frontend decide.

With a multi-rank layout this process is rank 0, driving the others (deepinfer.engine.dp_core). The other ranks run
this module in its follower mode: `python -m deepinfer.engine.core_process --follower` with a RankStartup on stdin
(started by deepinfer.engine.dp_client: the resolved settings and engine options as MessagePack, never pickle), or
`run_rank(settings)` from the CLI of a torchrun process whose RANK is not 0. A follower joins the world, loads its
share of the model, prints its weight memory, follows rank 0's turns (deepinfer.engine.lockstep) and exits 0 when
rank 0 ends the run, or with one line on stderr and exit code 1 when it cannot go on (a collective failed: another
rank died; or it could not start).
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
from deepinfer.sampling import heap_trim

log = logging.getLogger("deepinfer.engine.core")

IDLE_POLL_MS = 200
EXIT_FAILED = 1  # a follower rank that cannot go on


def _die_with_parent(parent_pid: int | None = None, every_s: float = 0.5) -> None:
    """SIGKILL this process once the process that started it is gone (a killed frontend never leaves a busy
    engine behind). A watcher thread polls the parent pid: not PR_SET_PDEATHSIG, which fires when the parent
    *thread* that forked us exits, so an LLM built in a short-lived thread would lose its engine core at once."""
    parent = os.getppid() if parent_pid is None else parent_pid

    def watch():
        while os.getppid() == parent:
            time.sleep(every_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="deepinfer-parent-watch").start()


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
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    heap_trim.limit_arenas()  # before the grammar threads start (sampling/heap_trim.py says why)
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
            core = build_core(factory, options)
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


def _builder(factory, options: EngineOptions):
    """The core's build(): a fresh process does not inherit the frontend's thread count, so it is set here, on the
    thread that runs the model."""
    def build():
        from deepinfer.config.hardware import set_cpu_threads

        set_cpu_threads(options.num_threads)
        return factory()

    return build


def build_core(factory, options: EngineOptions):
    """An EngineCore; with a multi-rank layout (the factory's settings), rank 0 of the world driving the others
    (deepinfer.engine.dp_core.DataParallelCore)."""
    settings = getattr(factory, "settings", None)
    if settings is None or settings.parallel.world_size == 1:
        from deepinfer.engine.core import EngineCore

        return EngineCore(_builder(factory, options), options)
    from deepinfer.engine.dp_core import data_parallel_core

    return data_parallel_core(settings, _builder(factory, options), options)


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


# ---- follower mode: a rank other than 0 of a multi-rank layout ---------------------------------------------------
def run_rank(settings, options: EngineOptions | None = None) -> None:
    """Be a follower rank until rank 0 ends the run. options: the engine's (default: from the settings, as the
    frontend builds them)."""
    from deepinfer.distributed.world import join, leave
    from deepinfer.engine.backend import SettingsBackend
    from deepinfer.engine.dp_core import rank_core
    from deepinfer.engine.lockstep import LockstepRank, follow

    if options is None:
        options = EngineOptions.for_settings(settings)
    heap_trim.limit_arenas()
    build = _builder(SettingsBackend(settings), options)
    world = join(settings.parallel, settings.hardware.device)
    try:
        core, eplb = rank_core(build, options, world, settings)
        rank = LockstepRank(core, world, eplb)
        try:
            follow(rank)
        finally:
            rank.close()
    finally:
        leave()


def run_rank_or_exit(settings, options: EngineOptions | None = None) -> None:
    """run_rank, ending the process with one line on stderr and exit code 1 when the rank cannot go on."""
    from deepinfer.engine.dp_core import first_line

    try:
        run_rank(settings, options)
    except Exception as exc:
        print(f"deepinfer: rank {os.environ.get('RANK', '?')}: error: {first_line(exc)}", file=sys.stderr, flush=True)
        sys.exit(EXIT_FAILED)


def follower_main() -> None:
    """`python -m deepinfer.engine.core_process --follower`: a rank that DataParallelClient started on this machine,
    its RankStartup on stdin."""
    from deepinfer.config.resolve import rebuild
    from deepinfer.engine import startup
    from deepinfer.engine.dp_core import first_line

    _die_with_parent()  # the frontend that started us is gone: so are we
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the frontend decides
    try:
        args = startup.decode_rank(sys.stdin.buffer.read())
        settings = rebuild(args.settings)
    except Exception as exc:
        print(f"deepinfer: rank {os.environ.get('RANK', '?')}: bad start-up message: {first_line(exc)}",
              file=sys.stderr, flush=True)
        sys.exit(EXIT_FAILED)
    run_rank_or_exit(settings, args.options)


def main() -> None:
    from deepinfer.engine import startup

    if sys.argv[1:] == ["--follower"]:
        follower_main()
        return
    try:
        args = startup.decode(sys.stdin.buffer.read())
        factory = startup.factory_from(args.backend)
    except Exception as exc:  # nobody to tell over the socket yet (no key): stderr and a non-zero exit
        print(f"deepinfer engine core: bad start-up message: {' '.join(str(exc).split())}", file=sys.stderr)
        sys.exit(2)
    run_engine_core(factory, args.options, (args.control, args.heartbeat), args.key, args.parent_pid)


if __name__ == "__main__":
    main()
