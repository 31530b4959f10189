"""The rank that died is the one named (issue 25 item 5): when rank 0 of dep2 is SIGKILLed, rank 1 exits with code 1
because its peer is gone; the error names rank 0 and its signal, and rank 1 as stopped because of it, never the
survivor as the cause."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest

from deepinfer.engine import EngineDeadError
from deepinfer.engine.dp_client import death_message


def _proc(pid: int):
    return SimpleNamespace(pid=pid)


def test_a_rank_killed_by_a_signal_is_the_cause_and_the_others_are_named_as_stopped_by_it():
    line = death_message([(1, _proc(11), 1), (0, _proc(10), -signal.SIGKILL)], 2)
    assert line.startswith("data-parallel rank 0 of 2 (pid 10) was killed by SIGKILL; stopped because of it: "
                           "rank 1 exited with code 1;")
    assert death_message([(2, _proc(12), 1), (3, _proc(13), 1)], 4).startswith("data-parallel rank 2 of 4 (pid 12) "
                                                                                "exited with code 1; stopped")
    assert "\n" not in line


@pytest.mark.timeout(240)
def test_dep2_rank_0_killed_is_reported_as_rank_0():
    from deepinfer import LLM
    from deepinfer.sampling import SamplingParams

    llm = LLM("tiny_random", parallel="dep2", seed=7, engine={"max_num_seqs": 8})
    try:
        client = llm._engine.client
        rank0 = client.process
        seen = []

        def kill_rank_0(index, token_ids):
            seen.append(index)
            if len(seen) == 8:
                os.kill(rank0.pid, signal.SIGKILL)

        sp = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
        with pytest.raises(EngineDeadError) as info:
            llm.generate(prompt_token_ids=[[3 + i, 40 + i, 7] for i in range(4)], sampling_params=sp,
                         use_tqdm=False, on_update=kill_rank_0)
        message = str(info.value)
        assert message.startswith(f"data-parallel rank 0 of 2 (pid {rank0.pid}) was killed by SIGKILL"), message
        assert "\n" not in message
        print(message)
    finally:
        llm.close()
