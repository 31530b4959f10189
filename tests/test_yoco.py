"""YOCO bounded replay (deepinfer/models/replay.py, MODEL_V41_SPEC.md §7): compact is bitwise mask on every kept
row, runs fewer decoder-layer rows, and is selected / validated / refused as configured.

The embedded tiny model: sliding window 16, decoder ("consumer") layers 4..7 (layer 4 is the first compress-ratio-1
layer and the decoder layers' KV source), an Engram layer (5) among them. K = 24 so that the rectangle cuts
prompts of 30..130 tokens, and a 10-token prompt stays whole.
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.api import LLM, load_settings
from deepinfer.config.errors import ConfigError
from deepinfer.models import ForwardBatch, load_model
from deepinfer.models.cache import derive, pack_step
from deepinfer.models.replay import BoundedReplay, consumer_boundary
from deepinfer.sampling import SamplingParams

K = 24
LENGTHS = (90, 10, 47, 130, 31)


@pytest.fixture(scope="module")
def model():
    from deepinfer import embedded

    return load_model(embedded.materialize("tiny-random"))


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in LENGTHS]


def prefill(model, prompts, mode, chunk, keep=K, hook=None):
    """Chunked prefill of all prompts together (standalone pools). Returns per step the logits of every row a
    compact step computes (the kept rows: positions >= data_len - keep, and each chunk's last row), the sequences'
    states, and the rows each step ran through the decoder layers."""
    replay = BoundedReplay(model.config, mode, keep) if mode != "off" else None
    states = [model.new_state() for _ in prompts]
    done = [0] * len(prompts)
    kept_logits = []
    while any(d < len(p) for d, p in zip(done, prompts)):
        live = [i for i, p in enumerate(prompts) if done[i] < len(p)]
        toks = [prompts[i][done[i]: done[i] + chunk] for i in live]
        seqs = [states[i] for i in live]
        data = [len(prompts[i]) for i in live]
        pasts = [st.num_tokens for st in seqs]
        for st, t in zip(seqs, toks):
            st.reserve(st.num_tokens + len(t))
        host = pack_step(toks, seqs, seqs[0].pools.layout, model.device)
        rows, start = [], 0
        for p, t, d in zip(pasts, toks, data):
            rows += [start + j for j in range(len(t)) if p + j >= d - keep or j == len(t) - 1]
            start += len(t)
        host.base["last"] = torch.tensor(rows)  # logits of every kept row, not only each chunk's last
        meta = derive(host, seqs[0].pools)
        step = replay.plan(meta, seqs[0].pools, pasts, data) if replay is not None else None
        kept_logits.append(model.run(meta, seqs[0].pools, step))
        for i, st, t in zip(live, seqs, toks):
            st.num_tokens += len(t)
            done[i] += len(t)
    return kept_logits, states


def consumer_rows(model, run):
    """Rows that went through the MoE of each decoder layer while `run()` ran."""
    boundary, layer, rows = consumer_boundary(model.config), [0], [0]
    moe = model._moe

    def count(g, lw, *rest):
        if layer[0] >= boundary:
            rows[0] += g.shape[0]
        return moe(g, lw, *rest)

    model.layer_hook, model._moe = (lambda i: layer.__setitem__(0, i)), count
    try:
        result = run()
    finally:
        model.layer_hook = None
        del model._moe
    return rows[0], result


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunk", [1000, 13, 1], ids=["one-shot", "chunked", "token-by-token"])
def test_compact_replay_matches_mask_bitwise_on_kept_rows(model, prompts, chunk):
    mask, mask_states = prefill(model, prompts, "mask", chunk)
    compact, compact_states = prefill(model, prompts, "compact", chunk)
    assert all(torch.equal(a, b) for a, b in zip(mask, compact))
    # and so are the decodes that follow (greedy, 6 tokens per sequence, all sequences batched)
    tokens = [int(row.argmax()) for row in last_rows(mask, prompts, chunk)]
    for _ in range(6):
        lm = model.forward(ForwardBatch([[t] for t in tokens], mask_states))
        lc = model.forward(ForwardBatch([[t] for t in tokens], compact_states))
        assert torch.equal(lm, lc)
        tokens = [int(t) for t in lm.argmax(-1)]


def last_rows(kept_logits, prompts, chunk):
    """Each sequence's last prompt row among the kept-row logits of its final chunk step."""
    out = [None] * len(prompts)
    done, steps = [0] * len(prompts), iter(kept_logits)
    while any(d < len(p) for d, p in zip(done, prompts)):
        logits, offset = next(steps), 0
        for i, p in enumerate(prompts):
            if done[i] >= len(p):
                continue
            n = min(chunk, len(p) - done[i])
            kept = sum(1 for j in range(n) if done[i] + j >= len(p) - K or j == n - 1)
            offset += kept
            done[i] += n
            if done[i] == len(p):
                out[i] = logits[offset - 1]
    return out


@pytest.mark.timeout(60)
def test_replay_whose_rectangle_holds_every_row_equals_off(model, prompts):
    off, _ = prefill(model, prompts, "off", 13, keep=200)
    for mode in ("mask", "compact"):
        cut, _ = prefill(model, prompts, mode, 13, keep=200)
        assert all(torch.equal(a, b) for a, b in zip(off, cut))


@pytest.mark.timeout(60)
def test_truncation_changes_long_prompts_and_not_short_ones(model, prompts):
    off, _ = prefill(model, prompts, "off", 1000)
    mask, _ = prefill(model, prompts, "mask", 1000)
    rows_off, rows_mask = last_rows(off, prompts, 1000), last_rows(mask, prompts, 1000)
    assert torch.equal(rows_off[1], rows_mask[1])  # 10 tokens < K: nothing cut
    assert not torch.equal(rows_off[3], rows_mask[3])  # 130 tokens: truncated is not off (and is not meant to be)


@pytest.mark.timeout(60)
def test_compact_runs_fewer_decoder_layer_rows_by_what_it_reports(model, prompts):
    n_mask, _ = consumer_rows(model, lambda: prefill(model, prompts, "mask", 1000))
    n_compact, _ = consumer_rows(model, lambda: prefill(model, prompts, "compact", 1000))
    replay = BoundedReplay(model.config, "compact", K)
    saved = replay.rows_saved(list(LENGTHS), [0] * len(LENGTHS), list(LENGTHS))
    assert n_mask == sum(LENGTHS) * replay.num_consumer_layers
    assert n_mask - n_compact == saved == sum(max(0, n - K) for n in LENGTHS) * 4


# ---- through the engine ----------------------------------------------------------------------------------------
def engine_run(mode, prompts, params, budget=None, extra=()):
    overrides = ["model=tiny_random", f"yoco={mode}", f"yoco.keep_tokens={K}", "engine.max_num_batched_tokens=32",
                 "engine.process=inproc", "cache.block_size=16", "runtime.num_threads=1", "engine.max_num_seqs=3"]
    if budget:  # sized for the slots without prefix caching (its checkpoints and lag rows would take the budget)
        overrides += [f"cache.memory_budget={budget}", "cache.prefix_caching=false"]
    overrides += extra
    with LLM(overrides=overrides) as llm:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return outs, llm.last_metrics


@pytest.fixture(scope="module")
def small_budget(model):
    """Caches for 3 sequences' fixed state and 192 tokens of context: five requests preempt each other."""
    layout = model.cache_layout(16)
    return 3 * layout.slot_bytes() + 12 * layout.block_bytes()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_engine_compact_gives_mask_tokens_chunked_and_preempted(prompts, small_budget, temperature):
    params = [SamplingParams(temperature=temperature, max_tokens=16, ignore_eos=True, seq_seed=100 + i)
              for i in range(len(prompts))]
    mask, m_metrics = engine_run("mask", prompts, params, small_budget)
    compact, c_metrics = engine_run("compact", prompts, params, small_budget)
    assert [o.token_ids for o in mask] == [o.token_ids for o in compact]
    assert all(len(o.token_ids) == 16 for o in compact)
    assert c_metrics["preemptions"] > 0 and m_metrics["preemptions"] == c_metrics["preemptions"]
    assert m_metrics["replay_rows_saved"] == 0 and c_metrics["replay_rows_saved"] > 0


@pytest.mark.timeout(60)
def test_engine_compact_with_dspark_drafting_gives_mask_tokens(prompts):
    """DSpark's context features are taken in the decoder layers (the tiny model's targets 5..7): compact hands
    them the kept rows; verification rows are never cut."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    mask, _ = engine_run("mask", prompts, params, extra=["decoding=dspark"])
    compact, metrics = engine_run("compact", prompts, params, extra=["decoding=dspark"])
    assert [o.token_ids for o in mask] == [o.token_ids for o in compact]
    assert metrics["replay_rows_saved"] > 0


@pytest.mark.timeout(60)
def test_engine_refuses_prompt_logprobs_under_truncation_per_request(prompts):
    params = [SamplingParams(max_tokens=2, prompt_logprobs=True), SamplingParams(max_tokens=2)]
    outs, _ = engine_run("compact", prompts[:2], params)
    assert outs[0].finish_reason == "error" and "prompt_logprobs are unavailable" in outs[0].error
    assert "yoco=off" in outs[0].error
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 2


# ---- configuration ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_mode_is_the_env_variable_and_the_cli_wins(monkeypatch):
    monkeypatch.delenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", raising=False)
    monkeypatch.delenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", raising=False)
    s = load_settings([])
    assert (s.yoco.mode, s.yoco.keep_tokens, s.pipeline.stages["replay"].component) == ("off", 140, None)
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "compact")
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "64")
    s = load_settings([])
    assert (s.yoco.mode, s.yoco.keep_tokens) == ("compact", 64)
    assert (s.pipeline.stages["replay"].component, s.pipeline.stages["replay"].options) == ("yoco_compact",
                                                                                            {"keep_tokens": 64})
    s = load_settings(["yoco=mask", "yoco.keep_tokens=30"])
    assert (s.yoco.mode, s.yoco.keep_tokens, s.pipeline.stages["replay"].component) == ("mask", 30, "yoco_mask")
    assert load_settings(["yoco=off"]).pipeline.stages["replay"].component is None


@pytest.mark.timeout(60)
def test_an_invalid_mode_variable_is_a_one_line_error_with_exit_code_2(monkeypatch, capsys):
    from deepinfer.__main__ import main

    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "fast")
    with pytest.raises(ConfigError, match=r"^DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE='fast' is not allowed; "
                                          r"allowed: compact, mask, off$"):
        load_settings([])
    assert main(["sampling.max_tokens=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE='fast'" in err


@pytest.mark.timeout(60)
def test_a_mode_without_its_replay_component_is_rejected(monkeypatch):
    monkeypatch.delenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", raising=False)
    with pytest.raises(ConfigError, match="yoco.mode=mask needs pipeline.stages.replay.component='yoco_mask'"):
        load_settings(["yoco.mode=mask"])
    with pytest.raises(ConfigError, match="differs from yoco.keep_tokens"):
        load_settings(["yoco=compact", "pipeline.stages.replay.options.keep_tokens=20"])


@pytest.mark.timeout(60)
def test_keep_tokens_below_window_plus_backtracking_is_a_config_error(monkeypatch):
    from deepinfer.pipeline import load_program

    monkeypatch.delenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", raising=False)
    with pytest.raises(ConfigError, match=r"yoco.keep_tokens=16 \(DEEPINFER_YOCO_PREFILL_KEEP_TOKENS\) is out of "
                                          r"range; allowed: at least sliding_window \(16\) \+ max backtracking "
                                          r"tokens \(1\) = 17"):
        load_program(load_settings(["model=tiny_random", "yoco=compact", "yoco.keep_tokens=16"]), weights=False)
    program, _ = load_program(load_settings(["model=tiny_random", "yoco=compact", "yoco.keep_tokens=17"]), weights=False)
    assert program.replay.mode == "compact" and program.replay.keep == 17 and program.replay.boundary == 4


@pytest.mark.timeout(60)
def test_flash_recipes_replay_compact_unless_the_variable_or_the_cli_says_otherwise(monkeypatch):
    from deepinfer.config.compose import compose, recipe_names

    monkeypatch.delenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", raising=False)
    for recipe in [r for r in recipe_names() if r.startswith("flash_")]:
        assert compose([f"+recipe={recipe}"]).pipeline.stages.replay.component == "yoco_compact"
        assert compose([f"+recipe={recipe}", "yoco=off"]).pipeline.stages.replay.component is None
        monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "mask")
        assert compose([f"+recipe={recipe}"]).yoco.mode == "mask"
        monkeypatch.delenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE")
    assert compose(["+recipe=tiny_cpu"]).yoco.mode == "off"
