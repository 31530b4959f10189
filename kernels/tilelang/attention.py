"""Registry-facing `sink_attention` (per-query bf16 key slates) and the decode fast path `sink_attention_decode`
over the FP8 window ring and FP4 compressed pool, as stored.

`sink_attention` keeps the torch op's contract (per-query bf16 key slates, K = V, additive bias) but computes the
logits and the softmax in fp32 (the torch op rounds logits to bf16 first), so it matches a float64 reference
more closely than the torch op does. Both paths split each query's keys over CTAs so that a small batch still
fills the GPU; the splits are merged by attention_combine_kernel.

The split count follows the number of queries (default_splits), and with it the order in which a query's key
blocks are summed: a query's output can differ in the last bits between batch sizes. With the registry's
batch-invariant mode every query runs as one split (the order of its key blocks is then fixed; the masked
padding blocks of a longer slate add exact zeros), at the cost of parallelism at small batch.
"""

import torch

from deepinfer.kernels import registry
from deepinfer.kernels.torch import attention as torch_attention

from ._build import jit, sm_count
from ._fallback import reason
from .attention_combine_kernel import build_sink_combine
from .attention_decode_kernel import REGS, build_sink_attention_decode
from .attention_kernel import build_sink_attention_dense

BLOCK_KEYS = 64  # keys per block of both kernels
# the most key splits of a decode query launched as one thread block cluster and merged through distributed shared
# memory instead of fp32 partials in HBM and the combine launch (build_sink_attention_decode's cluster; the same
# bits). 8, a portable cluster: B=64's two splits, DSpark's verification rows' 3-5; 0: always the combine launch.
# On the H100, B=64 at 32K: 32.0 us clustered vs 36.5; 16 (a non-portable cluster, also B=1 and 8's ten splits) lost
# there, 23.6 vs 9.7 us at B=1 (benchmarks/results/attention_decode_gpu_s25_h100.log)
CLUSTER_SPLITS = 8
# rows of each 64-key block that WG1 dequantises in the time it waits for WG0's P, the producer converting the rest
# (build_sink_attention_decode's wg1_rows; the same bits). 0: the producer all (the one-split kernel's producer was
# late for ~30% of WG0's blocks, WG1 idle ~55% of its time: Nsight Compute, docs/hopper-sessions.md). 16 from the
# thirty-ninth session: on the H100 at 32K, B=2048 535 us vs 562, B=256 73.4 vs 75.8, B=64 30.5 vs 32.3; 8 was between
# (benchmarks/results/attention_decode_gpu_wg1rows_s39_h100), 24 and 32 slower (578 and 608 us at B=2048: WG1 then
# sets the pace); attention_decode_gpu's "wg1rows12" / "wg1rows20" probe either side
WG1_ROWS = 16


def default_splits(n_q: int, n_blocks: int, sms: int) -> int:
    """Key splits per query: about one CTA per SM over the batch (n_q * splits ~ SMs; the decode kernel takes a
    whole SM per CTA), at least one key block per split. Only speed depends on it (and the last bits of the sum).
    The count is then cut to the splits that get blocks: each split takes ceil(n_blocks / splits) blocks, so 8
    splits of 10 blocks leave the last three empty; 5 do the same work with the same sums (an empty split adds
    exact zeros to the combine) without the empty CTAs, and fewer distinct counts mean fewer kernels to compile
    (10 blocks: 1, 2, 3, 4, 5 or 10 splits)."""
    return used_splits(max(1, min(n_blocks, sms // max(n_q, 1))), n_blocks)


def _splits(n_q: int, n_blocks: int, device) -> int:
    return 1 if registry.batch_invariant() else default_splits(n_q, n_blocks, sm_count(str(device)))


def used_splits(splits: int, n_blocks: int) -> int:
    """The splits of `splits` that get key blocks (each takes ceil(n_blocks / splits)): the decode kernel is
    built for those only. A split starting past the last block is not an empty split to that kernel: TileLang
    folds its clamped block count max(min(NB - start, PER), 0) to PER, so it read another query's selection and
    its garbage reached the combine as NaN (the H200's DSpark NaN, docs/dspark.md)."""
    per = -(-n_blocks // max(1, splits))
    return -(-n_blocks // per)


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
        if keys.shape[1] == 0:
            why = "no keys"
        elif keys.dtype != q.dtype:
            why = "keys and q differ in dtype"
        else:
            why = reason(q, "heads != 64 or head dim not a multiple of 64")
        return registry.fall_back("sink_attention", why, torch_attention.sink_attention, q, keys, bias, sink, scale)
    n_blocks = -(-keys.shape[1] // BLOCK_KEYS)
    splits = _splits(S, n_blocks, q.device)
    kernel = jit(build_sink_attention_dense, H, D, BLOCK_KEYS, splits)
    out = torch.empty(S, H, D, dtype=torch.bfloat16, device=q.device)
    args = ((q.contiguous(), keys.contiguous(), bias.float().contiguous()), (float(scale),))
    return _run(kernel, S, splits, H, D, sink.float().contiguous(), out, args, permuted=False)


def sink_attention_decode(q, q_seq, q_pos, win_kv, win_scale, win_pos, cmp_kv, cmp_scale, sel, sink, scale,
                          window: int = 128, splits: int | None = None):
    """The registered op (contract: deepinfer.kernels.torch.attention.sink_attention_decode): the kernel for
    64 heads of 512 in bf16 over a ring of exactly `window` rows; the selection is padded to whole key blocks."""
    n_q, H, D = q.shape
    if not (q.is_cuda and q.dtype == torch.bfloat16 and H == 64 and D == 512 and win_kv.shape[1] >= window
            and window % BLOCK_KEYS == 0 and win_kv.shape[1] % BLOCK_KEYS == 0 and n_q > 0):
        why = reason(q, "heads != 64, head dim != 512, or a window / ring not a multiple of 64 rows")
        return registry.fall_back("sink_attention_decode", why, torch_attention.sink_attention_decode, q, q_seq,
                                  q_pos, win_kv, win_scale, win_pos, cmp_kv, cmp_scale, sel, sink, scale, window)
    pad = -sel.shape[1] % BLOCK_KEYS or (BLOCK_KEYS if sel.shape[1] == 0 else 0)
    if pad:  # unused slots are -1: masked in the kernel
        sel = torch.nn.functional.pad(sel, (0, pad), value=-1)
    return sink_attention_decode_kernel(q, q_seq.int(), q_pos.int(), win_kv, win_scale, win_pos, cmp_kv, cmp_scale,
                                        sel.int(), sink, scale, window, splits)


def _clustered(splits: int) -> bool:
    return 2 <= splits <= CLUSTER_SPLITS


def decode_spec(window: int, topk: int, splits: int, ring: int, probe: str = "") -> tuple:
    """jit's arguments for the decode kernel: the builder's arguments past `splits` only up to the last that differs
    from the builder's default (the ring's width when wider than the window: rollback rows for speculative decoding,
    a compile-time shape; a probe; a cluster of the splits), so equal kernels get equal specs (the compile cache,
    the JIT manifest)."""
    tail = [None, REGS[WG1_ROWS], ring if ring != window else None, probe, _clustered(splits), WG1_ROWS]
    defaults = [None, REGS[0], None, "", False, 0]
    while tail and tail[-1] == defaults[len(tail) - 1]:
        tail.pop()
    return (build_sink_attention_decode, 64, 512, window, topk, splits, *tail)


def sink_attention_decode_kernel(q, q_seq, q_pos, win_kv, win_scale, win_pos, cmp_kv, cmp_scale, sel, sink, scale,
                                 window: int = 128, splits: int | None = None, probe: str = ""):
    """Decode attention for a batch of query tokens (1..6 per sequence, any mix), reading the caches as stored
    (attention_decode_kernel; ~23% / 37% of its roofline at B=64 / 256, 32K, on an H100).

    q [Nq, 64, 512] bf16 (RoPE applied); q_seq [Nq] int32 sequence of each query; q_pos [Nq] int32 its position.
    win_kv [B, W, 512] uint8 (e4m3 bits) with win_scale [B, W, 16] uint8 (ue8m0 per 32 channels) and win_pos
    [B, W] int32 (absolute position held by each ring slot, -1 empty); position pos lives in ring row pos mod W
    (the pools' layout, models/cache), so the window of a query at p is the rows of positions p - window + 1 .. p,
    read oldest first, each kept when its row still holds that position. cmp_kv [P, 256] uint8 (e2m1 pairs, low
    nibble = even channel) with cmp_scale [P, 32] uint8 (e4m3 per 16 channels): the compressed pool; sel [Nq, topk]
    int32 rows of it chosen by the indexer (-1 none).
    sink [64] fp32. Returns [Nq, 64, 512] bf16 = softmax-with-sink over [window ∥ selected] keys times the keys.
    splits: key splits per query (None: default_splits, or 1 in the batch-invariant mode).
    probe: a timing probe of the kernel (attention_decode_kernel.PROBES; wrong output, benchmarks only).
    """
    n_q, H, D = q.shape
    R, topk = win_kv.shape[1], sel.shape[1]
    assert R >= window and H == 64 and D == 512 and n_q > 0
    n_blocks = (window + topk) // BLOCK_KEYS
    splits = used_splits(splits or _splits(n_q, n_blocks, q.device), n_blocks)
    kernel = jit(*decode_spec(window, topk, splits, R, probe))
    out = torch.empty(n_q, H, D, dtype=torch.bfloat16, device=q.device)
    args = ((q.contiguous(), q_seq, q_pos, win_kv, win_scale, win_pos, cmp_kv, cmp_scale, sel.contiguous()),
            (float(scale),))
    # clustered splits merge in the kernel: no partials, no combine
    return _run(kernel, n_q, 1 if _clustered(splits) else splits, H, D, sink.float().contiguous(), out, args,
                permuted=True)
