"""Op-level parity of our torch reference ops with the *live* transformers DeepSeek-V4 code.

transformers ships `models.deepseek_v4` (DeepSeek-V4-Flash) but no `deepseek_v41`. V4.1 reuses
several V4 mechanisms unchanged, so for each of those we build the real V4 module(s) from a tiny
`DeepseekV4Config`, fill every parameter we touch with fresh random values (never the zero/one
init: random sinks, random `base`/`scale`, random selection bias, random position bias ...), feed
the same random float32 inputs to both sides and compare.

Compared (each test's docstring says exactly what):
  * mHC mixes + Sinkhorn + collapse  (`DeepseekV4HyperConnection`)      vs `mhc.mhc_mixes` / `mhc_collapse`
  * mHC expand / comb orientation    (`DeepseekV4DecoderLayer` wiring)  vs `mhc.mhc_expand`
  * sink attention                   (`eager_attention_forward`)        vs `attention.sink_attention`
  * interleaved partial RoPE + YaRN (`DeepseekV4RotaryEmbedding`, `apply_rotary_pos_emb`) vs `rope.*`
  * grouped output projection        (`DeepseekV4GroupedLinear` + `o_b_proj`) vs `models/attention.py`
  * sqrtsoftplus top-k router        (`DeepseekV4TopKRouter`)           vs `moe.moe_router`
  * MoE block: router + SwiGLU experts + shared expert (`DeepseekV4SparseMoeBlock`) vs `moe.*`
  * non-overlapping gated window pooling (`DeepseekV4HCACompressor`, rate 2) vs
                                      `compressor.compressor_pool` + `rms_norm` + `rope`
  * indexer scoring + causal top-k   (`DeepseekV4IndexerScorer`, `DeepseekV4Indexer`) vs
                                      `indexer.indexer_scores` / `indexer.index_topk`

Not compared (V4 and V4.1 legitimately differ; see docs/model.md, "Op parity with transformers' DeepSeek-V4"): the *shifted* mHC site
wiring (V4.1 collapses a site with the previous site's pre-mix; V4 with its own), V4's separate
`hc_head` final collapse, hash-routed MoE layers, `gate_temp`, V4's compressor `position_bias` and
CSA overlap windows, V4.1's ratio-1 compressor, the indexer key path (V4: its own overlapping
indexer compressor; V4.1: keys from the shared compressed latent), V4.1's two-level candidate
top-k, in-forward FP8/FP4 fake quantization, and a whole attention layer (V4 has a per-head
`q_b_norm` that our V4.1 path does not).

Tolerance: float32, max |ours - v4| <= 1e-5 * max(1, max |v4|); top-k index sets must be equal
(the tests assert their inputs are tie-free by a clear margin first).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")
v4cfg = pytest.importorskip("transformers.models.deepseek_v4.configuration_deepseek_v4")
v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

from deepinfer.kernels.torch import attention as k_attn  # noqa: E402
from deepinfer.kernels.torch import compressor as k_comp  # noqa: E402
from deepinfer.kernels.torch import indexer as k_index  # noqa: E402
from deepinfer.kernels.torch import mhc as k_mhc  # noqa: E402
from deepinfer.kernels.torch import moe as k_moe  # noqa: E402
from deepinfer.kernels.torch.cache_formats import RawCodec  # noqa: E402
from deepinfer.kernels.torch.linear import grouped_linear, linear  # noqa: E402
from deepinfer.kernels.torch.norm import rms_norm  # noqa: E402
from deepinfer.kernels.torch.rope import default_inv_freq, rope, yarn_inv_freq  # noqa: E402
from deepinfer.models.attention import Attention  # noqa: E402

RTOL = 1e-5


def _config(**over):
    kw = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=16,
        q_lora_rank=24,
        partial_rotary_factor=0.5,
        n_routed_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=16,
        routed_scaling_factor=2.5,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        hc_eps=1e-6,
        rms_norm_eps=1e-6,
        o_groups=2,
        o_lora_rank=8,
        index_n_heads=16,  # many heads: a score is exactly 0 (all relu'd away) with odds 2^-16
        index_head_dim=16,
        index_topk=3,
        sliding_window=8,
        layer_types=["sliding_attention", "compressed_sparse_attention"],
        mlp_layer_types=["moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    )
    kw.update(over)
    return v4cfg.DeepseekV4Config(**kw)


@pytest.fixture
def cfg():
    torch.manual_seed(0)
    return _config()


def _randomize(module: torch.nn.Module, std: float = 0.3) -> None:
    """Every parameter gets fresh N(0, std^2) values (1-D scales/norm weights around 1 so they
    stay well-conditioned but are never the ones/zeros init)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".scale") or name == "scale":
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(std * torch.randn_like(p))


def _check(name: str, ours: torch.Tensor, ref: torch.Tensor, rtol: float = RTOL) -> float:
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} vs {tuple(ref.shape)}"
    assert torch.isfinite(ref).all() and torch.isfinite(ours).all(), f"{name}: non-finite values"
    scale = max(1.0, ref.abs().max().item())
    diff = (ours.double() - ref.double()).abs().max().item() / scale
    print(f"[v4 parity] {name}: max scaled diff {diff:.3e} (scale {scale:.3g})")
    assert diff <= rtol, f"{name}: max |ours - v4| / scale = {diff:.3e} > {rtol:g}"
    return diff


# ---------------------------------------------------------------------------------------------
# mHC
# ---------------------------------------------------------------------------------------------
def _hc_params(cfg, hc_module):
    """Random fn/base/scale for a DeepseekV4HyperConnection: fn scaled so the mixes are O(1)."""
    hc, D = cfg.hc_mult, cfg.hidden_size
    with torch.no_grad():
        hc_module.fn.copy_(torch.randn_like(hc_module.fn) * (hc * D) ** -0.5 * 2.0)
        hc_module.base.copy_(torch.randn_like(hc_module.base))
        hc_module.scale.copy_(0.5 + torch.rand_like(hc_module.scale))
    return hc_module.fn.detach(), hc_module.scale.detach(), hc_module.base.detach()


def _streams(cfg, B=2, S=5):
    # distinct per-stream magnitudes so a wrong collapse/expand axis cannot cancel out
    mag = torch.tensor([0.5, 1.0, 2.0, 3.0])[: cfg.hc_mult].view(1, 1, -1, 1)
    return torch.randn(B, S, cfg.hc_mult, cfg.hidden_size) * mag


def test_mhc_mixes_sinkhorn_collapse(cfg):
    """`DeepseekV4HyperConnection.forward` -> (post, comb, collapsed) vs our `mhc_mixes` (post,
    comb compared element-wise in the same [.., j, k] layout: both view the hc*hc logits row-major
    and run the same Sinkhorn schedule, column-normalise first then (iters-1) x (row, column)) and
    `mhc_collapse(streams, pre)` vs V4's `collapsed` (V4 does not return `pre`; it consumes it in
    the collapse, so `pre` is compared through it). Parameter order differs: V4 holds
    (fn, base, scale), our op takes (fn, scale, base)."""
    hc_mod = v4.DeepseekV4HyperConnection(cfg)
    fn, scale, base = _hc_params(cfg, hc_mod)
    x = _streams(cfg)
    with torch.no_grad():
        post_ref, comb_ref, collapsed_ref = hc_mod(x)

    flat = x.flatten(0, 1)  # [T, hc, D]
    pre, post, comb = k_mhc.mhc_mixes(flat, fn, scale, base, cfg.hc_eps, cfg.hc_sinkhorn_iters, cfg.rms_norm_eps)
    _check("mhc post", post, post_ref.flatten(0, 1))
    _check("mhc comb (Sinkhorn)", comb, comb_ref.flatten(0, 1))
    _check("mhc collapse(pre)", k_mhc.mhc_collapse(flat, pre), collapsed_ref.flatten(0, 1))

    # the Sinkhorn output is (nearly) doubly stochastic and not symmetric, so the orientation
    # checks in the expand test below are meaningful
    # (20 iterations ending on a column step: columns sum to 1, rows only approximately)
    assert (comb.sum(-2) - 1).abs().max() < 1e-4 and (comb.sum(-1) - 1).abs().max() < 0.1
    assert (comb - comb.transpose(-1, -2)).abs().max() > 1e-2


class _StubAttn(torch.nn.Module):
    """Deterministic stand-in for the attention block (returns (out, weights) like V4's)."""

    def __init__(self, D):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(D, D) * D**-0.5)

    def forward(self, x, **kwargs):
        return torch.tanh(x) @ self.w.T, None


class _StubMLP(torch.nn.Module):
    def __init__(self, D):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(D, D) * D**-0.5)

    def forward(self, x, input_ids=None):
        return torch.sin(x @ self.w.T)


def test_mhc_expand_orientation_via_decoder_layer(cfg):
    """One `DeepseekV4DecoderLayer` with its attention and MoE swapped for deterministic stubs,
    so the layer output is pure mHC arithmetic: for each site, mixes -> collapse with the site's
    *own* pre (V4 is unshifted) -> RMSNorm(weight) -> block -> expand
    `post_k * block + sum_j comb[j, k] * residual_j` (V4: `comb.T @ hidden_states`). We rebuild
    the same two sites with `mhc_mixes`, `mhc_collapse`, `rms_norm`, `mhc_expand`. Only the
    *site wiring* differs in V4.1 (shifted: a site collapses with the previous site's pre), which
    is model code, not these ops. A transposed comb is asserted to fail, so the orientation is
    really tested."""
    layer = v4.DeepseekV4DecoderLayer(cfg, 0)
    _randomize(layer)
    a_fn, a_scale, a_base = _hc_params(cfg, layer.attn_hc)
    f_fn, f_scale, f_base = _hc_params(cfg, layer.ffn_hc)
    layer.self_attn = _StubAttn(cfg.hidden_size)
    layer.mlp = _StubMLP(cfg.hidden_size)
    layer.eval()
    x = _streams(cfg)
    with torch.no_grad():
        ref = layer(x)

    mix = (cfg.hc_eps, cfg.hc_sinkhorn_iters, cfg.rms_norm_eps)
    eps = cfg.rms_norm_eps
    with torch.no_grad():
        s = x.flatten(0, 1)
        pre, post, comb = k_mhc.mhc_mixes(s, a_fn, a_scale, a_base, *mix)
        h = rms_norm(k_mhc.mhc_collapse(s, pre), layer.input_layernorm.weight, eps)
        a_out = layer.self_attn(h)[0]
        s1 = k_mhc.mhc_expand(a_out, s, post, comb)
        s1_bad = k_mhc.mhc_expand(a_out, s, post, comb.transpose(-1, -2))
        pre, post, comb = k_mhc.mhc_mixes(s1, f_fn, f_scale, f_base, *mix)
        g = rms_norm(k_mhc.mhc_collapse(s1, pre), layer.post_attention_layernorm.weight, eps)
        ours = k_mhc.mhc_expand(layer.mlp(g), s1, post, comb)
        # negative control: both sites with the comb transposed (sum over the output axis)
        pre, post, comb = k_mhc.mhc_mixes(s1_bad, f_fn, f_scale, f_base, *mix)
        g = rms_norm(k_mhc.mhc_collapse(s1_bad, pre), layer.post_attention_layernorm.weight, eps)
        bad = k_mhc.mhc_expand(layer.mlp(g), s1_bad, post, comb.transpose(-1, -2))

    _check("mhc site wiring + expand (2 sites)", ours, ref.flatten(0, 1))
    assert (bad - ref.flatten(0, 1)).abs().max() > 1e-2, "a transposed comb should not match V4"


# ---------------------------------------------------------------------------------------------
# sink attention
# ---------------------------------------------------------------------------------------------
def test_sink_attention(cfg):
    """`eager_attention_forward` (V4's sink attention: shared K = V single head broadcast to all
    heads, additive mask, per-head sink logit in the softmax denominator only, max-subtraction)
    vs our `sink_attention`, in two layouts of the same problem:
      (a) every query's slate = all N shared keys, bias = V4's mask row;
      (b) every query's slate = only its visible keys, in a random order, padded with masked
          dummy slots (the per-query slate our model builds) -- softmax is order-invariant, so
          this must still equal V4's masked attention over the full key set.
    Includes a query with every key masked (output 0: all mass on the sink). Sinks are random."""
    attn_mod = v4.DeepseekV4Attention(cfg, 0)
    with torch.no_grad():
        attn_mod.sinks.copy_(torch.randn(cfg.num_attention_heads) * 2.0)
    attn_mod.eval()
    H, D, S, N = cfg.num_attention_heads, cfg.head_dim, 12, 20
    q = torch.randn(1, H, S, D) * 2.0
    kv = torch.randn(1, 1, N, D) * 2.0
    visible = torch.rand(S, N) < 0.6
    visible[0] = False  # fully masked query
    visible[1] = True
    mask = torch.zeros(S, N).masked_fill(~visible, float("-inf"))
    scale = D**-0.5
    with torch.no_grad():
        ref, _ = v4.eager_attention_forward(attn_mod, q, kv, kv, mask.view(1, 1, S, N), scaling=scale)
    ref = ref[0]  # [S, H, D]

    q_t = q[0].transpose(0, 1).contiguous()  # [S, H, D]
    ours_a = k_attn.sink_attention(q_t, kv[0, 0].expand(S, N, D), mask, attn_mod.sinks.detach(), scale)
    _check("sink attention (full slate)", ours_a, ref)

    K = N + 3  # slate wider than any visible set: trailing dummy slots
    slate_idx = torch.full((S, K), N, dtype=torch.long)  # index N = dummy row
    slate_bias = torch.full((S, K), float("-inf"))
    for t in range(S):
        vis = visible[t].nonzero().flatten()
        vis = vis[torch.randperm(len(vis))]
        slate_idx[t, : len(vis)] = vis
        slate_bias[t, : len(vis)] = 0.0
    bank = torch.cat([kv[0, 0], torch.randn(1, D) * 5.0])  # a non-zero dummy: masking must hide it
    ours_b = k_attn.sink_attention(q_t, bank[slate_idx], slate_bias, attn_mod.sinks.detach(), scale)
    _check("sink attention (per-query compacted slate)", ours_b, ref)
    assert ref[0].abs().max() == 0 and ours_b[0].abs().max() == 0
    assert ref[1:].abs().max() > 0.1


# ---------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------
def test_interleaved_partial_rope_and_yarn():
    """`DeepseekV4RotaryEmbedding` frequencies ("main": plain theta=10000; "compress": YaRN on
    compress_rope_theta with attention_factor forced to 1.0) vs our `default_inv_freq` /
    `yarn_inv_freq`, and V4's `apply_rotary_pos_emb` (interleaved pairs on the *trailing*
    rope slice, fp32 rotation) vs our `rope`, forward (cos, sin) and inverse (cos, -sin -- V4
    de-rotates the attention output with it, as our model does with `inverse=True`), at
    scattered absolute positions up to 5000. rope_dim 32 so the YaRN ramp has interior points."""
    y = dict(factor=16.0, original_max_position_embeddings=256, beta_fast=32.0, beta_slow=1.0)
    cfg = _config(head_dim=64, partial_rotary_factor=0.5, max_position_embeddings=4096,
                  rope_parameters={"rope_type": "yarn", **y})
    rd = cfg.qk_rope_head_dim
    assert rd == 32
    rot = v4.DeepseekV4RotaryEmbedding(cfg)
    ours_freq = {
        "main": default_inv_freq(cfg.rope_theta, rd),
        "compress": yarn_inv_freq(cfg.compress_rope_theta, rd, y["factor"], y["original_max_position_embeddings"],
                                  y["beta_fast"], y["beta_slow"]),
    }
    yarn_ramp = ours_freq["compress"] / default_inv_freq(cfg.compress_rope_theta, rd)
    assert ((yarn_ramp > 1 / 16 + 1e-3) & (yarn_ramp < 1 - 1e-3)).any()  # partially interpolated dims exist

    B, S, H, D = 2, 6, cfg.num_attention_heads, cfg.head_dim
    pos = torch.randint(0, 5000, (B, S))
    x = torch.randn(B, H, S, D)  # V4 layout for apply_rotary_pos_emb: [B, H, S, D]
    for lt in ("main", "compress"):
        assert getattr(rot, f"{lt}_attention_scaling") == 1.0
        ref_freq = getattr(rot, f"{lt}_inv_freq")  # spans 1 .. 1e-7: compare relatively
        _check(f"rope inv_freq ({lt}, relative)", ours_freq[lt] / ref_freq, torch.ones_like(ref_freq))
        cos, sin = rot(x, pos, layer_type=lt)
        for inverse in (False, True):
            ref = v4.apply_rotary_pos_emb(x, cos, -sin if inverse else sin)  # [B, H, S, D]
            ours = rope(x.transpose(1, 2).reshape(B * S, H, D), pos.reshape(-1), ours_freq[lt], inverse=inverse)
            _check(f"rope {lt}{' inverse' if inverse else ''}", ours, ref.transpose(1, 2).reshape(B * S, H, D))
            assert torch.equal(ours[..., : D - rd], x.transpose(1, 2).reshape(B * S, H, D)[..., : D - rd])


# ---------------------------------------------------------------------------------------------
# grouped output projection
# ---------------------------------------------------------------------------------------------
def test_grouped_output_projection(cfg):
    """V4: `o_a_proj` (`DeepseekV4GroupedLinear`, weight [G*r, H*D/G] viewed [G, r, H*D/G],
    block-diagonal per head group) then `o_b_proj`, applied to the attention output [.., H, D]
    reshaped to [.., G, H*D/G]. Ours: the tail of `deepinfer.models.attention.Attention.__call__`
    (the real model code), with `wo_a` laid out as `models/weights.py::arrange` does
    (`wo_a.view(G, r, H*D/G)`). To isolate the projection, the attention core (`_attend`) is
    replaced by a fixed random output and the other ops (norm, rope, fake quant) by identities;
    `linear` is our real op."""
    attn_mod = v4.DeepseekV4Attention(cfg, 0)
    _randomize(attn_mod)
    H, D, G, r = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups, cfg.o_lora_rank
    B, S = 2, 5
    o = torch.randn(B, S, H, D)  # V4 layout after the transpose: [B, S, H, D]
    with torch.no_grad():
        ref = attn_mod.o_b_proj(attn_mod.o_a_proj(o.reshape(B, S, G, -1)).flatten(2))

    T = B * S
    mcfg = SimpleNamespace(
        compress_ratios=(0,), kv_source_layer_ids=(), index_source_layer_ids=(), candidate_source_layer_id=-1,
        kv_source_of=lambda layer: None, head_dim=D, num_attention_heads=H, o_groups=G, rms_norm_eps=1e-6,
    )
    wo_a = attn_mod.o_a_proj.weight.detach()
    w = SimpleNamespace(
        wq_a=torch.randn(cfg.q_lora_rank, cfg.hidden_size), q_norm=None, wq_b=torch.randn(H * D, cfg.q_lora_rank),
        wkv=torch.randn(D, cfg.hidden_size), kv_norm=None,
        wo_a=wo_a.view(G, r, wo_a.shape[1]), wo_b=attn_mod.o_b_proj.weight.detach(),
    )
    ident = SimpleNamespace(
        linear=linear, grouped_linear=grouped_linear, rms_norm=lambda x, wt, eps: x, rope=lambda x, *a, **k: x,
        fake_quant_fp8=lambda x, *a: x,
    )
    ours_attn = Attention(mcfg, 0, w, ident, rope_freqs=torch.ones(D // 4), compress_freqs=torch.ones(D // 4))
    ours_attn._attend = lambda q, kv, kv_parts, meta, pools: o.reshape(T, H, D)
    # the window cache as is (not the stored formats)
    pools = SimpleNamespace(layout=SimpleNamespace(win_codec=RawCodec(torch.float32), as_stored=False))
    with torch.no_grad():
        ours = ours_attn(torch.randn(T, cfg.hidden_size), SimpleNamespace(positions=torch.arange(T), cp=None), pools)
    _check("grouped output projection", ours, ref.reshape(T, -1))


# ---------------------------------------------------------------------------------------------
# router
# ---------------------------------------------------------------------------------------------
def test_sqrtsoftplus_router(cfg):
    """`DeepseekV4TopKRouter` (non-hash layers): sqrt(softplus(x W^T)), top-k of scores + random
    `e_score_correction_bias` (selection only), weights = the unbiased scores of the chosen experts,
    normalised with the 1e-20 floor, times `routed_scaling_factor` (2.5 here) vs our `moe_router`
    with scoring_func="sqrtsoftplus", gate_temp=1, norm_topk_prob=True. V4 returns unsorted top-k,
    so both are sorted by expert id before comparing. Index sets must be identical; the inputs are
    asserted tie-free (k-th vs (k+1)-th biased score gap > 1e-3) and the bias is asserted to change
    the selection of some token (so ignoring or mis-applying it would fail)."""
    router = v4.DeepseekV4TopKRouter(cfg)
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, cfg.hidden_size) * cfg.hidden_size**-0.5 * 2.0)
        router.e_score_correction_bias.copy_(torch.randn(E) * 0.3)
    x = torch.randn(64, cfg.hidden_size)
    with torch.no_grad():
        _, w_ref, i_ref = router(x)
        scores = torch.sqrt(torch.nn.functional.softplus(x @ router.weight.T))
        chooser = (scores + router.e_score_correction_bias).sort(-1, descending=True).values
    assert (chooser[:, k - 1] - chooser[:, k]).min() > 1e-3, "seed gives a near-tie; pick another"
    unbiased = scores.topk(k, -1).indices.sort(-1).values
    assert (unbiased != i_ref.sort(-1).values).any(), "bias does not change any selection; test is weak"

    w, idx = k_moe.moe_router(
        x, router.weight.detach(), router.e_score_correction_bias, k, "sqrtsoftplus", 1.0, True,
        cfg.routed_scaling_factor,
    )
    i_ref_s, o_ref = i_ref.sort(-1)
    idx_s, o = idx.sort(-1)
    assert torch.equal(idx_s, i_ref_s), "top-k expert sets differ"
    _check("router weights", w.gather(1, o), w_ref.gather(1, o_ref))


def test_moe_block_experts(cfg):
    """A whole non-hash `DeepseekV4SparseMoeBlock` (TopKRouter + routed experts + shared expert,
    SwiGLU with `swiglu_limit` clamps: gate <= L, |up| <= L) vs `moe_router` + `moe_experts`.
    V4 packs an expert as `gate_up_proj[e]` = [gate; up] ([2I, D]) and `down_proj[e]` ([D, I]);
    ours takes (w1, w2, w3) = (gate, down, up). V4 scales by the routing weight after the down
    projection, ours before it (equal up to rounding, w2 is linear). limit 1.0 so the clamps bite
    (asserted)."""
    cfg = _config(swiglu_limit=1.0)
    cfg._experts_implementation = "eager"
    block = v4.DeepseekV4SparseMoeBlock(cfg, 1)
    _randomize(block)
    with torch.no_grad():
        block.gate.e_score_correction_bias.copy_(torch.randn(cfg.n_routed_experts) * 0.3)
    x = torch.randn(2, 8, cfg.hidden_size)
    with torch.no_grad():
        ref = block(x)
        flat = x.reshape(-1, cfg.hidden_size)
        I = cfg.moe_intermediate_size
        gu = block.experts.gate_up_proj
        experts = [(gu[e, :I], block.experts.down_proj[e], gu[e, I:]) for e in range(cfg.n_routed_experts)]
        se = block.shared_experts
        shared = (se.gate_proj.weight, se.down_proj.weight, se.up_proj.weight)
        w, idx = k_moe.moe_router(flat, block.gate.weight, block.gate.e_score_correction_bias,
                                  cfg.num_experts_per_tok, "sqrtsoftplus", 1.0, True, cfg.routed_scaling_factor)
        ours = k_moe.moe_experts(flat, w, idx, experts, shared, cfg.swiglu_limit)
        pre_act = flat @ gu.flatten(0, 1).T
    assert (pre_act > cfg.swiglu_limit).any() and (pre_act < -cfg.swiglu_limit).any()
    _check("MoE block (router + experts + shared)", ours, ref.reshape(-1, cfg.hidden_size))


# ---------------------------------------------------------------------------------------------
# compressor pooling
# ---------------------------------------------------------------------------------------------
def test_compressor_pooling_non_overlapping():
    """`DeepseekV4HCACompressor` with its rate set to 2 (V4's non-overlapping, softmax-gated window
    pooling; V4.1's CSA2 ratio-2 compressor pools the same way): per channel softmax over the
    window of (gate + position_bias), weighted sum of kv, RMSNorm(weight), RoPE ("compress" theta)
    at position w * ratio -- vs our `linear` -> `compressor_pool` -> `rms_norm` -> `rope`. V4's learned
    `position_bias` (random here) has no counterpart in our V4.1 path, so it is folded into the
    gate we pass to `compressor_pool`. V4's CSA overlap windows (Ca/Cb, width 2*ratio) and V4.1's
    ratio-1 (gate-free) compressor and FP4 fake quantization of the entries are not compared. Also
    checks V4's causal block bias against the visibility rule our indexer uses (w < (t+1)//ratio)."""
    ratio = 2
    torch.manual_seed(0)
    cfg = _config(layer_types=["sliding_attention", "heavily_compressed_attention"],
                  compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": ratio})
    comp = v4.DeepseekV4HCACompressor(cfg)
    _randomize(comp)
    with torch.no_grad():
        comp.position_bias.copy_(torch.randn_like(comp.position_bias))
    B, S = 2, 11  # 5 complete windows, 1 leftover token
    x = torch.randn(B, S, cfg.hidden_size)
    pos = torch.arange(S).expand(B, S)
    with torch.no_grad():
        ref, block_bias = comp(x, None, pos, None, 0)  # [B, 1, n, D], [B, 1, S, n]
        n = S // ratio
        freqs = default_inv_freq(cfg.compress_rope_theta, cfg.qk_rope_head_dim)
        for b in range(B):
            kv = linear(x[b, : n * ratio], comp.kv_proj.weight)
            gate = linear(x[b, : n * ratio], comp.gate_proj.weight) + comp.position_bias.repeat(n, 1)
            latent = rms_norm(k_comp.compressor_pool(kv, gate, ratio), comp.kv_norm.weight, cfg.rms_norm_eps)
            ours = rope(latent, torch.arange(n) * ratio, freqs)
            _check("compressor pooling + norm + rope (ratio 2)", ours, ref[b, 0])
    visible = (torch.arange(S) + 1) // ratio
    ours_bias = torch.zeros(S, n).masked_fill(torch.arange(n)[None, :] >= visible[:, None], float("-inf"))
    assert torch.equal(block_bias[0, 0], ours_bias)


# ---------------------------------------------------------------------------------------------
# indexer
# ---------------------------------------------------------------------------------------------
def test_indexer_scores(cfg):
    """`DeepseekV4IndexerScorer`: sum_h (weights_proj(x) * h^-1/2)[h] * relu(q_h . k) * d^-1/2 vs our
    `indexer_scores(q, k, weights, d^-1/2)` with `weights = x W_proj^T * h^-1/2` computed outside
    (our op takes pre-scaled weights). Batch 2, keys differ per batch element."""
    scorer = v4.DeepseekV4IndexerScorer(cfg)
    _randomize(scorer, std=cfg.hidden_size**-0.5 * 2.0)
    B, S, G, h, d = 2, 7, 9, cfg.index_n_heads, cfg.index_head_dim
    q = torch.randn(B, S, h, d)
    keys = torch.randn(B, G, d)
    x = torch.randn(B, S, cfg.hidden_size)
    with torch.no_grad():
        ref = scorer(q, keys, x)  # [B, S, G]
        wts = linear(x.flatten(0, 1), scorer.weights_proj.weight) * h**-0.5
        q_seq = torch.arange(B).repeat_interleave(S)  # our op scores every query against its own sequence's keys
        ours = k_index.indexer_scores(q.flatten(0, 1), keys, q_seq, wts, d**-0.5)
        _check("indexer scores", ours, ref.flatten(0, 1))
    assert (ref < 0).any() and (ref > 0).any()  # weights are signed: relu alone does not decide


def test_indexer_causal_topk(cfg):
    """A whole `DeepseekV4Indexer` forward (no cache, positions 0..S-1, ratio 4, index_topk 3): its
    scorer's live inputs (queries after q_b_proj + RoPE, its compressed keys, hidden states) are
    captured with a forward hook and re-scored with `indexer_scores`; then V4's causal selection
    (entry w visible to query t iff w < (t+1)//ratio, top-k over visible scores, out-of-range picks
    -> -1) is compared with our `index_topk(scores, visible=(pos+1)//ratio, topk)` as index sets.
    The key *production* path (V4's own overlapping indexer compressor vs V4.1 keys from the shared
    latent) is not compared -- it differs by design."""
    cfg = _config(index_topk=3)
    idx_mod = v4.DeepseekV4Indexer(cfg)
    _randomize(idx_mod, std=cfg.hidden_size**-0.5 * 2.0)
    B, S = 2, 26  # 6 complete windows of 4, 2 leftover tokens
    x = torch.randn(B, S, cfg.hidden_size)
    q_res = torch.randn(B, S, cfg.q_lora_rank)
    pos = torch.arange(S).expand(B, S)
    seen = {}
    hook = idx_mod.scorer.register_forward_hook(lambda m, args, out: seen.update(args=args, out=out))
    try:
        with torch.no_grad():
            ref_idx = idx_mod(x, q_res, pos, None, 1)  # [B, S, k]
    finally:
        hook.remove()
    q, keys, hid = seen["args"]
    G = keys.shape[1]
    assert G == S // 4
    visible = (torch.arange(S) + 1) // 4
    with torch.no_grad():
        for b in range(B):
            wts = linear(hid[b], idx_mod.scorer.weights_proj.weight) * cfg.index_n_heads**-0.5
            scores = k_index.indexer_scores(q[b], keys[b][None], torch.zeros(S, dtype=torch.long), wts,
                                            cfg.index_head_dim**-0.5)
            _check("indexer scores (live indexer inputs)", scores, seen["out"][b])
            # tie-free where the cut matters
            for t in range(S):
                v = scores[t, : visible[t]].sort(descending=True).values
                if len(v) > cfg.index_topk:
                    assert v[cfg.index_topk - 1] - v[cfg.index_topk] > 1e-4, "near-tie; pick another seed"
            selected, cand = k_index.index_topk(scores, visible, cfg.index_topk)
            assert cand is None
            ref_mask = torch.zeros(S, G + 1, dtype=torch.bool)
            ref_mask.scatter_(1, torch.where(ref_idx[b] >= 0, ref_idx[b], G), True)
            assert torch.equal(selected, ref_mask[:, :G]), f"selected entries differ (batch {b})"
    # the case must exercise all three regimes: nothing visible, fewer than k, top-k cut
    counts = selected.sum(-1)
    assert counts[0] == 0 and (counts == 2).any() and (visible > cfg.index_topk).any()
