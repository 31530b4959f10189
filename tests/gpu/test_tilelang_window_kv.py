"""`window_kv` on the GPU (marker gpu): one launch writes what the five unfused launches wrote, bit for bit. The
reference is the TileLang composition (rms_norm, rope, encode_fp8, then the ring's index_copy_ writes), whose
kernels are each bitwise the torch ops (test_tilelang_rowwise.py, where RoPE's cos / sin may differ from torch's
in a last bit: so against the torch op itself a thousandth of the bytes may differ; none expected)."""

import pytest
import torch

from deepinfer.kernels import registry
from deepinfer.kernels.torch import rope as ref_rope
from deepinfer.kernels.torch import window_kv as ref_window_kv

from ._helpers import poison_allocator

pytestmark = pytest.mark.gpu

DIM, ROPE = 512, 64  # V4.1's head dim and rope dim
RING_ROWS = 1000


def _case(rows: int, seed: int, spread: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    kv = (torch.randn(rows, DIM, generator=g) * spread).bfloat16()
    kv[:, :7] *= 300.0  # a few large channels: the scale blocks' amax varies
    weight = (1.0 + 0.2 * torch.randn(DIM, generator=g)).bfloat16()
    pos = torch.randint(0, 1 << 20, (rows,), generator=g)
    inv_freq = ref_rope.default_inv_freq(10000.0, ROPE)
    trash = RING_ROWS - 1
    write = torch.randperm(RING_ROWS - 1, generator=g)[:rows]
    write[torch.rand(rows, generator=g) < 0.2] = trash  # tokens whose row a later token of the step takes
    dev = "cuda"
    return kv.to(dev), weight.to(dev), pos.to(dev), inv_freq.to(dev), write.to(dev)


def _rings(seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    codes = torch.randint(0, 256, (RING_ROWS, DIM), dtype=torch.uint8, device="cuda", generator=g)
    scales = torch.randint(0, 256, (RING_ROWS, DIM // 32), dtype=torch.uint8, device="cuda", generator=g)
    return codes, scales


def _composed(kv, weight, pos, inv_freq, codes, scales, write):
    from deepinfer.kernels.tilelang import rowwise

    c, s, _ = rowwise.encode_fp8(rowwise.rope(rowwise.rms_norm(kv, weight, 1e-6), pos, inv_freq))
    codes.index_copy_(0, write, c)
    scales.index_copy_(0, write, s)


def _kept(ring):
    """The ring without its trash row (several tokens may write it, in any order)."""
    keep = torch.ones(ring.shape[0], dtype=torch.bool, device=ring.device)
    keep[RING_ROWS - 1] = False
    return ring[keep]


# rows 1-4: 128 lanes a row in ATen's reduction, 8-15: 64, from 16: 32 (rowwise.torch_reduce_lanes)
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 12, 16, 40, 300])
def test_one_launch_writes_the_rows_the_five_launches_write(rows, either_mode):
    from deepinfer.kernels.tilelang import window_kv

    kv, weight, pos, inv_freq, write = _case(rows, seed=rows)
    assert window_kv.why_not(kv, weight, pos, inv_freq, *_rings(0), write) is None
    ref = _rings(rows)
    _composed(kv, weight, pos, inv_freq, *ref, write)
    got = _rings(rows)  # the same untouched rows as the reference's
    poison_allocator()
    window_kv.window_kv(kv, weight, 1e-6, pos, inv_freq, *got, write)
    torch.cuda.synchronize()
    for g, r in zip(got, ref):
        assert torch.equal(_kept(g), _kept(r)), (rows, either_mode, int((g != r).sum()))
    torch_rings = _rings(rows)
    ref_window_kv.window_kv(kv, weight, 1e-6, pos, inv_freq, *torch_rings, write)
    differ = sum(int((_kept(g) != _kept(r)).sum()) for g, r in zip(got, torch_rings))
    print(f"window_kv rows={rows}: {differ} bytes differ from the torch op")  # RoPE's cos / sin: expected none
    assert differ <= rows * DIM // 1000, differ


def test_a_graph_replay_writes_the_same_rows():
    from deepinfer.kernels.tilelang import window_kv

    kv, weight, pos, inv_freq, write = _case(8, seed=3, spread=4.0)
    eager = _rings(5)
    window_kv.window_kv(kv, weight, 1e-6, pos, inv_freq, *eager, write)
    replayed = _rings(5)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        window_kv.window_kv(kv, weight, 1e-6, pos, inv_freq, *_rings(6), write)  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        window_kv.window_kv(kv, weight, 1e-6, pos, inv_freq, *replayed, write)
    graph.replay()  # (the capture ran nothing: the rings are as drawn)
    torch.cuda.synchronize()
    for g, r in zip(replayed, eager):
        assert torch.equal(_kept(g), _kept(r))


def test_inputs_the_kernel_does_not_cover_take_the_torch_op():
    from deepinfer.kernels.tilelang import window_kv

    kv, weight, pos, inv_freq, write = _case(4, seed=9)
    rings = _rings(1)
    assert window_kv.why_not(kv.float(), weight, pos, inv_freq, *rings, write) is not None
    assert "norm weight" in window_kv.why_not(kv, weight.float(), pos, inv_freq, *rings, write)
    assert "write rows" in window_kv.why_not(kv, weight, pos, inv_freq, *rings, write.int())
    assert "ring parts" in window_kv.why_not(kv, weight, pos, inv_freq, rings[0][:, :256], rings[1], write)
    why = "width, row count or norm weight not covered"  # an fp32 norm weight: the torch op
    before = registry.fallback_counts().get("window_kv", {}).get(why, 0)
    got, ref = _rings(2), _rings(2)
    window_kv.window_kv(kv, weight.float(), 1e-6, pos, inv_freq, *got, write)
    ref_window_kv.window_kv(kv, weight.float(), 1e-6, pos, inv_freq, *ref, write)
    assert all(torch.equal(g, r) for g, r in zip(got, ref))
    assert registry.fallback_counts()["window_kv"][why] == before + 1
