"""One offline CLI job: read the requests, load the model, generate, write the outputs and the summary."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from deepinfer.cli.outputs import output_path, write_outputs
from deepinfer.cli.requests import generate_requests, read_requests
from deepinfer.cli.summary import make_summary, print_summary


class Interrupted(Exception):
    """Ctrl-C during a job: the message says what was kept."""


def follower_rank(settings) -> bool:
    """Whether this process is a torchrun rank other than 0 (checked: a WORLD_SIZE other than the layout's ranks
    is a one-line ConfigError)."""
    if settings.parallel.world_size == 1 and "WORLD_SIZE" not in os.environ:
        return False  # the common case: no torch.distributed import
    from deepinfer.distributed.world import check_launch

    launched = check_launch(settings.parallel)
    return launched is not None and launched[0] != 0


def run_job(settings, run_dir: Path, overrides: list[str]) -> dict:
    from deepinfer.api import LLM
    from deepinfer.engine import EngineDeadError

    out_path = output_path(settings, run_dir)
    requests = read_requests(settings)
    t0 = time.perf_counter()
    llm = LLM.from_settings(settings)
    try:
        load_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        try:
            outputs = generate_requests(llm, requests)
        except KeyboardInterrupt as exc:
            finished = getattr(exc, "finished_outputs", [])
            write_outputs(out_path, finished)
            raise Interrupted(f"interrupted; {len(finished)} of {len(requests)} requests had finished, their "
                              f"outputs are in {out_path}") from None
        except EngineDeadError as exc:  # e.g. a data-parallel rank died: every request, unfinished ones as errors
            write_outputs(out_path, getattr(exc, "outputs", []))
            raise
        gen_s = time.perf_counter() - t1
        write_outputs(out_path, outputs)
        for o in outputs:
            shown = o.prompt if o.prompt is not None else f"<{len(o.prompt_token_ids)} token ids>"
            result = o.text if o.finish_reason != "error" else f"<error: {o.error}>"
            print(f"[{o.request_id}] {shown!r} -> {result!r} ({o.finish_reason})")
        summary = make_summary(llm, outputs, load_s, gen_s, overrides, out_path)
        print_summary(summary)
        (run_dir / "result.json").write_text(json.dumps(summary, indent=2) + "\n")
    finally:
        llm.close()  # bounded: the engine core is killed if it does not stop within seconds
    return summary
