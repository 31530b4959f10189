"""The arithmetic of a parallel layout (no torch: it is the config's, so the resolve step checks a layout without
importing the distributed code): how many ranks, which ranks share their experts, and which parts of the layouts
the engine can run today. deepinfer.distributed.world builds its expert groups from it.

Ranks are numbered as DeepInfer numbers them (worker/base.py: rank = engine_rank * cp + cp_rank): a world of
context_parallel_size x data_parallel_size ranks, each group of expert_parallel_size consecutive ranks holding one
copy of every routed expert between them.
"""

from __future__ import annotations


def resolved_data_parallel_size(data_parallel_size: int, expert_parallel_size: int, context_parallel_size: int) -> int:
    """DeepInfer's rule (config.py ParallelConfig): data_parallel_size 0 means expert / context parallel size,
    at least 1."""
    if data_parallel_size:
        return data_parallel_size
    return max(1, expert_parallel_size // context_parallel_size)


def expert_groups(world_size: int, expert_parallel_size: int) -> list[list[int]]:
    """The ranks of each expert-parallel group: consecutive runs of expert_parallel_size ranks."""
    ep = expert_parallel_size
    return [list(range(g * ep, (g + 1) * ep)) for g in range(world_size // ep)]


def context_parallel_refusal(cp: int, dp: int, ep: int, decoding: str = "plain", num_draft_tokens: int = 0,
                             yoco: str = "off", eplb_interval: int = 0) -> str | None:
    """THE HOOK for balanced context parallelism in the engine: None where the engine runs context_parallel_size
    `cp` > 1 with the rest of the layout, else the one-line reason it refuses it (never run as something else).

    What runs (deepinfer/engine/lockstep.py): the world is `dp` data-parallel replicas of cp consecutive ranks;
    every rank of a replica gets the replica's requests in the same turn and runs an identical engine core (same
    deterministic scheduler, same cache geometry, seeded sampling on identical logits), prefill steps through
    model.forward(batch, cp=...), decode steps on every rank; the experts either whole on every rank (EP 1) or
    sharded over each replica's cp ranks (EP = cp); EPLB re-places them within those groups.
    Refused: other EP groupings (EP over several replicas would make one replica's steps wait for another's with
    different step plans; not built), DSpark drafting and YOCO replay (the model's context-parallel forward runs
    neither)."""
    if ep not in (1, cp):
        return (f"parallel.expert_parallel_size={ep} with parallel.context_parallel_size={cp}: the experts are "
                f"either on every rank or sharded over the context-parallel ranks; allowed: 1 or {cp}")
    if decoding == "dspark" and num_draft_tokens:
        return (f"decoding=dspark with parallel.context_parallel_size={cp}: context-parallel steps do not run the "
                "DSpark draft layers; allowed: decoding=plain (or DEEPINFER_USE_NEXTN_DECODE=0)")
    if yoco != "off":
        return (f"yoco.mode={yoco!r} with parallel.context_parallel_size={cp}: the context-parallel prefill does not "
                "run YOCO replay; allowed: yoco=off")
    return None

