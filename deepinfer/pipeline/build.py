"""From typed settings to a StepProgram: load the model and sampler, then instantiate each configured stage."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from deepinfer.config.components import REGISTRY
from deepinfer.config.errors import ConfigError
from deepinfer.config.resolve import check_replay_fits, with_model_limits
from deepinfer.config.schema import STAGES, PipelineSettings, Settings
from deepinfer.pipeline.program import StageInfo, StepProgram


def build_program(pipeline: PipelineSettings, model, sampler) -> StepProgram:
    """Instantiate each stage of `pipeline` (in declared order) with its registered component. A stage whose
    component is null is absent. A component that cannot serve the model's device or chosen kernel backends is
    a ConfigError naming both."""
    device = _device_type(model)
    chosen = sorted(set(getattr(getattr(model, "ops", None), "chosen", {}).values()))
    impls, infos = {}, []
    for name, spec in pipeline.stages.items():
        if spec.component is None:
            continue
        comp = REGISTRY.get(name, spec.component)
        if device not in comp.devices:
            raise ConfigError(
                f"pipeline.stages.{name}.component={comp.name!r} cannot run on device {device!r}; "
                f"allowed devices: {', '.join(comp.devices)}"
            )
        unsupported = [b for b in chosen if not comp.supports(b)]
        if unsupported:
            raise ConfigError(
                f"pipeline.stages.{name}.component={comp.name!r} does not support kernel backend(s) "
                f"{', '.join(unsupported)}; allowed: {', '.join(comp.backends)}"
            )
        options = dict(spec.options)
        unknown = sorted(set(options) - set(comp.option_names()))
        if unknown:
            raise ConfigError(
                f"pipeline.stages.{name}.options.{unknown[0]}: not an option of component {comp.name!r}; "
                f"allowed: {', '.join(comp.option_names()) or 'none'}"
            )
        impls[name] = comp.load(options)(model, sampler)
        infos.append(StageInfo(name, comp.name, options))
    order = [s.name for s in infos]
    if order != [s for s in STAGES if s in impls]:
        raise ConfigError(f"pipeline stages in order {order}; allowed order: {', '.join(STAGES)}")
    return StepProgram(
        stages=tuple(infos),
        tokenize=impls["tokenize"],
        prefill=impls["prefill"],
        decode=impls["decode"],
        sample=impls["sample"],
        model=model,
        replay=impls.get("replay"),
    )


def load_program(settings: Settings, weights: bool = True) -> tuple[StepProgram, Settings]:
    """Load the configured model and build its program. Returns the settings completed with what the model
    decides (engine.max_model_len). With `weights=False` the checkpoint is checked and its tokenizer loaded but
    its weights are not: a frontend whose engine-core process runs the model needs no more."""
    import torch

    from deepinfer.config.hardware import set_cpu_threads
    from deepinfer.models import load_model
    from deepinfer.sampling.sampler import Sampler

    model_dir = model_location(settings.model.path)
    hw, rt = settings.hardware, settings.runtime
    set_cpu_threads(rt.num_threads)
    model = load_model(
        model_dir,
        device=hw.device,
        dtype=getattr(torch, settings.model.dtype),
        backends={kind: list(names) for kind, names in hw.backends.items()},
        strict_backends=hw.strict_backends,
        batch_invariant=rt.batch_invariant,
        weights=weights,
        # the draft layers take memory (~7 GB at V4.1-Flash size): loaded only when DSpark will use them
        draft_layers=settings.decoding.name == "dspark" and settings.decoding.num_draft_tokens > 0,
        # dummy: random weights drawn with DeepInfer's seed (runtime.seed; 0 when null, so runs are repeatable)
        load_format=settings.model.load_format,
        tokenizer=settings.model.tokenizer,
        seed=rt.seed or 0,
        # expert parallel (parallel.expert_parallel_size > 1): only this rank's routed experts are read
        **expert_parallel_kwargs(settings, model_dir, weights),
        # host: the Engram tables in (pinned) host memory, read by the device through its mapping
        engram_storage=settings.model.engram_storage,
    )
    settings = with_model_limits(settings, model.config.max_position_embeddings)
    check_replay_fits(settings, model.config.sliding_window)
    vocab = min(model.config.vocab_size, model.tokenizer.get_vocab_size())
    sampler = Sampler(vocab, model.config.eos_token_id, tokenizer=model.tokenizer, batch_invariant=rt.batch_invariant)
    program = build_program(settings.pipeline, model, sampler)
    model_path = dataclasses.replace(settings.model, path=str(model_dir))
    return program, dataclasses.replace(settings, model=model_path)


def expert_parallel_kwargs(settings: Settings, model_dir, weights: bool = True) -> dict:
    """load_model's expert-parallel arguments for this rank under `settings` ({} with one rank per expert set or
    without weights): DeepInfer's initial placement of the routed experts plus at least eplb.redundant_experts
    copies (rounded up to divide over the EP ranks), this rank's place in its EP group, the static dispatch's
    token bound and the gloo group its per-forward agreement runs on. It reads the world this
    process joined (deepinfer.distributed.world), so it belongs to the builder, which sits above both the model and
    the distributed floor."""
    p = settings.parallel
    if p.expert_parallel_size == 1 or not weights:
        return {}
    from deepinfer.distributed.placement import ExpertPlacement
    from deepinfer.distributed.world import current
    from deepinfer.models.config import ModelConfig
    from deepinfer.models.loading import resolve_model_dir

    w = current()
    if w is None:
        raise RuntimeError(f"parallel={p.name} loads one rank's experts: build the program in a rank process "
                           "(deepinfer.engine.dp_core.rank_core), after deepinfer.distributed.world.join")
    cfg = ModelConfig.from_file(Path(resolve_model_dir(model_dir, weights=False)) / "config.json")
    placement = ExpertPlacement.initial(cfg.n_routed_experts, p.expert_parallel_size, p.eplb.redundant_experts)
    # the static-capacity dispatch (distributed/ep_dispatch.py) holds a decode step of every sequence: one token
    # each, plus the draft tokens a DSpark verification step adds; larger steps (prefill) take the variable path
    d = settings.decoding
    per_seq = 1 + (d.num_draft_tokens if d.name == "dspark" else 0)
    return {"expert_placement": placement, "ep_rank": w.ep_rank, "ep_group": w.ep_group,
            "ep_max_tokens": settings.engine.max_num_seqs * per_seq, "ep_agree_group": w.ep_agree_group}


def model_location(path: str):
    """`embedded:NAME` -> the embedded checkpoint's directory (built on first use); anything else as given
    (a local directory or a hub id, resolved by the model loader)."""
    if path.startswith("embedded:"):
        from deepinfer import embedded

        return embedded.materialize(path.partition(":")[2])
    return path


def _device_type(model) -> str:
    import torch

    return torch.device(getattr(model, "device", "cpu")).type
