"""Decode-step and drafting graphs on the CPU, for testing what the runner does around them under expert parallel (CUDA graph
capture itself needs CUDA: tests/gpu/test_expert_parallel_gpu.py runs the real ones).

EmulatedDecodeGraphs is DecodeGraphs with `_record` replaced: recording runs nothing (as a CUDA capture launches
nothing, so its all-to-alls meet no peer), and a replay runs the recorded forward again over the graph's static
input buffers into the same output tensor (as a replay re-executes the captured kernels, collectives included).
Everything else is the engine's own code: bucket choice, static inputs, padding, the warm-up forward, the runner's
per-step agreement and the pairing of a capture's warm-up.

`install(log_dir)` (from a sitecustomize on the rank processes' PYTHONPATH) puts them in every CPU runner whose
options ask for graphs, and appends one line per engine step to log_dir/<pid>.txt:
`<step> <rank-pid> capture=<0|1> pair=<0|1> replay=<0|1> static=<0|1>`."""

from __future__ import annotations

import os

import torch

from deepinfer.engine.cuda_graphs import DecodeGraphs, DraftGraphs
from deepinfer.models.cache import derive


class _Replay:
    def __init__(self, graphs: "EmulatedDecodeGraphs", host):
        self.graphs, self.host = graphs, host
        self.out = torch.empty(0)

    def replay(self) -> None:
        g = self.graphs
        with torch.inference_mode():
            self.out.resize_(0)
            logits = g.model.run(derive(self.host, g.pools), g.pools)
            self.out.resize_(logits.shape).copy_(logits)


class EmulatedDecodeGraphs(DecodeGraphs):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records = 0

    def _record(self, host):
        self.records += 1
        graph = _Replay(self, host)
        return graph, graph.out


class RerunDraftGraphs(DraftGraphs):
    """DraftGraphs with each captured graph replaced by running what was captured again into its outputs: static
    inputs, padding rows, buckets and modes are the engine's own."""

    def _capture(self, size, mode):
        out = self._draft(size, mode)
        graphs = self

        class Graph:
            @torch.inference_mode()
            def replay(self):
                tokens, conf = graphs._draft(size, mode)
                out[0].copy_(tokens)
                out[1].copy_(conf)

        return Graph(), out


def install(log_dir: str) -> None:
    from deepinfer.engine.model_runner import ModelRunner

    allocate, ep_forward = ModelRunner.allocate, ModelRunner._ep_forward

    def allocate_with_graphs(self, num_slots, num_blocks, block_size, max_model_len=0, graphs=False,
                             graph_interval=8, *args, **kwargs):
        allocate(self, num_slots, num_blocks, block_size, max_model_len, graphs, graph_interval, *args, **kwargs)
        if graphs and self.graphs is None and self.pools.device.type == "cpu":
            self.graphs = self.decode_graphs(num_slots, graph_interval, max_model_len, block_size,
                                             cls=EmulatedDecodeGraphs)
        self._log_step = 0

    def logged_ep_forward(self, tokens, key, replay, eager):
        g = self.graphs
        before = (g.records, g.replays, self.ep_pairing_forwards) if g is not None else (0, 0, 0)
        out = ep_forward(self, tokens, key, replay, eager)
        after = (g.records, g.replays, self.ep_pairing_forwards) if g is not None else (0, 0, 0)
        capture, replays, pair = (a - b for a, b in zip(after, before))
        with open(os.path.join(log_dir, f"{os.getpid()}.txt"), "a") as f:
            f.write(f"{self._log_step} {os.getpid()} capture={capture} pair={pair} replay={replays} "
                    f"static={int(bool(self._ep.static))}\n")
        self._log_step += 1
        return out

    ModelRunner.allocate = allocate_with_graphs
    ModelRunner._ep_forward = logged_ep_forward
