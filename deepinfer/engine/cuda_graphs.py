"""CUDA graphs for decode steps: one captured forward per batch-size bucket, replayed over static input buffers.

DSpark verification steps replay graphs too: every sequence brings the same number L = 1 + drafts of tokens (the
anchor and its drafts), so the key is (batch bucket, block-table bucket, L). A step whose sequences bring different
lengths (varlen's lengths, or requests near max_tokens verifying fewer drafts) is padded to its longest
(`padded`): each shorter sequence repeats its last token, and the runner keeps only its real rows' logits and rolls
the padding back at once. Padding tokens are written where a rejected draft's would be (rollback rows, positions
past the sequence's blocks land in the spare block), so the real rows' results are those of the unpadded step.

A decode step's forward (models: `model.run(meta, pools)`) reads only device tensors of fixed shape once the batch
size and the block-table width are fixed, so it can be captured. Batch buckets follow DeepInfer's spacing: powers
of two below `interval`, then every `interval` up to the largest batch; the block-table width (how many entries
the indexer scores) is bucketed by powers of two, so a short context does not pay for max_model_len. A batch of B
real sequences replays the smallest buckets that hold it; the padding rows point at the pools' spare slot and spare
block, so whatever they write lands where no sequence reads.

Capture happens on first use of a bucket, with every row a padding row (the warm-up run before capture writes
only there), never with a live step's inputs: running a live step twice would not be idempotent (a ring row read
by the step can be rewritten by it).

Expert parallel (a model with static-capacity dispatch buffers, deepinfer.distributed.ep_dispatch): every MoE layer
is an all-to-all, so every rank must run the same collectives in the same order. A decode step's collectives do
not depend on its batch but on the step's capacity, which the ranks agree (the buffers' views sized for the largest
rank's tokens rounded up to a bucket of `graph_batch_sizes` in tokens), so a replay on one rank pairs with a
replay or an eager static step of the same capacity on another. A graph bakes in the capacity it was captured with:
under expert parallel a graph's key carries it (`sized`: (batch bucket, width bucket, length, capacity tokens)),
and a rank whose batch is smaller than another's replays its own batch bucket with the larger capacity. What needs
the other ranks is a capture: its warm-up is a real forward, whose all-to-alls they must join (the capture itself
only records them). The runner agrees every step with the other ranks first (ExpertParallel.agree_step: one host
all-reduce of [tokens, "I capture" per candidate capacity]) and a rank without a capture runs one extra static
forward beside a capturing rank's warm-up (model_runner). Here that means: `key_for` decides before the step
whether a graph serves it (a bucket whose tokens exceed the buffers' never does: those steps are not static),
`needs_capture` says whether that takes a capture, and under expert parallel (`collective`) a warm-up that fails
raises instead of falling back (its collectives are half done: the ranks cannot be matched any more); a capture
that fails after its warm-up still falls back to eager steps, which join the same collectives.
"""

from __future__ import annotations

import logging

import torch

from deepinfer.models.cache import HostStep, derive
from deepinfer.models.cache.metadata import block_table, to_device
from deepinfer.sampling.wide_reduce import first_argmax

log = logging.getLogger("deepinfer.engine")


class CaptureFailed(RuntimeError):
    """Recording a graph failed after its warm-up ran (the step then runs eagerly)."""


def graph_batch_sizes(max_size: int, interval: int) -> list[int]:
    """Powers of two below `interval`, then multiples of `interval`, then `max_size` (DeepInfer's buckets)."""
    interval = max(1, min(interval, max_size))
    sizes, size = [], 1
    while size < interval:
        sizes.append(size)
        size *= 2
    sizes.extend(range(interval, max_size, interval))
    sizes.append(max_size)
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, model, pools, max_batch: int, interval: int, max_blocks: int, max_length: int = 1,
                 max_tokens: int | None = None, collective: bool = False):
        """`max_tokens`: no bucket of more tokens (expert parallel: the static buffers' bound); `collective`: the
        forward has collectives (expert parallel), so a failed warm-up raises."""
        self.model, self.pools = model, pools
        self.max_tokens, self.collective = max_tokens, collective
        self.sizes = graph_batch_sizes(max_batch, interval)
        self.max_blocks = max_blocks
        self.block_sizes = graph_batch_sizes(max_blocks, max_blocks)  # powers of two, then max_blocks
        self.max_length = max_length  # tokens per sequence: 1, or 1 + drafts for verification steps
        dev, n = pools.device, self.sizes[-1]
        self._pool = None  # one memory pool shared by every bucket's graph (they never run at once)
        self.inputs = {  # the static buffers every graph reads; padding rows hold the spare slot and block
            "ids": torch.zeros(n * max_length, dtype=torch.int64, device=dev),
            "positions": torch.zeros(n * max_length, dtype=torch.int64, device=dev),
            "slots": torch.full((n,), pools.spare_slot, dtype=torch.int64, device=dev),
            "past": torch.zeros(n, dtype=torch.int64, device=dev),
            "table": torch.full((n, max_blocks), pools.spare_block, dtype=torch.int64, device=dev),
        }
        # per length L: which sequence each token belongs to, and every sequence's length (static)
        self._tok_seq = {L: torch.arange(n, device=dev).repeat_interleave(L) for L in range(1, max_length + 1)}
        self._lengths = {L: torch.full((n,), L, dtype=torch.int64, device=dev) for L in range(1, max_length + 1)}
        # keyed (batch bucket, width bucket, length), under expert parallel with the capacity after them (`sized`)
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._failed: dict[tuple, str] = {}
        self.replays = 0

    def bucket(self, batch: int, blocks: int = 1, length: int = 1) -> tuple[int, int, int] | None:
        size = next((s for s in self.sizes if s >= batch), None)
        width = next((b for b in self.block_sizes if b >= blocks), None)
        if size is None or width is None or not 1 <= length <= self.max_length:
            return None
        if self.max_tokens is not None and size * length > self.max_tokens:
            return None
        return size, width, length

    def key_for(self, token_ids: list[list[int]], states) -> tuple[int, int, int] | None:
        """The graph that would serve this step (captured or not), or None: the step runs eagerly."""
        L = len(token_ids[0])
        if self._failed or any(len(t) != L for t in token_ids):
            return None
        return self.bucket(len(states), max(1, max(len(s.blocks) for s in states)), L)

    def padded(self, token_ids: list[list[int]], states) -> tuple[list[list[int]], list[int], tuple | None]:
        """A verification step of mixed lengths as one of its longest length L: (token lists padded to L, padding
        per sequence, the graph key or None). The block-table bucket covers every padded position, so a padding
        token past a sequence's blocks reads and writes the spare block, never a column past the table."""
        L = max(len(t) for t in token_ids)
        pads = [L - len(t) for t in token_ids]
        padded = [t + [t[-1]] * p for t, p in zip(token_ids, pads)]
        bs = self.pools.layout.block_size
        blocks = max(max(len(s.blocks), -(-(s.num_tokens + L) // bs)) for s in states)
        key = None if self._failed else self.bucket(len(states), blocks, L)
        return padded, pads, key

    def needs_capture(self, key) -> bool:
        return key is not None and key not in self._graphs

    @staticmethod
    def sized(key, tokens: int) -> tuple:
        """`key` (batch bucket, width bucket, length) with the expert-parallel capacity its graph bakes in: the
        tokens a rank's static buffers are sized for (ExpertParallel.agree_step), a graph per capacity."""
        return (*key[:3], tokens)

    @staticmethod
    def tokens(key) -> int:
        """Rows a replay of `key` runs (padding included)."""
        return key[0] * key[2]

    def _host(self, size: int, width: int, length: int = 1) -> HostStep:
        i = self.inputs
        base = {"ids": i["ids"][: size * length], "positions": i["positions"][: size * length],
                "tok_seq": self._tok_seq[length][: size * length], "slots": i["slots"][:size],
                "past": i["past"][:size], "lengths": self._lengths[length][:size], "table": i["table"][:size, :width]}
        entries = {src.ratio: width * src.per_block for src in self.pools.layout.sources.values()}
        # every row's logits come back: one per sequence when length is 1, the anchor and each draft otherwise
        # the decode attention path for a verification too (pack_step's rule: it fits the rollback rows)
        decode_path = length == 1 or length <= self.pools.layout.max_rollback
        return HostStep([length] * size, decode_path, entries, base)

    def _pad(self, start: int, end: int, length: int = 1) -> None:
        i = self.inputs
        i["ids"][start * length: end * length] = 0
        i["positions"][start * length: end * length] = torch.arange(length, device=i["ids"].device).repeat(end - start)
        i["slots"][start:end] = self.pools.spare_slot
        i["past"][start:end] = 0
        i["table"][start:end] = self.pools.spare_block

    def _warm_up(self, host: HostStep) -> None:
        """One forward of the bucket's padding rows off the capture: lazy inits, JIT compiles, one-time syncs (and,
        under expert parallel, the step's collectives, which the other ranks join). The kernels take the paths the
        capture will (registry.no_host_reads), so the capture launches only kernels compiled here."""
        from deepinfer.kernels.registry import no_host_reads

        if self.pools.device.type != "cuda":
            self.model.run(derive(host, self.pools), self.pools)
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), no_host_reads():
            self.model.run(derive(host, self.pools), self.pools)
        torch.cuda.current_stream().wait_stream(stream)

    def _record(self, host: HostStep):
        """(graph, output): the forward captured, not run (a capture launches nothing: no collective runs)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.model.run(derive(host, self.pools), self.pools)
        return graph, out

    @torch.inference_mode()
    def _capture(self, key: tuple):
        size, width, length = key[:3]
        self._pad(0, size, length)
        host = self._host(size, width, length)
        self._warm_up(host)
        try:
            return self._record(host)
        except Exception as exc:
            raise CaptureFailed(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc

    def run(self, token_ids: list[list[int]], states, key=None) -> torch.Tensor | None:
        """Logits [B * L, vocab] of one decode (L = 1) or verification step (every sequence L tokens) by graph
        replay, or None when no graph serves this batch (then the caller runs it eagerly). `key`: key_for's
        answer, when the caller asked it first (expert parallel: `sized` with the capacity the ranks agreed)."""
        B, L = len(states), len(token_ids[0])
        key = self.key_for(token_ids, states) if key is None else key
        if key is None:
            return None
        if key not in self._graphs:
            try:
                self._graphs[key] = self._capture(key)
            except Exception as exc:  # e.g. an op that syncs with the host
                if self.collective and not isinstance(exc, CaptureFailed):
                    raise  # the warm-up failed: its collectives are half done, the ranks cannot be matched any more
                # a failed capture can leave the CUDA context unfit for another: every step runs eagerly from now
                self._failed[key] = (str(exc) if isinstance(exc, CaptureFailed)
                                     else f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
                log.warning("CUDA graph capture failed for batch %d x %d blocks x %d tokens; every decode step runs "
                            "eagerly from now on: %s", *key[:3], self._failed[key])
                return None
        size, mb = key[0], key[1]
        i, spare = self.inputs, self.pools.spare_block
        dev = i["ids"].device
        toks = to_device([[t, s.num_tokens + j] for ids, s in zip(token_ids, states) for j, t in enumerate(ids)], dev)
        seqs = to_device([[s.num_tokens, s.slot] for s in states], dev)
        i["ids"][: B * L].copy_(toks[:, 0])
        i["positions"][: B * L].copy_(toks[:, 1])
        i["past"][:B].copy_(seqs[:, 0])
        i["slots"][:B].copy_(seqs[:, 1])
        i["table"][:B, :mb].copy_(to_device(block_table(states, mb, spare), dev))
        if B < size:
            self._pad(B, size, L)
        graph, out = self._graphs[key]
        graph.replay()
        self.replays += 1
        for s in states:
            s.num_tokens += L
        return out[: B * L]

    def failures(self) -> dict[int, str]:
        return dict(self._failed)


class DraftGraphs:
    """DSpark drafting by graph replay: block drafting (draft layers, heads, each position's choice) captured per
    batch bucket and mode over static inputs (golden token, slot and last accepted position per request). Modes:
    "greedy" (argmax), "sampled" (also temperature and min-p, and draws from static uniforms) and "cut" (also
    top-k/top-p by the full sort), each row choosing by its own request's parameters
    (deepinfer.sampling.static_drafts); a batch takes the least mode its requests need. Padding rows draft in the
    spare slot."""

    def __init__(self, drafter, pools, max_batch: int, interval: int, block: int, vocab: int):
        self.drafter, self.pools, self.block, self.vocab = drafter, pools, block, vocab
        self.sizes = graph_batch_sizes(max_batch, interval)
        dev, n = pools.device, self.sizes[-1]
        self.golden = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), pools.spare_slot, dtype=torch.int64, device=dev)
        self.last = torch.zeros(n, dtype=torch.int64, device=dev)
        self.static = None  # StaticDraftChooser, made by the first sampled batch
        self._pool = None
        self._graphs: dict[tuple[int, str], tuple] = {}
        self.failed: str | None = None
        self.replays = 0

    def _choose(self, i: int, logits: torch.Tensor) -> torch.Tensor:
        return first_argmax(logits[:, : self.vocab])  # greedy: ties to the lowest id, as DraftChooser

    def _draft(self, size: int, mode: str):
        choose = self._choose if mode == "greedy" else self.static.choose(cut=mode == "cut")
        step = self.drafter.step(self.slots[:size], self.last[:size], self.block, self.pools)
        out = self.drafter.draft(self.golden[:size], step, self.pools, choose)
        return out.tokens, out.confidences

    @torch.inference_mode()
    def _capture(self, size: int, mode: str):
        self.golden[:size] = 0
        self.slots[:size] = self.pools.spare_slot
        self.last[:size] = 0
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._draft(size, mode)
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._draft(size, mode)
        return graph, out

    @staticmethod
    def mode(chooser) -> str:
        from deepinfer.sampling.row_columns import wants_cut

        if chooser is None or not chooser.sampled:
            return "greedy"
        return "cut" if any(wants_cut(chooser.requests[r].params) for r in chooser.sampled) else "sampled"

    def run(self, golden: list[int], slots: list[int], last: list[int], chooser=None):
        """(tokens [B, block], confidences [B, block]) by replay, or None (then the caller drafts eagerly). With a
        DraftChooser (deepinfer.sampling.speculative) whose requests sample, its rows choose by their parameters
        and chooser.weights gets the sampled rows' draft distributions, as eager drafting leaves them."""
        B = len(golden)
        size = next((s for s in self.sizes if s >= B), None)
        if size is None or self.failed:
            return None
        mode = self.mode(chooser)
        if mode != "greedy":
            if self.static is None:
                from deepinfer.sampling.static_drafts import StaticDraftChooser

                self.static = StaticDraftChooser(self.sizes[-1], self.block, self.vocab, self.golden.device)
            self.static.fill(chooser, size)
        if (size, mode) not in self._graphs:
            try:
                self._graphs[size, mode] = self._capture(size, mode)
            except Exception as exc:
                self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
                log.warning("CUDA graph capture of DSpark drafting (%s) failed for batch %d; drafting runs eagerly "
                            "from now on: %s", mode, size, self.failed)
                return None
        rows = to_device([[g, s, a] for g, s, a in zip(golden, slots, last)], self.golden.device)
        self.golden[:B].copy_(rows[:, 0])
        self.slots[:B].copy_(rows[:, 1])
        self.last[:B].copy_(rows[:, 2])
        if B < size:
            self.golden[B:size] = 0
            self.slots[B:size] = self.pools.spare_slot
            self.last[B:size] = 0
        graph, (tokens, conf) = self._graphs[size, mode]
        graph.replay()
        self.replays += 1
        if mode != "greedy":
            self.static.hand_over(chooser)
        return tokens[:B], conf[:B]
