"""The one resolve step: composed DictConfig -> checked, `auto`-free, frozen `Settings`.

Everything that turns a value the user wrote into the concrete choice the program uses happens here, in this
order, before any weight is read:
  1. every key is known and every value has its schema type (unknown keys added with `+key=` included);
  2. every value is in its declared range (schema.py `allowed`);
  3. hardware: `auto` becomes the detected preset, and a preset whose hardware is absent stops the run;
  4. dtypes: model.dtype `auto` becomes the hardware's dtype;
  5. memory: cache.memory_limit null becomes memory_fraction of the device's total memory (weights included);
  6. the parallel layout: data_parallel_size 0 becomes EP / CP, and the layout's rules (EP divides CP x DP);
  7. cache.prefix_caching null becomes on (a prefix hit is exact in every layout the engine runs);
  8. the pipeline names only registered components, in stage order.
What needs the model itself (engine.max_model_len null -> max_position_embeddings) is `with_model_limits`, called
by the program builder right after the model's config.json is read.
"""

from __future__ import annotations

import dataclasses
import typing
from importlib import resources

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from deepinfer.config import env_vars
from deepinfer.config import hardware as hw
from deepinfer.config import layout
from deepinfer.config.components import REGISTRY
from deepinfer.config.errors import ConfigError, explain, fmt
from deepinfer.config.keys import strip_optional
from deepinfer.config.schema import STAGES, HardwareSettings, Interval, ParallelSettings, Settings
from deepinfer.kernels.tilelang._build import pdl_enabled

REQUIRED_STAGES = ("tokenize", "prefill", "decode", "sample")


def resolve(cfg: DictConfig, found: hw.Found | None = None) -> Settings:
    """Check `cfg` and freeze it. `found`: the detected hardware (detected here when None)."""
    try:
        data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as exc:
        raise explain(exc) from None
    data.pop("hydra", None)
    settings = _build(Settings, data, "")
    found = found or hw.detect()
    settings = _resolve_hardware(settings, found)
    settings = _resolve_dtype(settings)
    settings = _resolve_memory(settings, found)
    settings = _resolve_decoding(settings)
    settings = _resolve_parallel(settings)
    settings = _resolve_prefix_caching(settings)
    _check_pipeline(settings)
    env_vars.warn_unhonoured(settings.decoding.name, settings.parallel.world_size)
    try:
        pdl_enabled()  # DEEPINFER_PDL: a bad value is a one-line error here, not the first kernel's build failing
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return settings


def _resolve_parallel(s: Settings) -> Settings:
    """data_parallel_size 0 -> EP / CP (DeepInfer's rule), then what a layout needs: EP divides CP x DP (DeepInfer's
    rule), parts the engine cannot run yet are refused (never run as something else), EPLB only with EP > 1."""
    p = s.parallel
    cp, ep = p.context_parallel_size, p.expert_parallel_size
    dp = layout.resolved_data_parallel_size(p.data_parallel_size, ep, cp)
    p = dataclasses.replace(p, data_parallel_size=dp)
    if (cp * dp) % ep:
        raise ConfigError(f"parallel.expert_parallel_size={ep} does not divide context_parallel_size x "
                          f"data_parallel_size = {cp} x {dp} = {cp * dp} ranks (DeepInfer's rule: the experts are "
                          f"sharded over groups of EP ranks); allowed: a divisor of {cp * dp}")
    if cp > 1:
        why = layout.context_parallel_refusal(cp, dp, ep, s.decoding.name, s.decoding.num_draft_tokens, s.yoco.mode,
                                              p.eplb.interval)
        if why is not None:
            raise ConfigError(why)
    e = p.eplb
    if ep == 1 and (e.redundant_experts or e.interval):
        key, value = ("redundant_experts", e.redundant_experts) if e.redundant_experts else ("interval", e.interval)
        raise ConfigError(f"parallel.eplb.{key}={value} with parallel.expert_parallel_size=1: one rank holds every "
                          "expert, there is nothing to balance; allowed: 0 (or a layout with expert parallelism)")
    if e.interval and not 1 <= e.window <= e.interval:
        raise ConfigError(f"parallel.eplb.window={e.window} (DEEPINFER_EXPERT_COUNT_WINDOW_SIZE) is out of range with "
                          f"parallel.eplb.interval={e.interval}; allowed: [1, {e.interval}] (DeepInfer's rule)")
    world = p.world_size
    if world == 1 and p.timeout != ParallelSettings().timeout:
        raise ConfigError(f"parallel.timeout={p.timeout:g} with one rank: it has no collective to time out; allowed: "
                          "a layout with more than one rank")
    if world > 1:
        if s.engine.process != "subprocess":
            raise ConfigError(f"engine.process={s.engine.process!r} with parallel={p.name} ({world} ranks): every "
                              "rank runs its engine core in its own process; allowed: 'subprocess'")
        if s.hardware.device not in ("cpu", "cuda"):
            raise ConfigError(f"parallel={p.name} ({world} ranks) on device {s.hardware.device!r}: no process-group "
                              "backend for it; allowed devices: cpu (gloo), cuda (NCCL)")
    return dataclasses.replace(s, parallel=p)


def _resolve_prefix_caching(s: Settings) -> Settings:
    """cache.prefix_caching null -> on: a cache hit is exact in every layout the engine runs. Under YOCO a hit ends
    at or before the request's rectangle (the scheduler's replay_keep), so the truncated decoder-layer rows a
    checkpoint holds are never read; with data parallelism each rank's engine core keeps its own cache (a hit is
    local to the rank a request lands on); with context parallelism every rank of a replica runs the same scheduler
    on the same requests, so they make the same hits, and every rank's pools hold every chunk."""
    c = s.cache
    if c.prefix_caching is None:
        c = dataclasses.replace(c, prefix_caching=True)
    return dataclasses.replace(s, cache=c)


def _resolve_decoding(s: Settings) -> Settings:
    """DSpark's confidence temperatures from the environment; the rules DeepInfer states (batch invariance needs
    fixed verification lengths)."""
    d = s.decoding
    if d.name != "dspark":
        return s
    if d.varlen and s.runtime.batch_invariant:
        raise ConfigError("decoding.varlen=true (DEEPINFER_ENABLE_MTP_VARLEN) with runtime.batch_invariant=true "
                          "(DEEPINFER_BATCH_INVARIANT): verification lengths chosen from measured step times make "
                          "outputs depend on the batch; allowed: varlen=false with batch invariance")
    temps = env_vars.confidence_temperatures(d.confidence_temperature, d.num_draft_tokens)
    return dataclasses.replace(s, decoding=dataclasses.replace(d, confidence_temperature=temps))


def rebuild(data: dict) -> Settings:
    """Settings that were resolved elsewhere and sent as plain data (msgspec.to_builtins: the engine core's
    start-up message): field types checked by msgspec against the schema, keys and ranges by the same builder as
    `resolve`, lists back to tuples. Hardware, dtypes and memory are already concrete: nothing is resolved twice."""
    import msgspec

    msgspec.convert(data, Settings)  # types (a ValidationError names the path)
    return _build(Settings, data, "")


def with_model_limits(settings: Settings, max_position_embeddings: int) -> Settings:
    """engine.max_model_len null -> the model's limit; a larger explicit value is an error."""
    limit = settings.engine.max_model_len
    if limit is not None and limit > max_position_embeddings:
        raise ConfigError(
            f"engine.max_model_len={limit} is out of range; allowed: [1, {max_position_embeddings}] "
            "(the model's max_position_embeddings)"
        )
    engine = dataclasses.replace(settings.engine, max_model_len=limit or max_position_embeddings)
    if not engine.chunked_prefill and engine.max_num_batched_tokens < engine.max_model_len:
        raise ConfigError(
            f"engine.max_num_batched_tokens={engine.max_num_batched_tokens} is out of range with "
            f"engine.chunked_prefill=false; allowed: at least engine.max_model_len ({engine.max_model_len}), so "
            "every prompt prefills in one step (or chunked_prefill=true, or a smaller max_model_len)"
        )
    return dataclasses.replace(settings, engine=engine)


def max_backtracking_tokens(decoding) -> int:
    """The most tokens the engine may roll back (DecodingSettings.max_rollback: DeepInfer's
    max(DEEPINFER_MAX_BACKTRACKING_TOKENS, drafts + 1) with DSpark), at least 1."""
    return max(1, decoding.max_rollback)


def check_replay_fits(settings: Settings, sliding_window: int) -> None:
    """YOCO: K >= the model's sliding window + max backtracking tokens, so that after a rollback every decoder
    layer's window still lies in rows that were replayed (MODEL_V41_SPEC.md §7)."""
    y = settings.yoco
    if y.mode == "off":
        return
    back = max_backtracking_tokens(settings.decoding)
    if y.keep_tokens < sliding_window + back:
        raise ConfigError(
            f"yoco.keep_tokens={y.keep_tokens} (DEEPINFER_YOCO_PREFILL_KEEP_TOKENS) is out of range; allowed: at "
            f"least sliding_window ({sliding_window}) + max backtracking tokens ({back}) = {sliding_window + back} "
            f"for this model"
        )


# ---- 1 + 2: structure, types, ranges ------------------------------------------------------------------------
def _build(cls, data: dict, path: str):
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = f"{path}{unknown[0]}"
        where = f"in {path[:-1]!r}" if path else "at the top level"
        raise ConfigError(
            f"{key}={fmt(data[unknown[0]])}: unknown config key {unknown[0]!r}; allowed {where}: "
            + ", ".join(fields)
        )
    values = {}
    for name, f in fields.items():
        if name not in data:
            continue
        values[name] = _value(hints[name], data[name], f"{path}{name}")
        _check_allowed(f"{path}{name}", values[name], f.metadata.get("allowed"))
    return cls(**values)


def _value(tp, value, key: str):
    if value is None:
        return None
    base = strip_optional(tp)
    if dataclasses.is_dataclass(base):
        return _build(base, value, key + ".")
    origin = typing.get_origin(base)
    if origin is dict:
        inner = typing.get_args(base)[1]
        return {k: _value(inner, v, f"{key}.{k}") for k, v in value.items()}
    if origin is list:
        inner = typing.get_args(base)[0]
        return tuple(_value(inner, v, f"{key}[{i}]") for i, v in enumerate(value))
    return value


def _check_allowed(key: str, value, allowed) -> None:
    if allowed is None or value is None:
        return
    if isinstance(allowed, tuple):
        if value not in allowed:
            raise ConfigError(f"{key}={fmt(value)} is not allowed; allowed: {', '.join(map(str, allowed))}")
    elif isinstance(allowed, Interval) and not allowed.contains(value):
        raise ConfigError(f"{key}={fmt(value)} is out of range; allowed: {allowed}")


# ---- 3: hardware --------------------------------------------------------------------------------------------
def _preset(name: str) -> HardwareSettings:
    text = (resources.files("deepinfer.conf") / "hardware" / f"{name}.yaml").read_text()
    return _build(HardwareSettings, OmegaConf.to_container(OmegaConf.create(text)), "hardware.")


def _resolve_hardware(s: Settings, found: hw.Found) -> Settings:
    h = s.hardware
    if h.name == "auto" or h.device == "auto":
        preset = _preset(found.preset)
        h = dataclasses.replace(
            preset,
            dtype=preset.dtype if h.dtype == "auto" else h.dtype,
            strict_backends=h.strict_backends,
        )
    if h.dtype == "auto":
        h = dataclasses.replace(h, dtype=_preset(h.name).dtype if h.name != "auto" else "float32")
    if not hw.fits(h.name, h.device, h.cuda_major, found):
        needs = hw.NEEDS.get(h.name, f"device {h.device!r}")
        asked = f"recipe {s.recipe}" if s.recipe else f"hardware={h.name}"
        would = hw.RECIPE_FOR.get(found.preset, "tiny_cpu")
        raise ConfigError(f"{asked} needs {needs}; found: {found.description}; this machine runs +recipe={would}")
    return dataclasses.replace(s, hardware=h)


# ---- 4 + 5: dtypes and memory -------------------------------------------------------------------------------
def _resolve_dtype(s: Settings) -> Settings:
    if s.model.dtype != "auto":
        return s
    return dataclasses.replace(s, model=dataclasses.replace(s.model, dtype=s.hardware.dtype))


def _resolve_memory(s: Settings, found: hw.Found) -> Settings:
    """cache.memory_limit null -> memory_fraction x the device's total memory (the one meaning of the fraction:
    all the engine may use, weights included, as vLLM's gpu_memory_utilization); the engine core gives the caches
    what the model leaves of it. Byte counts beyond the device's memory are refused."""
    total = hw.device_memory_bytes(s.hardware.device, found)
    c = s.cache
    # Caches beyond the device's memory can never be filled, and their bookkeeping alone was measured at
    # ~1 GB per 1e12 bytes of budget: a byte count is bounded by the memory it stands for.
    for key in ("memory_budget", "memory_limit"):
        value = getattr(c, key)
        if value is not None and total is not None and value > total:
            raise ConfigError(f"cache.{key}={value} is out of range; allowed: at most the {s.hardware.device} "
                              f"device's memory ({total} bytes)")
    if c.memory_limit is None and total is not None:
        c = dataclasses.replace(c, memory_limit=int(total * c.memory_fraction))
    if c.memory_budget is None and c.memory_limit is None:
        raise ConfigError(f"cache.memory_fraction={c.memory_fraction}: the {s.hardware.device} device's memory is "
                          "unknown on this machine; allowed: set cache.memory_budget (bytes for the caches) or "
                          "cache.memory_limit (bytes the engine may use)")
    return dataclasses.replace(s, cache=c)


# ---- 6: pipeline --------------------------------------------------------------------------------------------
def _check_pipeline(s: Settings) -> None:
    stages = s.pipeline.stages
    names = list(stages)
    for name in names:
        if name not in STAGES:
            raise ConfigError(f"pipeline.stages.{name}: unknown stage; allowed: {', '.join(STAGES)}")
    order = [n for n in STAGES if n in stages]
    if names != order:
        raise ConfigError(f"pipeline.stages are in the order {names}; allowed order: {', '.join(STAGES)}")
    for name in REQUIRED_STAGES:
        if name not in stages or stages[name].component is None:
            raise ConfigError(f"pipeline.stages.{name}.component is required; allowed: {REGISTRY.names(name)}")
    replay = stages.get("replay")
    component = replay.component if replay is not None else None
    if s.yoco.mode == "off" and component is not None:
        raise ConfigError(
            f"pipeline.stages.replay.component={component!r} needs YOCO; allowed with yoco=off: null"
        )
    if s.yoco.mode != "off":  # the replay stage is what runs the mode: it must be there, and agree on K
        want = f"yoco_{s.yoco.mode}"
        if component != want:
            raise ConfigError(f"yoco.mode={s.yoco.mode} needs pipeline.stages.replay.component={want!r}, found "
                              f"{component!r}; select the mode with yoco={s.yoco.mode} (or "
                              "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE), which sets both")
        k = replay.options.get("keep_tokens")
        if k != s.yoco.keep_tokens:
            raise ConfigError(f"pipeline.stages.replay.options.keep_tokens={k} differs from yoco.keep_tokens="
                              f"{s.yoco.keep_tokens}; allowed: set yoco.keep_tokens (DEEPINFER_YOCO_PREFILL_KEEP_TOKENS)")
    for name, spec in stages.items():
        if spec.component is not None and not REGISTRY.has(name, spec.component):
            raise ConfigError(
                f"pipeline.stages.{name}.component={spec.component!r} is not a registered {name} component; "
                f"allowed: {', '.join(REGISTRY.names(name)) or 'none yet'}"
            )
