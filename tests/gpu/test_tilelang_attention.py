"""TileLang sink attention vs float64 math on the same (dequantised) keys, and vs the torch op (marker gpu)."""

import pytest
import torch

from deepinfer.kernels.torch import attention as ref

from ._helpers import fp4_rows16_e4m3, fp8_rows32, poison_allocator, rel_err

pytestmark = pytest.mark.gpu

H, D, W, TOPK = 64, 512, 128, 512


def _sink_ref64(q, keys, bias, sink, scale):
    """float64 softmax-with-sink over keys (K = V); q [S, H, D], keys [K, D], bias [S, K]."""
    logits = torch.einsum("shd,kd->shk", q.double(), keys.double()) * scale + bias.double()[:, None, :]
    m = torch.maximum(logits.amax(-1, keepdim=True), sink.double().view(1, -1, 1))
    e = torch.exp(logits - m)
    den = e.sum(-1, keepdim=True) + torch.exp(sink.double().view(1, -1, 1) - m)
    return torch.einsum("shk,kd->shd", e / den, keys.double())


@pytest.mark.parametrize("q_per_seq,splits", [([1, 4, 6], None), ([2, 1], 1), ([3], 3), ([1] * 9, 2)])
def test_paged_decode_matches_float64(q_per_seq, splits):
    from deepinfer.kernels.tilelang.attention import sink_attention_decode

    g = torch.Generator().manual_seed(sum(q_per_seq) * 7 + (splits or 0))
    B, n_q, pool = len(q_per_seq), sum(q_per_seq), 3000
    win_kv, win_sc, win_deq = fp8_rows32(B * W, D, g)
    cmp_kv, cmp_sc, cmp_deq = fp4_rows16_e4m3(pool, D, g)
    # ring slots hold positions [start, start + W), position pos in row pos mod W (the pools' layout), a few empty
    base = torch.randint(200, 5000, (B,), generator=g)
    win_pos = torch.stack([base[b] + (torch.arange(W) - base[b]) % W for b in range(B)]).int()
    win_pos[:, :5] = -1
    q_seq = torch.repeat_interleave(torch.arange(B), torch.tensor(q_per_seq)).int()
    q_pos = torch.cat([base[b] + W - 1 - torch.arange(n).flip(0) for b, n in enumerate(q_per_seq)]).int()
    sel = torch.stack([torch.randperm(pool, generator=g)[:TOPK] for _ in range(n_q)]).int()
    sel[:, -37:] = -1                                    # fewer visible entries than top-k
    sel[0, :] = -1 if n_q > 1 else sel[0, :]            # a query with only window keys
    q = (torch.randn(n_q, H, D, generator=g) * 0.5).bfloat16()
    sink = torch.randn(H, generator=g)
    scale = D ** -0.5
    dev = "cuda"
    poison_allocator()
    out = sink_attention_decode(q.to(dev), q_seq.to(dev), q_pos.to(dev), win_kv.view(B, W, D).to(dev),
                                win_sc.view(B, W, D // 32).to(dev), win_pos.to(dev), cmp_kv.to(dev),
                                cmp_sc.to(dev), sel.to(dev), sink.to(dev), scale, splits=splits)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    win_deq = win_deq.view(B, W, D)
    refs = []
    for i in range(n_q):
        b, p = int(q_seq[i]), int(q_pos[i])
        keys = torch.cat([win_deq[b], cmp_deq[sel[i].clamp_min(0).long()]])
        vis = torch.cat([(win_pos[b] >= 0) & (win_pos[b] <= p) & (win_pos[b] > p - W), sel[i] >= 0])
        bias = torch.where(vis, 0.0, float("-inf"))[None]
        refs.append(_sink_ref64(q[i : i + 1].float(), keys, bias, sink, scale)[0])
    expect = torch.stack(refs)
    # bf16 probabilities times bf16-exact keys, fp32 accumulation: low 1e-3s
    assert rel_err(out.cpu(), expect) < 5e-3, rel_err(out.cpu(), expect)


def test_paged_decode_no_visible_keys_gives_zeros():
    from deepinfer.kernels.tilelang.attention import sink_attention_decode

    g = torch.Generator().manual_seed(11)
    win_kv, win_sc, _ = fp8_rows32(W, D, g)
    cmp_kv, cmp_sc, _ = fp4_rows16_e4m3(64, D, g)
    dev = "cuda"
    out = sink_attention_decode(
        torch.randn(1, H, D, generator=g).bfloat16().to(dev), torch.zeros(1, dtype=torch.int32, device=dev),
        torch.full((1,), 10, dtype=torch.int32, device=dev), win_kv.view(1, W, D).to(dev),
        win_sc.view(1, W, D // 32).to(dev), torch.full((1, W), 500, dtype=torch.int32, device=dev),
        cmp_kv.to(dev), cmp_sc.to(dev), torch.full((1, TOPK), -1, dtype=torch.int32, device=dev),
        torch.randn(H, generator=g).to(dev), D ** -0.5)
    assert torch.equal(out.float().cpu(), torch.zeros(1, H, D))


@pytest.mark.parametrize("S,K", [(1, 100), (3, 300), (6, 700)])
def test_dense_registry_op(S, K):
    from deepinfer.kernels.tilelang.attention import sink_attention

    g = torch.Generator().manual_seed(S * K)
    q = (torch.randn(S, H, D, generator=g) * 0.5).bfloat16()
    keys = (torch.randn(S, K, D, generator=g) * 2).bfloat16()
    bias = torch.where(torch.rand(S, K, generator=g) < 0.3, float("-inf"), 0.0)
    bias[0, :] = float("-inf")                 # a query that sees nothing: finite zeros
    sink = torch.randn(H, generator=g)
    poison_allocator()
    out = sink_attention(q.cuda(), keys.cuda(), bias.cuda(), sink.cuda(), D ** -0.5)
    assert out.shape == (S, H, D) and out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    expect = torch.stack([_sink_ref64(q[i : i + 1].float(), keys[i].float(), bias[i : i + 1], sink, D ** -0.5)[0]
                          for i in range(S)])
    assert torch.equal(out[0].float().cpu(), torch.zeros(H, D))
    if S > 1:
        assert rel_err(out[1:].cpu(), expect[1:]) < 5e-3
        torch_op = ref.sink_attention(q.cuda(), keys.cuda(), bias.cuda(), sink.cuda(), D ** -0.5)
        assert rel_err(out[1:], torch_op[1:]) < 2e-2   # the torch op rounds logits to bf16: the looser one
