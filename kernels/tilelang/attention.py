"""Registry-facing `sink_attention` and the decode fast path over the FP8 window ring and FP4 compressed pool.

`sink_attention` keeps the torch op's contract (per-query bf16 key slates, K = V, additive bias) but computes the
logits and the softmax in fp32 (the torch op rounds logits to bf16 first), so it matches a float64 reference
more closely than the torch op does. `sink_attention_decode` is the kernel-level entry for a decode batch.
"""

import torch

from deepinfer.kernels.torch import attention as torch_attention

from ._build import jit
from .attention_kernel import build_sink_attention, build_sink_combine

SMS = 132  # H200 multiprocessors; only steers the key-split count (correct for any value)


def _splits(n_q: int, n_blocks: int) -> int:
    return max(1, min(n_blocks, SMS // max(n_q, 1)))


def _run(kernel, n_q, splits, heads, dim, sink, out, args, permuted):
    dev = out.device
    # with one split the kernel normalises in place and never touches the partial buffers (allocated, unused)
    o_part = torch.empty(n_q, splits, heads, dim, dtype=torch.float32, device=dev)
    ml_part = torch.empty(n_q, splits, 2, heads, dtype=torch.float32, device=dev)
    kernel(*args[0], sink, out, o_part, ml_part, *args[1])
    if splits > 1:
        jit(build_sink_combine, heads, dim, splits, permuted)(o_part, ml_part, sink, out)
    return out


def sink_attention(q, keys, bias, sink, scale):
    """Same contract as deepinfer.kernels.torch.attention.sink_attention (q [T, H, D], keys [T, K, D] each
    query's own slate, bias [T, K], sink [H]); kernel path for bf16 on CUDA with 64 heads, D % 64 == 0."""
    S, H, D = q.shape
    if not (q.is_cuda and q.dtype == torch.bfloat16 and keys.dtype == torch.bfloat16 and H == 64 and D % 64 == 0
            and keys.shape[1] > 0 and S > 0):
        return torch_attention.sink_attention(q, keys, bias, sink, scale)
    kv = keys
    n_blocks = -(-kv.shape[1] // 64)
    splits = _splits(S, n_blocks)
    kernel = jit(build_sink_attention, "dense", H, D, 128, 512, 64, splits)
    out = torch.empty(S, H, D, dtype=torch.bfloat16, device=q.device)
    args = ((q.contiguous(), kv.contiguous(), bias.float().contiguous()), (float(scale),))
    return _run(kernel, S, splits, H, D, sink.float().contiguous(), out, args, permuted=False)


def sink_attention_decode(q, q_seq, q_pos, win_kv, win_scale, win_pos, cmp_kv, cmp_scale, sel, sink, scale,
                          window: int = 128, splits: int | None = None):
    """The decode fast path: the warp-specialised v2 kernel (attention_kernel_v2; 1.3-1.8x v1 on an H200,
    benchmarks/results/attn_v2_gpu_h200.json). Contract: sink_attention_decode_v1."""
    from .attention_kernel_v2 import sink_attention_decode_v2

    return sink_attention_decode_v2(q, q_seq, q_pos, win_kv, win_scale, win_pos, cmp_kv, cmp_scale, sel, sink,
                                    scale, window, splits)


def sink_attention_decode_v1(q, q_seq, q_pos, win_kv, win_scale, win_pos, cmp_kv, cmp_scale, sel, sink, scale,
                             window: int = 128, splits: int | None = None):
    """Decode attention for a batch of query tokens (1..6 per sequence, any mix), reading the caches as stored.

    q [Nq, 64, 512] bf16 (RoPE applied); q_seq [Nq] int32 sequence of each query; q_pos [Nq] int32 its position.
    win_kv [B, W, 512] uint8 (e4m3 bits) with win_scale [B, W, 16] uint8 (ue8m0 per 32 channels) and win_pos
    [B, W] int32 (absolute position held by each ring slot, -1 empty); a slot is visible to a query at p when
    p - W < pos <= p. cmp_kv [P, 256] uint8 (e2m1 pairs, low nibble = even channel) with cmp_scale [P, 32] uint8
    (e4m3 per 16 channels): the compressed pool; sel [Nq, topk] int32 rows of it chosen by the indexer (-1 none).
    sink [64] fp32. Returns [Nq, 64, 512] bf16 = softmax-with-sink over [window ∥ selected] keys times the keys.
    """
    n_q, H, D = q.shape
    W, topk = win_kv.shape[1], sel.shape[1]
    assert W == window and H == 64
    n_blocks = (W + topk) // 64
    splits = splits or _splits(n_q, n_blocks)
    kernel = jit(build_sink_attention, "paged", H, D, W, topk, 64, splits)
    out = torch.empty(n_q, H, D, dtype=torch.bfloat16, device=q.device)
    args = ((q.contiguous(), q_seq, q_pos, win_kv, win_scale, win_pos, cmp_kv, cmp_scale, sel.contiguous()),
            (float(scale),))
    return _run(kernel, n_q, splits, H, D, sink.float().contiguous(), out, args, permuted=True)
