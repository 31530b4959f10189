"""TileLang MoE kernels vs the torch reference ops, on fresh random inputs (marker gpu)."""

import pytest
import torch

from deepinfer.kernels.torch import moe as ref

from ._helpers import fp4_rows, fp8_blocks, poison_allocator, rel_err

pytestmark = pytest.mark.gpu


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid"])
@pytest.mark.parametrize("one_split_from", [0, 64])  # moe.ROUTER_ONE_SPLIT_TOKENS: the logits in one K split
def test_router_matches_torch(tokens, scoring, one_split_from, monkeypatch):
    from deepinfer.kernels.tilelang import moe
    from deepinfer.kernels.tilelang.moe import moe_router

    monkeypatch.setattr(moe, "ROUTER_ONE_SPLIT_TOKENS", one_split_from)

    g = _gen(tokens)
    E, D, k = 384, 5120, 6
    x = torch.randn(tokens, D, generator=g).bfloat16().cuda()
    w = (torch.randn(E, D, generator=g) * 0.02).bfloat16().cuda()
    bias = (torch.randn(E, generator=g) * 0.1).cuda()
    args = (k, scoring, 1.3, True, 1.5)
    wt, ids = moe_router(x, w, bias, *args)
    rw, rids = ref.moe_router(x, w, bias, *args)
    assert ids.dtype == torch.int64 and wt.dtype == torch.float32 and torch.isfinite(wt).all()
    same = (ids.sort(-1).values == rids.sort(-1).values).all(-1)
    # near-ties in fp32 may swap one pick; the chosen biased scores must still be the top ones
    assert same.float().mean() >= 0.97, same.float().mean()
    order, rorder = ids.sort(-1), rids.sort(-1)
    wt_s = wt.gather(1, order.indices)[same]
    rw_s = rw.gather(1, rorder.indices)[same]
    assert rel_err(wt_s, rw_s) < 1e-5


def _experts(E, D, I, fmt, g):
    """Random checkpoint tensors for E experts and their dequantised bf16 (w1, w2, w3) for the reference."""
    w1, s1, w3, s3, w2, s2, dense = [], [], [], [], [], [], []
    make = fp4_rows if fmt == "fp4" else fp8_blocks
    for _ in range(E):
        a, sa, da = make(I, D, g)
        b, sb, db = make(I, D, g)
        c, sc, dc = make(D, I, g)
        w1.append(a); s1.append(sa); w3.append(b); s3.append(sb); w2.append(c); s2.append(sc)
        dense.append(tuple(t.bfloat16().cuda() for t in (da, dc, db)))
    return (w1, s1, w3, s3, w2, s2), dense


@pytest.mark.parametrize("E,D,I,tokens,skew", [
    (16, 512, 256, 1, False),
    (16, 512, 256, 5, False),
    (16, 512, 256, 40, True),     # every token on the same experts: 40 > block_t, exercises the chunk loop
    (64, 1024, 512, 64, False),
    (8, 5120, 2304, 3, False),    # the released width
])
@pytest.mark.parametrize("with_shared", [True, False])
def test_experts_match_torch(E, D, I, tokens, skew, with_shared):
    from deepinfer.kernels.tilelang.moe import moe_experts, pack_experts

    g = _gen(E * 1000 + tokens)
    gd = torch.Generator(device="cuda").manual_seed(E * 1000 + tokens)  # weights drawn on the GPU: fast
    k = min(6, E)
    raw, dense = _experts(E, D, I, "fp4", gd)
    routed = pack_experts("fp4", *[[t.cuda() for t in lst] for lst in raw])
    shared = shared_dense = None
    if with_shared:
        sraw, sdense = _experts(1, D, I, "fp8", gd)
        shared = pack_experts("fp8", *[[t.cuda() for t in lst] for lst in sraw])
        shared_dense = sdense[0]
    x = torch.randn(tokens, D, generator=g).bfloat16().cuda()
    if skew:
        idx = torch.arange(k).repeat(tokens, 1)
    else:
        idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
    idx = idx.cuda()
    weights = torch.rand(tokens, k, generator=g).cuda() + 0.1
    poison_allocator()
    out = moe_experts(x, weights, idx, routed, shared, 10.0)
    torch.cuda.synchronize()
    expect = ref.moe_experts(x, weights, idx, dense, shared_dense, 10.0)
    assert out.shape == expect.shape and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    # same bf16 rounding points as the reference; what remains is fp32 summation order -> well under 1e-2
    assert rel_err(out, expect) < 1e-2, rel_err(out, expect)
    # against float64 math on the same dequantised weights
    x64 = x.double()
    y64 = torch.zeros(tokens, D, dtype=torch.float64, device=x.device)
    for t in range(tokens):
        for j in range(k):
            w1_, w2_, w3_ = (m.double() for m in dense[idx[t, j]])
            gate, up = x64[t] @ w1_.T, (x64[t] @ w3_.T).clamp(-10, 10)
            y64[t] += (torch.nn.functional.silu(gate.clamp(max=10)) * up * weights[t, j].double()) @ w2_.T
        if with_shared:
            w1_, w2_, w3_ = (m.double() for m in shared_dense)
            gate, up = x64[t] @ w1_.T, (x64[t] @ w3_.T).clamp(-10, 10)
            y64[t] += (torch.nn.functional.silu(gate.clamp(max=10)) * up) @ w2_.T
    assert rel_err(out, y64) < 1e-2


def test_experts_dense_list_falls_back_to_torch():
    from deepinfer.kernels.tilelang.moe import moe_experts

    g = _gen(3)
    _, dense = _experts(4, 512, 256, "fp4", torch.Generator(device="cuda").manual_seed(3))
    x = torch.randn(3, 512, generator=g).bfloat16().cuda()
    idx = torch.tensor([[0, 1], [2, 3], [1, 2]]).cuda()
    w = torch.rand(3, 2, generator=g).cuda()
    assert torch.equal(moe_experts(x, w, idx, dense, None, 10.0), ref.moe_experts(x, w, idx, dense, None, 10.0))
