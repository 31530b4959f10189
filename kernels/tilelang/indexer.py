"""Registry-facing `indexer_scores` and the decode fast path over the FP4 indexer-key cache.

The kernels feed the tensor cores bf16: exact for the model's inputs (the indexer's q and k are FP4
fake-quantised, e2m1 x 2^k, which bf16 holds exactly); a general fp32 input is rounded to bf16 first.
"""

import torch

from deepinfer.kernels.registry import fall_back
from deepinfer.kernels.torch import indexer as torch_indexer

from ._build import jit
from ._fallback import reason
from .indexer_kernel import build_indexer_scores

BLOCK_G = 128  # entries per key tile
TILE_CHOICES = (16, 4, 1)  # key tiles per block (each one compile)
FILL_BLOCKS = 528  # blocks wanted: 4 per SM on an H200
# queries a block scores together when the step has several per sequence (a prefill chunk, DSpark's verification):
# each dequantised key tile then serves both queries' 32 MMA rows (1: one query a block, rows 32..63 zero). Two
# were 1.7x one at prefill sizes on an H100 (benchmarks/results/indexer_prefill_gpu_s33_h100.json); four (128 rows
# over two warpgroups) were 1.2x slower than two (the build: git history, 3e7ef31)
SHARED_QUERIES = 2


def queries_per_block(n_q: int, n_seq: int) -> int:
    """SHARED_QUERIES when the step's queries outnumber its sequences twice over (consecutive queries then mostly
    share a sequence; a block whose queries do not takes a pass per sequence, the same scores), else 1 (a decode
    step: one query per sequence)."""
    return SHARED_QUERIES if n_q >= 2 * n_seq else 1


def fp4_spec(h: int, d: int, tiles: int, queries: int) -> tuple:
    """jit's arguments for the fp4 kernel, `queries` only when not the builder's default (equal kernels, equal
    specs: the compile cache, the JIT manifest)."""
    return (build_indexer_scores, "fp4", h, d, BLOCK_G, 128, tiles, *((queries,) if queries > 1 else ()))


def key_tiles(n_q: int, n_g: int, queries: int = 1) -> int:
    """Key tiles one block scores for its queries: the most of TILE_CHOICES that still leaves FILL_BLOCKS blocks,
    so long contexts load each query's q a few times instead of once per 128 entries (B=256 at 32K: 8.8 ms of
    a 161 ms step with one tile per block), and short ones still spread over the GPU. A score does not depend on
    the choice (each entry's dot products are the same), so batch invariance holds."""
    tiles, blocks = -(-n_g // BLOCK_G), -(-n_q // queries)
    return next((t for t in TILE_CHOICES if blocks * -(-tiles // t) >= FILL_BLOCKS), 1)


def indexer_scores(q, k, q_seq, weights, softmax_scale):
    """Same contract as deepinfer.kernels.torch.indexer.indexer_scores: q [T, h, d], k [B, G, d] per-sequence keys,
    q_seq [T], weights [T, h] -> [T, G] fp32. The dense kernel scores one key set: a step of one sequence (a
    prefill chunk) runs on it; several sequences take the torch op (decode steps use indexer_scores_fp4)."""
    T, h, d = q.shape
    if not (q.is_cuda and k.shape[0] == 1 and 64 % h == 0 and d % 64 == 0 and k.shape[1] > 0 and T > 0):
        why = reason(q, "several sequences' keys, or a head count or width the kernel does not tile",
                     (torch.bfloat16, torch.float32))
        return fall_back("indexer_scores", why, torch_indexer.indexer_scores, q, k, q_seq, weights, softmax_scale)
    out = torch.empty(T, k.shape[1], dtype=torch.float32, device=q.device)
    jit(build_indexer_scores, "dense", h, d)(q.bfloat16().contiguous(), k[0].bfloat16().contiguous(),
                                             weights.float().contiguous(), out, float(softmax_scale))
    return out


def indexer_scores_fp4(q, q_seq, visible, k, k_scale, rows, weights, softmax_scale):
    """Decode batch: q [Nq, 32, 128] bf16 (FP4 fake-quantised values), q_seq [Nq] int32, visible [Nq] int32
    entries each query may see; the key pool k [N, 64] uint8 e2m1 pairs (low nibble = even channel) with k_scale
    [N, 4] uint8 ue8m0 per 32 channels, and rows [B, G] the pool row of entry g of sequence b; weights [Nq, 32]
    fp32 -> scores [Nq, G] fp32, -inf past visible."""
    n_q, h, d = q.shape
    if not (q.is_cuda and 64 % h == 0 and d % 64 == 0 and rows.shape[1] > 0 and n_q > 0):
        why = reason(q, "a head count or width the kernel does not tile", (torch.bfloat16, torch.float32))
        return fall_back("indexer_scores_fp4", why, torch_indexer.indexer_scores_fp4, q, q_seq, visible, k, k_scale,
                         rows, weights, softmax_scale)
    out = torch.empty(n_q, rows.shape[1], dtype=torch.float32, device=q.device)
    queries = queries_per_block(n_q, rows.shape[0]) if h * SHARED_QUERIES <= 64 else 1  # the MMA's 64 rows
    kernel = jit(*fp4_spec(h, d, key_tiles(n_q, rows.shape[1], queries), queries))
    kernel(q.bfloat16().contiguous(), q_seq.int(), visible.int(), k.contiguous(), k_scale.contiguous(),
           rows.long().contiguous(), weights.float().contiguous(), out, float(softmax_scale))
    return out
