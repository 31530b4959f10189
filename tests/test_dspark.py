"""DSpark speculative decoding (MODEL_V41_SPEC.md §6) on the embedded model (random draft layers, CPU).

Lossless by specification: greedy output with drafts verified is token for token the output without them, however
many drafts a step verifies, whether the verification length comes from the confidence scheduler, with async
scheduling, structured outputs and preemption; with a drafter that copies the target's continuation every draft is
accepted (and the counters say so), with one that is always wrong none is. With sampling, verification draws from
the target's distribution (a chi-square test) and a fixed seq_seed reproduces the output in any batch.
"""

from __future__ import annotations

import json
import math
import random

import jsonschema
import pytest
import torch

from deepinfer import embedded
from deepinfer.engine import EngineOptions
from deepinfer.frontend import LLMEngine
from deepinfer.models import ForwardBatch, load_model
from deepinfer.sampling import SamplingParams
from deepinfer.sampling.speculative import accept_sampled
from options_helpers import settings_for

pytestmark = pytest.mark.timeout(600)

VOCAB = 500  # prompt ids drawn below this (the embedded vocabulary's plain tokens)


@pytest.fixture(scope="module")
def model_dir():
    return str(embedded.materialize("tiny-random"))


@pytest.fixture(scope="module")
def workload():
    """32 mixed greedy requests: prompts 1..120 tokens, max_tokens 1..24, half may stop at EOS."""
    rng = random.Random(41)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 120))] for _ in range(32)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 24), ignore_eos=bool(i % 2))
              for i in range(32)]
    return prompts, params


def run(model_dir, prompts, params, drafts=0, zos=False, varlen=False, budget=1 << 26, override=None,
        batched_tokens=256):
    """drafts=0: plain decoding (decoding=plain, no draft layers loaded); else decoding=dspark with `drafts`."""
    decoding = ["decoding=dspark", f"decoding.num_draft_tokens={drafts}", f"decoding.varlen={str(varlen).lower()}"]
    settings = settings_for(model_dir, *(decoding if drafts else ["decoding=plain"]), process="inproc",
                            zero_overhead_scheduling=zos, memory_budget=budget, max_num_batched_tokens=batched_tokens,
                            block_size=16, runtime={"num_threads": 1})
    with LLMEngine.for_settings(settings) as eng:
        if override is not None:
            eng.client.core.runner.draft_override = override
        outs = eng.generate(prompts, params, use_tqdm=False)
        return outs, eng.last_metrics


@pytest.fixture(scope="module")
def plain(model_dir, workload):
    outs, _ = run(model_dir, *workload)
    return [o.token_ids for o in outs]


def small_budget(model_dir, drafts: int) -> int:
    """Room for a few sequences only: requests get preempted and recomputed."""
    model = load_model(model_dir)
    layout = model.cache_layout(16, drafts + 1, drafts=True)
    return 6 * layout.slot_bytes() + 24 * layout.block_bytes()


# ---- the model side -------------------------------------------------------------------------------------------
def test_draft_layers_load_from_the_checkpoint_and_leave_the_target_unchanged(model_dir):
    with_drafts = load_model(model_dir)
    without = load_model(model_dir, draft_layers=False)
    assert with_drafts.drafter is not None and without.drafter is None
    assert with_drafts.drafter.num_layers == 3 and with_drafts.drafter.targets == (5, 6, 7)
    ids = list(range(10, 70))
    a = with_drafts.forward(ForwardBatch([ids], [with_drafts.new_state(6, drafts=True)]))
    b = without.forward(ForwardBatch([ids], [without.new_state()]))
    assert torch.equal(a, b)  # writing the draft context never touches the target's computation


def test_drafts_do_not_depend_on_how_the_prompt_was_chunked(model_dir):
    """The context keys are per token (features of its own row): one prefill or three chunks, same drafts."""
    model = load_model(model_dir)
    ids = [random.Random(3).randrange(3, VOCAB) for _ in range(50)]

    def drafts(chunks):
        state = model.new_state(6, drafts=True)
        for c in chunks:
            logits = model.forward(ForwardBatch([c], [state]))
        golden = logits.argmax(-1)
        step = model.drafter.step(torch.tensor([state.slot]), torch.tensor([state.num_tokens - 1]), 5, state.pools)
        out = model.drafter.draft(golden, step, state.pools, lambda i, lg: lg.argmax(-1))
        return out.tokens, out.confidences

    one = drafts([ids])
    three = drafts([ids[:7], ids[7:31], ids[31:]])
    assert torch.equal(one[0], three[0]) and torch.equal(one[1], three[1])
    assert ((one[1] > 0) & (one[1] < 1)).all()


# ---- greedy: lossless -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("drafts,zos,varlen", [(1, False, False), (2, True, True), (5, True, False)])
def test_greedy_output_equals_plain_decoding(model_dir, workload, plain, drafts, zos, varlen):
    outs, metrics = run(model_dir, *workload, drafts=drafts, zos=zos, varlen=varlen)
    assert [o.token_ids for o in outs] == plain
    spec = metrics["speculative"]
    assert metrics["draft_graph_steps"] == 0  # no CUDA here: drafting ran eagerly, and the summary says so
    assert spec["draft_tokens"] > 0 and spec["draft_tokens"] == sum(o.num_draft_tokens for o in outs)
    assert spec["accepted_tokens"] == sum(o.num_accepted_tokens for o in outs)


@pytest.mark.slow
@pytest.mark.parametrize("drafts,zos,varlen", [(3, False, True), (4, True, False), (5, False, True)])
def test_greedy_output_equals_plain_decoding_more_layouts(model_dir, workload, plain, drafts, zos, varlen):
    outs, _ = run(model_dir, *workload, drafts=drafts, zos=zos, varlen=varlen)
    assert [o.token_ids for o in outs] == plain


@pytest.mark.parametrize("zos", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_greedy_with_preemption_equals_plain_decoding(model_dir, workload, plain, zos):
    outs, metrics = run(model_dir, *workload, drafts=4, zos=zos, budget=small_budget(model_dir, 4),
                        batched_tokens=64)
    assert metrics["preemptions"] > 0
    assert [o.token_ids for o in outs] == plain


def test_a_drafter_that_copies_the_target_has_every_draft_accepted(model_dir, workload, plain):
    prompts, params = workload
    reference = {tuple(p): out for p, out in zip(prompts, plain)}

    def copy(ids, num_prompt, drafts):  # the target's own continuation after the token just sampled
        out = reference[tuple(ids[:num_prompt])]
        done = len(ids) - num_prompt
        return (out[done:] + [0] * len(drafts))[: len(drafts)]

    outs, metrics = run(model_dir, prompts, params, drafts=5, zos=True, override=copy)
    assert [o.token_ids for o in outs] == plain
    spec = metrics["speculative"]
    # every draft that lies inside the reference output is accepted; only the padding past its end can fail
    for o in outs:
        assert o.num_accepted_tokens >= o.num_draft_tokens - 5, (o.num_accepted_tokens, o.num_draft_tokens)
    assert spec["acceptance_rate"] > 0.9 and spec["mean_accepted_length"] > 3
    assert metrics["steps"] < 0.5 * sum(len(t) for t in plain)


def test_a_drafter_that_is_always_wrong_has_nothing_accepted(model_dir, workload, plain):
    prompts, params = workload
    reference = {tuple(p): out for p, out in zip(prompts, plain)}

    def wrong(ids, num_prompt, drafts):
        out = reference[tuple(ids[:num_prompt])]
        done = len(ids) - num_prompt
        nxt = (out[done:] + [0])[0]
        return [(nxt + 1) % VOCAB] * len(drafts)  # the first draft is never the target's token

    outs, metrics = run(model_dir, prompts, params, drafts=3, override=wrong)
    assert [o.token_ids for o in outs] == plain
    assert metrics["speculative"]["accepted_tokens"] == 0 and metrics["speculative"]["draft_tokens"] > 0


def test_structured_outputs_with_drafts_stay_valid_and_equal_plain(model_dir):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "b": {"enum": ["x", "y"]}}, "required": ["a", "b"]}
    so = {"schema_type": "json", "schema": schema}
    prompts = [[5 + i, 17, 40 + i] for i in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=200, so_args=so) for _ in prompts]
    plain, _ = run(model_dir, prompts, params)
    spec, metrics = run(model_dir, prompts, params, drafts=3, zos=True)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert metrics["speculative"]["draft_tokens"] > 0
    tok = load_model(model_dir).tokenizer
    finished = [o for o in spec if o.finish_reason == "stop"]
    assert finished  # a random model may ramble inside a string up to max_tokens; what ends must be valid
    for o in finished:
        jsonschema.validate(json.loads(tok.decode(o.token_ids, skip_special_tokens=True)), schema)


# ---- sampling: the target's distribution, reproducible ------------------------------------------------------------
def test_verification_draws_from_the_target_distribution():
    """Chi-square goodness of fit of the first token verification emits, over many seeds, against p_0; the draft
    distribution q is far from p (and one draft is drawn from q with the DRAFT uniform, as the drafter does)."""
    from deepinfer.sampling.fixed_point import draw_from_weights, fixed_point_weights
    from deepinfer.sampling.seeds import DrawKind, uniform

    V, n = 6, 6000
    p_logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.0, 0.0, 3.0, 0.0, 0.0, 0.0]])
    q_logits = torch.tensor([[0.0, 2.5, 0.0, 1.0, 0.0, -2.0]])
    p = fixed_point_weights(p_logits)
    q = fixed_point_weights(q_logits)
    counts = [0] * V
    for seed in range(n):
        d = draw_from_weights(q, [uniform(seed, 0, DrawKind.DRAFT)])[0]
        verdict = accept_sampled(p, [q[0]], [d], seed, 0)
        counts[verdict.tokens[0]] += 1
    probs = torch.softmax(p_logits[0].double(), -1).tolist()
    chi2 = sum((c - n * pr) ** 2 / (n * pr) for c, pr in zip(counts, probs))
    assert chi2 < 20.5, (chi2, counts)  # 5 degrees of freedom: p = 0.001


def test_a_batched_verification_gives_each_sampled_request_its_own_verdict():
    """accept_sampled_rows (one read of the tests' integers, one batched draw) against accept_sampled request by
    request: the same accepted drafts and last token, over requests of 0-5 drafts, q near p or far from it, drafts
    drawn from q or not, and point masses (q None: drafts chosen deterministically)."""
    from deepinfer.sampling.fixed_point import fixed_point_weights
    from deepinfer.sampling.speculative import SampledDrafts, accept_sampled_rows

    rng, g, V = random.Random(0), torch.Generator().manual_seed(0), 300
    seen = set()
    for _ in range(120):
        batch, ps, want = [], [], []
        for _ in range(rng.randint(1, 6)):
            k = rng.randint(0, 5)
            logits = torch.randn(k + 1, V, generator=g) * rng.choice([0.5, 2, 6])
            p = fixed_point_weights(logits)
            qs, drafts = [], []
            for j in range(k):
                if rng.random() < 0.3:
                    q, d = None, int(p[j].argmax()) if rng.random() < 0.5 else rng.randrange(V)
                else:
                    q = fixed_point_weights(logits[j : j + 1] + torch.randn(1, V, generator=g) * rng.choice([0.01, 3]))[0]
                    d = int(torch.multinomial(q.double(), 1, generator=g)) if rng.random() < 0.8 else rng.randrange(V)
                qs.append(q)
                drafts.append(d)
            q_list = None if k and rng.random() < 0.2 else qs
            seed, pos = rng.randrange(1 << 40), rng.randrange(1000)
            want.append(accept_sampled(p, q_list, drafts, seed, pos))
            batch.append(SampledDrafts(drafts, q_list, seed, pos))
            ps.append(p)
        got = accept_sampled_rows(torch.cat(ps), batch)
        assert [(v.tokens, v.rows, v.num_accepted) for v in got] == [(v.tokens, v.rows, v.num_accepted) for v in want]
        seen |= {(len(b.drafts), v.num_accepted) for b, v in zip(batch, want)}
    assert {(0, 0), (3, 0), (3, 1), (3, 3), (5, 5)} <= seen  # rejections at every place, and whole acceptances


def test_seeded_sampling_with_drafts_is_the_same_alone_and_in_any_batch(model_dir):
    rng = random.Random(9)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 40))] for _ in range(8)]
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, seq_seed=1000 + i) for i in range(8)]
    batched, metrics = run(model_dir, prompts, params, drafts=4, zos=True)
    assert metrics["speculative"]["draft_tokens"] > 0
    alone = [run(model_dir, [p], [sp], drafts=4)[0][0] for p, sp in zip(prompts[:3], params[:3])]
    reordered, _ = run(model_dir, prompts[::-1], params[::-1], drafts=4)
    assert [o.token_ids for o in alone] == [o.token_ids for o in batched[:3]]
    assert [o.token_ids for o in reordered[::-1]] == [o.token_ids for o in batched]


def test_sampled_tokens_with_drafts_follow_plain_sampling(model_dir):
    """The engine end to end: the second token's distribution (the first one verification decides) over many
    seeds, with and without drafts, at a temperature that keeps it on few tokens; a two-sample chi-square."""
    prompt = [7, 21, 300, 44]
    n = 300
    ps = [SamplingParams(temperature=0.3, max_tokens=3, ignore_eos=True, seq_seed=s) for s in range(n)]
    plain, _ = run(model_dir, [prompt] * n, ps)
    spec, metrics = run(model_dir, [prompt] * n, [SamplingParams(temperature=0.3, max_tokens=3, ignore_eos=True,
                                                                 seq_seed=10_000 + s) for s in range(n)], drafts=2)
    assert metrics["speculative"]["draft_tokens"] > 0
    a = [o.token_ids[1] for o in plain]
    b = [o.token_ids[1] for o in spec]
    tokens = sorted(set(a) | set(b))
    chi2, dof = 0.0, -1
    for t in tokens:
        ca, cb = a.count(t), b.count(t)
        if ca + cb >= 10:
            dof += 1
            chi2 += (ca - cb) ** 2 / (ca + cb)
    assert dof >= 1
    # chi-square critical value at p = 0.001 (Wilson-Hilferty approximation)
    crit = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < crit, (chi2, dof, crit)


def test_drafting_by_graph_replay_equals_eager_drafting(model_dir):
    """DraftGraphs (here with the captured graph replaced by re-running what was captured, no CUDA): static
    inputs, padding rows in the spare slot, batch buckets; the drafts and confidences equal eager drafting."""
    from emulated_graphs import RerunDraftGraphs

    model = load_model(model_dir)
    rng = random.Random(5)
    states = [model.new_state(6, drafts=True) for _ in range(5)]
    pools = states[0].pools
    for st in states:
        model.forward(ForwardBatch([[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 60))]], [st]))
    graphs = RerunDraftGraphs(model.drafter, pools, max_batch=8, interval=4, block=5, vocab=model.config.vocab_size)
    for batch in (1, 3, 5):
        chosen = states[:batch]
        golden = [rng.randrange(3, VOCAB) for _ in chosen]
        slots, last = [s.slot for s in chosen], [s.num_tokens - 1 for s in chosen]
        tokens, conf = graphs.run(golden, slots, last)
        step = model.drafter.step(torch.tensor(slots), torch.tensor(last), 5, pools)
        want = model.drafter.draft(torch.tensor(golden), step, pools, lambda i, lg: lg.argmax(-1))
        assert torch.equal(tokens, want.tokens) and torch.equal(conf, want.confidences), batch
    assert graphs.replays == 3 and set(graphs._graphs) == {(1, "greedy"), (4, "greedy"), (8, "greedy")}


# ---- configuration -----------------------------------------------------------------------------------------------
def test_dspark_config_env_and_rules(monkeypatch):
    from deepinfer.api import load_settings
    from deepinfer.config.errors import ConfigError
    from deepinfer.config.env_vars import unhonoured

    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "3")
    monkeypatch.setenv("DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE", "0.5,1,1.5")
    s = load_settings(["decoding=dspark"])
    assert s.decoding.num_draft_tokens == 3 and s.decoding.confidence_temperature == [0.5, 1.0, 1.5]
    assert s.decoding.max_rollback == 4
    monkeypatch.setenv("DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE", "1,2")
    with pytest.raises(ConfigError, match="DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE"):
        load_settings(["decoding=dspark"])
    monkeypatch.delenv("DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE")
    with pytest.raises(ConfigError, match="batch_invariant"):
        load_settings(["decoding=dspark", "decoding.varlen=true", "runtime.batch_invariant=true"])
    env = {"DEEPINFER_USE_NEXTN_DECODE": "5", "DEEPINFER_NCCL_NUM_SMS": "32", "DEEPINFER_BATCH_INVARIANT": "1"}
    assert unhonoured(env, "plain") == [("DEEPINFER_NCCL_NUM_SMS", "not honoured by this project (DeepInfer 0.1.0 reads it)"),
                                        ("DEEPINFER_USE_NEXTN_DECODE", "ignored with decoding=plain; it configures decoding=dspark")]
    assert [n for n, _ in unhonoured(env, "dspark")] == ["DEEPINFER_NCCL_NUM_SMS"]


def test_unhonoured_variables_are_named_in_one_warning_each(monkeypatch, caplog):
    from deepinfer.config import env_vars

    monkeypatch.setenv("DEEPINFER_SHOW_EPLB_DETAIL", "1")
    monkeypatch.setattr(env_vars, "_warned", set())
    with caplog.at_level("WARNING", logger="deepinfer.config"):
        env_vars.warn_unhonoured("plain")
        env_vars.warn_unhonoured("plain")
    lines = [r.getMessage() for r in caplog.records if "DEEPINFER_SHOW_EPLB_DETAIL" in r.getMessage()]
    assert lines == ["DEEPINFER_SHOW_EPLB_DETAIL is set but not honoured by this project (DeepInfer 0.1.0 reads it)"]


def test_dspark_needs_draft_layers(tmp_path):
    fixture = __import__("pathlib").Path(__file__).parent / "fixtures" / "deepseek_v41" / "tiny-swa-csa2"
    settings = settings_for(fixture, "decoding=dspark", "decoding.num_draft_tokens=5", process="inproc",
                            memory_budget=1 << 24)
    with pytest.raises(ValueError, match="draft layers"):
        LLMEngine.for_settings(settings)


def test_backtracking_rows_are_kept_with_any_decoding(monkeypatch):
    """DEEPINFER_MAX_BACKTRACKING_TOKENS reaches the engine's caches with plain decoding too; with DSpark the
    caches keep max(it, drafts + 1) rows (DeepInfer's rule)."""
    from deepinfer.api import load_settings

    monkeypatch.setenv("DEEPINFER_MAX_BACKTRACKING_TOKENS", "7")
    for overrides, rows in ((["decoding=plain"], 7), (["decoding=dspark"], 7), (["decoding=dspark",
                                                                                "decoding.num_draft_tokens=8"], 9)):
        s = load_settings(overrides)
        opts = EngineOptions.for_settings(s)
        assert opts.max_rollback == s.decoding.max_rollback == rows, overrides
