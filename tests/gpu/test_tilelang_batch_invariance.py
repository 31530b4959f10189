"""Batch invariance of the TileLang attention and MoE launchers on the GPU (marker gpu): with the registry's
batch-invariant mode a row's output is bitwise the same alone, inside any batch and run after run; without it the
split counts, token tiles and the MoE's fp32 atomics may change the last bits (docs/hopper-kernels.md)."""

import pytest
import torch

from deepinfer.kernels import registry

from ._helpers import fp4_rows16_e4m3, fp8_rows32
from .test_tilelang_moe_kernel import _experts

pytestmark = pytest.mark.gpu

H, D, W, TOPK = 64, 512, 128, 512


@pytest.fixture
def invariant():
    registry.OpSet.build("cuda", ["torch"], batch_invariant=True)  # the mode is the process's, set by OpSet.build
    yield
    registry.OpSet.build("cuda", ["torch"], batch_invariant=False)


def _decode_case(B, seed):
    g = torch.Generator().manual_seed(seed)
    win_kv, win_sc, _ = fp8_rows32(B * W, D, g)
    cmp_kv, cmp_sc, _ = fp4_rows16_e4m3(4000, D, g)
    base = torch.randint(200, 5000, (B,), generator=g)
    win_pos = torch.stack([base[b] + (torch.arange(W) - base[b]) % W for b in range(B)]).int()  # row = pos mod W
    q_pos = (base + W - 1).int()
    sel = torch.stack([torch.randperm(4000, generator=g)[:TOPK] for _ in range(B)]).int()
    sel[:, -50:] = -1
    q = (torch.randn(B, H, D, generator=g) * 0.5).bfloat16()
    dev = "cuda"
    return dict(q=q.to(dev), q_seq=torch.arange(B, dtype=torch.int32, device=dev), q_pos=q_pos.to(dev),
                win=(win_kv.view(B, W, D).to(dev), win_sc.view(B, W, D // 32).to(dev), win_pos.to(dev)),
                pool=(cmp_kv.to(dev), cmp_sc.to(dev)), sel=sel.to(dev), sink=torch.randn(H, generator=g).to(dev))


def test_decode_attention_rows_are_bitwise_equal_alone_and_in_any_batch(invariant):
    from deepinfer.kernels.tilelang.attention import sink_attention_decode

    c = _decode_case(96, seed=5)

    def run(rows):
        return sink_attention_decode(c["q"][rows], c["q_seq"][rows], c["q_pos"][rows], *c["win"], *c["pool"],
                                     c["sel"][rows], c["sink"], D ** -0.5)

    full = run(slice(None))
    assert torch.equal(full, run(slice(None)))  # run to run
    for rows in (slice(0, 1), slice(0, 7), slice(40, 41), slice(30, 94)):
        assert torch.equal(run(rows), full[rows]), rows


def test_dense_attention_rows_are_bitwise_equal_whatever_the_slate_padding(invariant):
    from deepinfer.kernels.tilelang.attention import sink_attention

    g = torch.Generator().manual_seed(9)
    lens = [70, 300, 650, 129]
    q = (torch.randn(len(lens), H, D, generator=g) * 0.5).bfloat16().cuda()
    slates = [(torch.randn(n, D, generator=g) * 2).bfloat16().cuda() for n in lens]
    sink = torch.randn(H, generator=g).cuda()

    def batch(ids):
        K = max(lens[i] for i in ids)
        keys = torch.zeros(len(ids), K, D, dtype=torch.bfloat16, device="cuda")
        bias = torch.full((len(ids), K), float("-inf"), device="cuda")
        for r, i in enumerate(ids):
            keys[r, :lens[i]] = slates[i]
            bias[r, :lens[i]] = 0.0
        return sink_attention(q[list(ids)], keys, bias, sink, D ** -0.5)

    full = batch(range(len(lens)))
    for i in range(len(lens)):
        assert torch.equal(batch([i])[0], full[i]), i


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_moe_rows_are_bitwise_equal_alone_and_in_any_batch(invariant, fmt):
    from deepinfer.kernels.tilelang.moe import moe_experts_packed

    E, Dm, I, k, T = 16, 1024, 512, 6, 48
    g = torch.Generator(device="cuda").manual_seed(3)
    routed, _ = _experts(E, Dm, I, fmt, g)
    shared, _ = _experts(1, Dm, I, "fp8", g)
    x = torch.randn(T, Dm, device="cuda", generator=g).bfloat16()
    idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, device="cuda", generator=g) + 0.1

    def run(rows):
        return moe_experts_packed(x[rows], w[rows], idx[rows], routed, shared, 10.0)

    full = run(slice(None))
    assert torch.equal(full, run(slice(None)))  # run to run: no atomics race in this mode
    for rows in (slice(0, 1), slice(5, 6), slice(0, 9), slice(10, 47)):
        assert torch.equal(run(rows), full[rows]), rows
