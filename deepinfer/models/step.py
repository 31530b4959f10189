"""The host side of one model step: a ForwardBatch -> the step metadata the model runs on, then the bookkeeping.

`DeepseekV41Model.run(meta, pools, replay)` is the step on the device and reads only device tensors. Everything
the host decides lives here, once, for every caller: the batch checks, reserving blocks for the new tokens,
packing and deriving the metadata (models/cache/metadata.py), the context-parallel split of the queries, the YOCO
replay plan, and, after the run, advancing each sequence's token count. The engine's prefill/decode stage
(`ModelStep`, the pipeline's `model_forward` component) and standalone callers (`model.forward`) share it; decode
steps replayed as CUDA graphs fill their own static metadata instead (engine/cuda_graphs.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from deepinfer.distributed.context_parallel import ContextParallel, align_of

from .batch import ForwardBatch
from .cache import CachePools, ImageRows, StepMeta, derive, pack_step, query_view

if TYPE_CHECKING:
    from .replay import ReplayStep


@dataclass
class PreparedStep:
    """A step ready for `model.run(meta, pools, replay)`; `advance()` once it ran."""

    meta: StepMeta
    pools: CachePools
    replay: ReplayStep | None
    states: list[Any]  # the batch's SequenceCaches
    lengths: list[int]  # new tokens of each sequence

    def advance(self) -> None:
        """The sequences now hold this step's tokens (after the run: the metadata was built from the counts
        before it)."""
        for st, n in zip(self.states, self.lengths):
            st.num_tokens += n


def prepare_step(batch: ForwardBatch, device: torch.device, compress_ratios, cp: ContextParallel | None = None,
                 vocab_size: int | None = None) -> PreparedStep:
    """`compress_ratios`: the model's per-layer ratios (context parallel aligns its chunks to the compression
    groups). `cp`: this rank's balanced context-parallel share of a prefill step (its mirror blocks of every
    chunk); every rank of cp.group prepares the same batch. `vocab_size`: where the image-span ids start (needed
    for a batch with `images`)."""
    if len(batch.token_ids) != len(batch.states):
        raise ValueError("ForwardBatch: token_ids and states must have the same length")
    if any(len(t) == 0 for t in batch.token_ids):
        raise ValueError("ForwardBatch: every sequence needs at least one new token")
    pools = batch.states[0].pools
    if any(st.pools is not pools for st in batch.states):
        raise ValueError("ForwardBatch: every sequence of a step must live in the same cache pools")
    for st, ids in zip(batch.states, batch.token_ids):
        st.reserve(st.num_tokens + len(ids))
    pasts = [st.num_tokens for st in batch.states]
    host = pack_step(batch.token_ids, batch.states, pools.layout, device, all_logits=batch.all_logits,
                     num_logits=batch.num_logits, decode_rows=batch.decode_rows)
    meta = derive(host, pools)
    if batch.images is not None:
        if cp is not None:
            raise ValueError("context parallel prefill does not take image spans yet (each rank would need the "
                             "image rows of its own mirror blocks); serve images with context_parallel_size=1")
        meta.images = _image_rows(batch, vocab_size, device)
    if cp is not None:
        if batch.replay is not None:
            raise ValueError("context parallel prefill does not support YOCO replay (yoco=mask|compact) yet")
        plan = cp.plan(host.lengths, pasts, align_of(compress_ratios))
        step = cp.step(plan, meta, device)
        meta = query_view(meta, step.own, step)
    replay = batch.replay.plan(meta, pools, pasts, batch.data_lens) if batch.replay is not None else None
    return PreparedStep(meta, pools, replay, list(batch.states), host.lengths)


def _image_rows(batch: ForwardBatch, vocab_size: int | None, device) -> ImageRows | None:
    """The step's image-span rows, checked: a new token with an id >= vocab_size has a row, and only such a token
    (a span without rows would embed past the table; a row over a text token would overwrite it)."""
    if vocab_size is None:
        raise ValueError("ForwardBatch.images needs the model's vocab_size (where the span ids start)")
    if len(batch.images) != len(batch.token_ids):
        raise ValueError("ForwardBatch: images must have one entry (SpanRows or None) per sequence")
    index, rows, start = [], [], 0
    for ids, span in zip(batch.token_ids, batch.images):
        spans = [j for j, t in enumerate(ids) if t >= vocab_size]
        given = [] if span is None else list(span.offsets)
        if given != spans:
            raise ValueError(f"ForwardBatch: image-span tokens at new-token offsets {spans[:8]} but rows for "
                             f"{given[:8]}; every id >= vocab_size ({vocab_size}) needs exactly one row")
        if span is not None and len(given):
            if span.rows.shape[0] != len(given):
                raise ValueError(f"ForwardBatch: {len(given)} span offsets but {span.rows.shape[0]} rows")
            index += [start + j for j in given]
            rows.append(span.rows)
        start += len(ids)
    if not index:
        return None
    return ImageRows(torch.tensor(index, dtype=torch.int64).to(device), torch.cat(rows).to(device))


class ModelStep:
    """The model's prefill/decode stage: ForwardBatch -> float logits. Prepares the step, runs it on the model,
    advances the sequences. With `cp` (ContextParallel), every rank of cp.group calls it in step with the same
    batch; each returns the same (single-process) logits and every rank's pools end up with the whole step."""

    def __init__(self, model):
        self.model = model

    @torch.inference_mode()
    def __call__(self, batch: ForwardBatch, cp: ContextParallel | None = None) -> torch.Tensor:
        model = self.model
        step = prepare_step(batch, model.device, model.config.compress_ratios, cp, model.config.vocab_size)
        logits = model.run(step.meta, step.pools, step.replay)
        step.advance()
        return logits
