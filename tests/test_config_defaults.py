"""One set of defaults: SamplingParams' (DeepInfer's) are what the config's `sampling` section, the CLI and
LLM.generate use; EngineSettings' are what EngineOptions uses; conf/config.yaml restates none of them."""

import dataclasses

from omegaconf import OmegaConf

from deepinfer.api import load_settings
from deepinfer.config.resolve import ConfigError
from deepinfer.config.schema import CacheSettings, EngineSettings, RuntimeSettings, SamplingDefaults, Settings
from deepinfer.engine.options import EngineOptions
from deepinfer.sampling.params import SamplingParams


def _defaults(cls) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def test_the_sampling_section_defaults_are_sampling_params_own():
    ours, schema = _defaults(SamplingParams), _defaults(SamplingDefaults)
    assert {k: v for k, v in schema.items() if not k.startswith("xgrammar_")} == {
        k: v for k, v in ours.items() if k != "so_args"}
    # with any model but the embedded default, whose group sets the defaults it is meant for (test_default_model.py)
    composed = load_settings(["model=tiny_random"]).sampling.params()
    assert composed == SamplingParams()  # temperature 1.0, max_tokens 16, seq_seed None: DeepInfer's


def test_engine_options_have_no_defaults_of_their_own_only_the_schemas():
    assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
               for f in dataclasses.fields(EngineOptions))
    options = EngineOptions.for_settings(Settings())
    for cls, names in ((EngineSettings, ("max_num_seqs", "max_num_batched_tokens", "max_model_len",
                                         "zero_overhead_scheduling", "process")),
                       (CacheSettings, ("memory_budget", "memory_limit", "block_size")),
                       (RuntimeSettings, ("seed", "enforce_eager", "cudagraph_batch_size_interval"))):
        schema = _defaults(cls)
        assert {n: getattr(options, n) for n in names} == {n: schema[n] for n in names}, cls.__name__
    engine = _defaults(EngineSettings)
    for key in ("heartbeat_timeout", "step_timeout", "startup_timeout", "liveness_poll", "heartbeat_interval",
                "send_timeout", "close_grace"):
        assert getattr(options, f"{key}_s") == engine[key], key
    sampling = _defaults(SamplingDefaults)
    limits = dict(options.grammar_limits)
    assert limits == {("timeout_s" if k == "xgrammar_timeout" else k[len("xgrammar_"):]): v
                      for k, v in sampling.items() if k.startswith("xgrammar_")}
    # every grammar limit is a keyword of the compiler pool that applies it
    import inspect

    from deepinfer.sampling.grammar import GrammarCompilerPool

    assert set(limits) <= set(inspect.signature(GrammarCompilerPool).parameters)


def test_engine_options_name_their_settings_and_draft_with_dspark_only():
    # every field names the setting it comes from (for_settings fails on a path Settings lacks)
    assert all(f.metadata.get("setting") for f in dataclasses.fields(EngineOptions))
    drafts = ["decoding.num_draft_tokens=4", "decoding.varlen=true", "decoding.confidence_temperature=[0.5,2.0]"]
    plain = EngineOptions.for_settings(load_settings(["model=tiny_random", "decoding=plain", *drafts]))
    dspark = EngineOptions.for_settings(load_settings(["model=tiny_random", "decoding=dspark", *drafts]))
    assert (plain.num_draft_tokens, plain.spec_varlen) == (0, False)
    assert (dspark.num_draft_tokens, dspark.spec_varlen) == (4, True)
    assert plain.confidence_temperature == dspark.confidence_temperature == (0.5, 2.0)  # a tuple: hashable, frozen


def test_config_yaml_restates_no_sampling_default():
    from importlib import resources

    cfg = OmegaConf.create((resources.files("deepinfer.conf") / "config.yaml").read_text())
    assert set(cfg.sampling) <= {"xgrammar_timeout", "xgrammar_cache_limit_bytes"}


# conf/config.yaml keys that differ from the schema's default on purpose (the value, and why in the YAML)
YAML_ON_PURPOSE = {"runtime.num_threads": 1}


def _leaves(node, prefix=""):
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _schema_default(dotted: str):
    from deepinfer.config.schema import Settings

    cls, parts = Settings, dotted.split(".")
    for part in parts[:-1]:
        cls = {f.name: f for f in dataclasses.fields(cls)}[part].default_factory
    return _defaults(cls)[parts[-1]]


def test_config_yaml_restates_no_schema_default_and_its_env_fallbacks_are_the_schemas():
    """The schema is the one typed source of the defaults: config.yaml holds only ${oc.env:NAME,fallback}
    interpolations whose fallback is the schema's default, and the keys of YAML_ON_PURPOSE."""
    import re
    from importlib import resources

    import yaml

    raw = yaml.safe_load((resources.files("deepinfer.conf") / "config.yaml").read_text())
    keys = {k: v for k, v in raw.items() if k not in ("defaults", "hydra")}
    seen = set()
    for key, value in _leaves(keys):
        default = _schema_default(key)
        env = re.fullmatch(r"\$\{oc\.env:(\w+),(.*)\}", value) if isinstance(value, str) else None
        if env:
            fallback = yaml.safe_load(env.group(2))
            assert fallback == default and type(fallback) in (type(default), int), (key, fallback, default)
            assert env.group(1).startswith("DEEPINFER_"), key
        else:
            assert key in YAML_ON_PURPOSE, f"conf/config.yaml restates {key}={value!r}: the schema declares it"
            assert value == YAML_ON_PURPOSE[key] != default, (key, value, default)
            seen.add(key)
    assert seen == set(YAML_ON_PURPOSE)
    # and what a run sees is the schema's default wherever the YAML says nothing
    s = load_settings([])
    for cls, section in ((EngineSettings, s.engine), (CacheSettings, s.cache)):
        schema = _defaults(cls)
        for name, value in schema.items():
            got = getattr(section, name)
            if name == "memory_limit":  # null is resolved from memory_fraction in the resolve step
                assert value is None and got is not None
            elif name == "prefix_caching":  # null is resolved to on where it is exact (the default run: it is)
                assert value is None and got is True
            elif name != "zero_overhead_scheduling":  # read from the environment
                assert got == value, (cls.__name__, name)


def test_chunked_prefill_false_needs_a_step_that_holds_the_longest_prompt():
    from deepinfer.config.resolve import with_model_limits

    s = load_settings(["engine.chunked_prefill=false", "engine.max_num_batched_tokens=64"])
    try:
        with_model_limits(s, 4096)
    except ConfigError as exc:
        assert str(exc).startswith("engine.max_num_batched_tokens=64 is out of range with engine.chunked_prefill=false")
    else:
        raise AssertionError("no error")
    assert with_model_limits(s, 64).engine.max_num_batched_tokens == 64
