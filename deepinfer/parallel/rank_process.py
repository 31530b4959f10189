"""A rank other than 0: join the world, load this rank's share of the model, follow rank 0's turns until it says
stop (deepinfer.parallel.lockstep).

Two ways in: `python -m deepinfer.parallel.rank_process` with its typed start-up message on stdin (the frontend's
launcher, deepinfer.parallel.launch: the resolved settings and engine options as MessagePack, never pickle), or
`run_rank(settings)` from the CLI of a torchrun process whose RANK is not 0. It prints its weight memory when
loaded, exits 0 when rank 0 ends the run, and with one line on stderr and exit code 1 when it cannot go on (a
collective failed: another rank died; or it could not start).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import msgspec

from deepinfer.engine.options import EngineOptions

EXIT_FAILED = 1


class RankStartup(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    settings: dict[str, Any]  # msgspec.to_builtins(Settings), rebuilt through the config's own checks
    options: EngineOptions


def startup_payload(settings, options: EngineOptions) -> bytes:
    return msgspec.msgpack.encode(RankStartup(msgspec.to_builtins(settings), options))


def run_rank(settings, options: EngineOptions | None = None) -> None:
    """Be a follower rank until rank 0 ends the run. options: the engine's (default: from the settings, as the
    frontend builds them)."""
    from deepinfer.engine.backend import SettingsBackend

    from .lockstep import LockstepRank, follow, rank_core
    from .world import join, leave

    if options is None:
        options = EngineOptions.for_settings(settings)
    factory = SettingsBackend(settings)

    def build():
        if options.num_threads:  # on the thread that runs the model, as the engine-core process does
            import torch

            torch.set_num_threads(options.num_threads)
        return factory()

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
    from deepinfer.parallel.lockstep import _first_line

    try:
        run_rank(settings, options)
    except Exception as exc:
        print(f"deepinfer: rank {os.environ.get('RANK', '?')}: error: {_first_line(exc)}", file=sys.stderr, flush=True)
        sys.exit(EXIT_FAILED)


def main() -> None:
    from deepinfer.config.resolve import rebuild
    from deepinfer.engine.core_process import _die_with_parent
    from deepinfer.parallel.lockstep import _first_line

    _die_with_parent()  # the frontend that started us is gone: so are we
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the frontend decides
    try:
        args = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=RankStartup)
        settings = rebuild(args.settings)
    except Exception as exc:
        print(f"deepinfer: rank {os.environ.get('RANK', '?')}: bad start-up message: {_first_line(exc)}",
              file=sys.stderr, flush=True)
        sys.exit(EXIT_FAILED)
    run_rank_or_exit(settings, args.options)


if __name__ == "__main__":
    main()
