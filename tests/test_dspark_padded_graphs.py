"""A DSpark verification step whose sequences verify different numbers of drafts (varlen's lengths, or requests near
max_tokens verifying fewer) replays the graph of its longest length: each shorter sequence is padded with its last
token, keeps only its real rows' logits, and forgets the padding at once (engine/cuda_graphs.py `padded`).

Held on the CPU with the engine's own graph code around an emulated capture (tests/emulated_graphs.py: a replay runs
the recorded forward again over the static input buffers), so the padding, the block-table bucket and the rows the
runner keeps are the code under test: greedy output token for token that of plain decoding, with padded steps
replayed, and every padding token forgotten (the caches' token counts are those of the unpadded steps)."""

from __future__ import annotations

import random

import pytest

from deepinfer import embedded
from deepinfer.engine.model_runner import ModelRunner
from deepinfer.frontend import LLMEngine
from deepinfer.sampling import SamplingParams
from emulated_graphs import EmulatedDecodeGraphs
from options_helpers import settings_for

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def emulated_graphs(monkeypatch):
    """Every CPU runner of this test gets the engine's decode graphs, emulated."""
    allocate = ModelRunner.allocate
    runners = []

    def allocate_with_graphs(self, num_slots, num_blocks, block_size, max_model_len=0, *args, **kwargs):
        allocate(self, num_slots, num_blocks, block_size, max_model_len, *args, **kwargs)
        self.graphs = self.decode_graphs(num_slots, 8, max_model_len, block_size, cls=EmulatedDecodeGraphs)
        runners.append(self)

    monkeypatch.setattr(ModelRunner, "allocate", allocate_with_graphs)
    return runners


def _generate(model_dir, prompts, params, *decoding):
    settings = settings_for(model_dir, *decoding, process="inproc", zero_overhead_scheduling=False,
                            memory_budget=1 << 26, max_num_batched_tokens=256, block_size=16,
                            runtime={"num_threads": 1})
    with LLMEngine.for_settings(settings) as eng:
        outs = eng.generate(prompts, params, use_tqdm=False)
        return [list(o.token_ids) for o in outs], eng.client.core.runner


def test_a_mixed_length_verification_replays_padded_and_changes_no_token(emulated_graphs):
    model_dir = str(embedded.materialize("tiny-random"))
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(8, 40))] for _ in range(6)]
    # different max_tokens: near its end a request verifies fewer drafts than the others in the same step
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (3, 5, 8, 11, 14, 17)]
    plain, _ = _generate(model_dir, prompts, params, "decoding=plain")
    spec, runner = _generate(model_dir, prompts, params, "decoding=dspark", "decoding.num_draft_tokens=3")
    assert spec == plain
    graphs = runner.graphs
    assert runner.padded_rows > 0  # some steps verified mixed lengths, as their longest
    assert graphs.replays > 0 and not graphs.failures()
    assert {key[2] for key in graphs._graphs} >= {4}  # verification graphs of 1 + 3 tokens served them


def test_padding_covers_its_positions_in_the_block_table_bucket(emulated_graphs):
    """A padding token past a sequence's last block needs a table column: the bucket is chosen for the padded
    extent (its column holds the spare block), never narrower."""
    model_dir = str(embedded.materialize("tiny-random"))
    settings = settings_for(model_dir, "decoding=dspark", "decoding.num_draft_tokens=3", process="inproc",
                            memory_budget=1 << 26, block_size=16, runtime={"num_threads": 1})
    with LLMEngine.for_settings(settings) as eng:
        runner = eng.client.core.runner
        graphs = runner.graphs

        class State:
            def __init__(self, num_tokens, blocks):
                self.num_tokens, self.blocks = num_tokens, list(range(blocks))

        # 30 tokens in 2 blocks of 16; verifying 1 + 3 writes positions 30..33: a third block's column
        padded, pads, key = graphs.padded([[7], [1, 2, 3, 4]], [State(30, 2), State(10, 1)])
        assert padded == [[7, 7, 7, 7], [1, 2, 3, 4]] and pads == [3, 0]
        assert key == graphs.bucket(2, 3, 4) and key[1] >= 3
