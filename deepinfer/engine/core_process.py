"""The engine-core process: builds the backend, then loops receive requests -> step -> send outputs.

Started as `python -m deepinfer.engine.core_process` with its arguments pickled on stdin (not multiprocessing):
a fresh interpreter that never re-imports the user's main script, so `LLM(...)` works in scripts without an
`if __name__ == "__main__"` guard, and no fork ever copies a process holding torch threads.

It exits when told to, and also on its own when the frontend process disappears (parent pid changes, and on Linux
the kernel sends SIGKILL via PR_SET_PDEATHSIG), so a killed frontend never leaves a busy engine behind.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import traceback

import zmq

from deepinfer.engine.ipc import make_socket
from deepinfer.engine.messages import CoreOutputs
from deepinfer.engine.options import EngineOptions

IDLE_POLL_MS = 200


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            PR_SET_PDEATHSIG = 1
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass  # best effort; the parent-pid check below still ends the loop


def run_engine_core(factory, options: EngineOptions, to_core: str, from_core: str, parent_pid: int) -> None:
    _die_with_parent()
    ctx = zmq.Context()
    inbox = make_socket(ctx, zmq.PULL, to_core, bind=False)
    outbox = make_socket(ctx, zmq.PUSH, from_core, bind=False)
    try:
        try:
            from deepinfer.engine.core import EngineCore

            def build():
                if options.num_threads:  # a fresh process: the frontend's setting is not inherited
                    import torch

                    torch.set_num_threads(options.num_threads)  # on the thread that runs the model
                return factory()

            core = EngineCore(build, options)
        except BaseException:
            outbox.send_pyobj(("startup_error", traceback.format_exc()))
            return
        outbox.send_pyobj(("ready", core.info()))
        try:
            _loop(core, inbox, outbox, parent_pid)
        except BaseException:
            outbox.send_pyobj(("fatal", traceback.format_exc()))  # the frontend raises with this text
            raise
        finally:
            core.close()
    finally:
        inbox.close()
        outbox.close()
        ctx.term()


def _loop(core, inbox: zmq.Socket, outbox: zmq.Socket, parent_pid: int) -> None:
    steps = 0
    while True:
        busy = core.has_work()
        if busy and steps % 64 == 0 or not busy:
            if os.getppid() != parent_pid:
                return  # orphaned: the frontend is gone
        if inbox.poll(0 if busy else IDLE_POLL_MS):
            immediate = []
            while True:
                try:
                    kind, payload = inbox.recv_pyobj(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if kind == "shutdown":
                    return
                if kind == "ping":
                    outbox.send_pyobj(("pong", None))
                if kind == "add":
                    immediate += [u for u in map(core.add_request, payload) if u is not None]
                elif kind == "abort":
                    immediate += [u for u in map(core.abort, payload) if u is not None]
            if immediate:
                outbox.send_pyobj(("outputs", CoreOutputs(immediate)))
        if core.has_work():
            out = core.step()
            steps += 1
            if out.updates or out.stats:
                outbox.send_pyobj(("outputs", out))


def main() -> None:
    factory, options, to_core, from_core, parent_pid = pickle.load(sys.stdin.buffer)
    run_engine_core(factory, options, to_core, from_core, parent_pid)


if __name__ == "__main__":
    main()
