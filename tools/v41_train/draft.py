"""The DSpark draft layers (`mtp.*`, MODEL_V41_SPEC.md §6) for training on a frozen backbone.

The same arithmetic as deepinfer/models/dspark.py (the inference drafter), over many drafting blocks at once:
  - context (§6.2): the backbone's attention-input streams at the target layers, averaged over hc (the training
    model's `features_at`), projected and normed; each draft layer's FP8 keys of it at every position;
  - a block per anchor a (the last accepted position): [t(a+1), noise, ...] at positions a+1 .. a+B through the
    draft layers (HC attention over the W context keys a-W+1 .. a plus every block key, non-causal; HC MoE), then
    the shared head, the first-order Markov head and the confidence head at every block position.
Block position i predicts the token at a+2+i. Training is teacher-forced: the Markov input at position i is the
true token t(a+1+i) — what drafting sees when the drafts before i were accepted, the only case in which draft i
is ever verified. The drafts are distilled from the backbone: their target at block position i is the backbone's own
next-token distribution at a+1+i (verification accepts what the target model would say, not what the text says).
The confidence head learns P(draft i is the target's argmax | the drafts before it were right), by a binary
cross-entropy on its detached inputs, so it never pulls on the drafts themselves.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from deepinfer.kernels.torch.linear import linear
from deepinfer.kernels.torch.mhc import mhc_collapse
from deepinfer.kernels.torch.norm import rms_norm
from deepinfer.kernels.torch.rope import default_inv_freq, rope
from deepinfer.models.config import ModelConfig
from deepinfer.models.loading.tensors import draft_tensors

from .model import StoredParams, hc_block, moe_ffn
from .ops import sink_attention_dense
from .stored import fq_fp8

# Later block positions matter less: draft i counts only when drafts 0 .. i-1 were all accepted.
POSITION_DECAY = 0.8


class DraftOutput(NamedTuple):
    logits: torch.Tensor  # [N, B, V] fp32: base + Markov, what drafting chooses from
    targets: torch.Tensor  # [N, B] the true token each block position guesses
    confidence_logits: torch.Tensor  # [N, B] fp32, before the sigmoid
    expert_counts: list[torch.Tensor]


class DraftModel(StoredParams):
    def __init__(self, config_json: dict, seed: int):
        cfg = ModelConfig.from_dict(config_json)
        assert cfg.num_nextn_predict_layers > 0, "config.json has no draft layers (num_nextn_predict_layers)"
        specs = {n: s for n, s in draft_tensors(cfg).items() if not s.optional}
        super().__init__(cfg, specs, seed, [f"mtp.{j}." for j in range(cfg.num_nextn_predict_layers)])
        self.register_buffer("main_freqs", default_inv_freq(cfg.rope_theta, cfg.qk_rope_head_dim), persistent=False)

    def forward(self, ids: torch.Tensor, features: list[torch.Tensor], anchors: torch.Tensor, embed: torch.Tensor,
                head: torch.Tensor) -> DraftOutput:
        """ids [B, T'] (T' >= T: ids may run past the backbone's input to hold the targets); features: per
        target layer [B, T, D] (the backbone's on ids[:, :T], detached); anchors [B, A] with
        0 <= a <= min(T - 1, T' - 2 - block) (every block position has a target); embed/head: the backbone's
        stored values."""
        cfg, W = self.cfg, self.weights()
        Bs, T = ids.shape[0], features[0].shape[1]
        A, blk, win, dev = anchors.shape[1], cfg.dspark_block_size, cfg.sliding_window, ids.device
        N, last = Bs * A, f"mtp.{cfg.num_nextn_predict_layers - 1}."
        offs = torch.arange(blk, device=dev)
        tokens_at = lambda pos: ids.gather(1, pos.reshape(Bs, -1)).view(pos.shape)  # noqa: E731
        block_pos = anchors[..., None] + 1 + offs  # [Bs, A, blk]
        prev = tokens_at(block_pos).reshape(N, blk)  # the Markov inputs: golden, then the true tokens
        targets = tokens_at(block_pos + 1).reshape(N, blk)
        tokens = torch.full((N, blk), cfg.dspark_noise_token_id, dtype=torch.int64, device=dev)
        tokens[:, 0] = prev[:, 0]
        look = anchors[..., None] - (win - 1) + torch.arange(win, device=dev)  # [Bs, A, win] context positions
        ctx_valid = (look >= 0).view(N, 1, win).expand(N, blk, win)
        ctx_rows = (torch.arange(Bs, device=dev)[:, None, None] * T + look.clamp_min(0)).reshape(-1)
        positions = block_pos.reshape(-1)

        x_ctx = linear(torch.cat(features, -1).reshape(Bs * T, -1), W["mtp.0.main_proj.weight"])
        x_ctx = rms_norm(x_ctx, W["mtp.0.main_norm.weight"], cfg.rms_norm_eps)
        all_pos = torch.arange(T, device=dev).repeat(Bs)
        mask = torch.cat([ctx_valid, torch.ones(N, blk, blk, dtype=torch.bool, device=dev)], -1)

        x = embed[tokens.reshape(-1)]
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        pre = torch.zeros(x.shape[0], cfg.hc_mult, device=dev)
        pre[:, 0] = 1.0
        counts: list[torch.Tensor] = []
        for j in range(cfg.num_nextn_predict_layers):
            p = f"mtp.{j}."
            ctx_keys = self._key(p, x_ctx, all_pos, W)[ctx_rows].view(N, win, -1)

            def attend(h, p=p, ctx_keys=ctx_keys):
                return self._attention(p, h, positions, ctx_keys, mask, W)

            streams, pre = hc_block(cfg, p, streams, pre, W, attend,
                                    lambda g, p=p: moe_ffn(cfg, p, g, W, cfg.dspark_n_routed_experts,
                                                           cfg.dspark_num_experts_per_tok, counts))
        h_pre = mhc_collapse(streams, pre)
        base = linear(rms_norm(h_pre, W[last + "norm.weight"], cfg.rms_norm_eps), head).float()
        feats = h_pre.float()
        logits = base
        if cfg.dspark_markov_rank:
            e = W[last + "markov_head.embed.weight"][prev.reshape(-1)].float()
            logits = base + e @ W[last + "markov_head.head.weight"].float().T
            feats = torch.cat([feats, e], -1)
        conf = (feats.detach() * W[last + "confidence_head.proj.weight"].reshape(-1).float()).sum(-1)
        V = logits.shape[-1]
        return DraftOutput(logits.view(N, blk, V), targets, conf.view(N, blk), counts)

    def _key(self, p: str, x: torch.Tensor, positions: torch.Tensor, W) -> torch.Tensor:
        """dspark.py::DraftAttention.key: the stored (FP8) key of hidden x (context keys and block keys alike)."""
        cfg, a = self.cfg, p + "attn."
        k = rms_norm(linear(x, W[a + "wkv.weight"]), W[a + "kv_norm.weight"], cfg.rms_norm_eps)
        return fq_fp8(rope(k, positions, self.main_freqs))

    def _attention(self, p: str, h, positions, ctx_keys, mask, W):
        """dspark.py::DraftAttention: every block query sees the block's context keys plus all its block keys."""
        cfg, a = self.cfg, p + "attn."
        N, blk = ctx_keys.shape[0], cfg.dspark_block_size
        H, D = cfg.num_attention_heads, cfg.head_dim
        q_res = rms_norm(linear(h, W[a + "wq_a.weight"]), W[a + "q_norm.weight"], cfg.rms_norm_eps)
        q = rope(linear(q_res, W[a + "wq_b.weight"]).view(-1, H, D), positions, self.main_freqs).view(N, blk, H, D)
        keys = torch.cat([ctx_keys, self._key(p, h, positions, W).view(N, blk, D)], 1)
        out = sink_attention_dense(q, keys, mask, W[a + "attn_sink"], D**-0.5).reshape(N * blk, H, D)
        out = rope(out, positions, self.main_freqs, inverse=True)
        grouped = out.reshape(N * blk, cfg.o_groups, -1)
        wo_a = W[a + "wo_a.weight"].view(cfg.o_groups, cfg.o_lora_rank, -1)
        y = torch.cat([linear(grouped[:, g], wo_a[g]) for g in range(cfg.o_groups)], dim=-1)
        return linear(y, W[a + "wo_b.weight"])


def draft_loss(out: DraftOutput, teacher: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(drafting loss, confidence loss, per-position greedy hit rate [B]). Drafting: at each block position the
    cross-entropy against `teacher` [N, B, V] (the backbone's own next-token logits there, given the text before
    it: drafts are accepted when they match the target model, not the text), or against the text's token without
    one; weighted POSITION_DECAY^i (normalised). Hits, and the confidence head's BCE, count a greedy draft right
    when it is the teacher's argmax (else the text's token)."""
    N, blk, V = out.logits.shape
    if teacher is not None:
        soft = torch.softmax(teacher.float(), -1).reshape(-1, V)
        ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, V), soft, reduction="none")
        out = out._replace(targets=teacher.argmax(-1))
    else:
        ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, V), out.targets.reshape(-1), reduction="none")
    w = POSITION_DECAY ** torch.arange(blk, device=ce.device, dtype=torch.float32)
    loss = (ce.view(N, blk) * (w / w.sum())).sum(-1).mean()
    hit = (out.logits.detach().argmax(-1) == out.targets).float()
    conf = torch.nn.functional.binary_cross_entropy_with_logits(out.confidence_logits, hit)
    return loss, conf, hit.mean(0)


def teacher_logits(logits: torch.Tensor, anchors: torch.Tensor, block: int) -> torch.Tensor:
    """[N, B, V]: the backbone's logits [Bs, T, V] at positions a+1+i, which predict the token at a+2+i that block
    position i drafts (anchors [Bs, A] with a <= T - 2 - block)."""
    pos = anchors[..., None] + 1 + torch.arange(block, device=anchors.device)  # [Bs, A, B]
    Bs, A = anchors.shape
    rows = (torch.arange(Bs, device=anchors.device)[:, None, None] * logits.shape[1] + pos).reshape(-1)
    return logits.reshape(Bs * logits.shape[1], -1)[rows].view(Bs * A, block, -1)


def random_anchors(B: int, T: int, A: int, block: int, gen: torch.Generator) -> torch.Tensor:
    """[B, A] anchors drawn uniformly from 0 .. T - 2 - block (each block position has a target in the window)."""
    return torch.randint(0, T - 1 - block, (B, A), generator=gen)
