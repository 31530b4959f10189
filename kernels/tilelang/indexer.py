"""Registry-facing `indexer_scores` and the decode fast path over the FP4 indexer-key cache.

The kernels feed the tensor cores bf16: exact for the model's inputs (the indexer's q and k are FP4
fake-quantised, e2m1 x 2^k, which bf16 holds exactly); a general fp32 input is rounded to bf16 first.
The top-k (`index_topk`, incl. the two-level candidate blocks) stays on the torch op: not ported yet.
"""

import torch

from deepinfer.kernels.torch import indexer as torch_indexer

from ._build import jit
from .indexer_kernel import build_indexer_scores


def indexer_scores(q, k, weights, softmax_scale):
    """Same contract as deepinfer.kernels.torch.indexer.indexer_scores: q [S, h, d], k [G, d], weights [S, h]
    -> [S, G] fp32."""
    S, h, d = q.shape
    if not (q.is_cuda and 64 % h == 0 and d % 64 == 0 and k.shape[0] > 0 and S > 0):
        return torch_indexer.indexer_scores(q, k, weights, softmax_scale)
    out = torch.empty(S, k.shape[0], dtype=torch.float32, device=q.device)
    jit(build_indexer_scores, "dense", h, d)(q.bfloat16().contiguous(), k.bfloat16().contiguous(),
                                             weights.float().contiguous(), out, float(softmax_scale))
    return out


def indexer_scores_fp4(q, q_seq, visible, k, k_scale, weights, softmax_scale):
    """Decode batch: q [Nq, 32, 128] bf16 (FP4 fake-quantised values), q_seq [Nq] int32, visible [Nq] int32
    entries each query may see; k [B, G, 64] uint8 e2m1 pairs (low nibble = even channel) with k_scale
    [B, G, 4] uint8 ue8m0 per 32 channels; weights [Nq, 32] fp32 -> scores [Nq, G] fp32, -inf past visible."""
    n_q, h, d = q.shape
    out = torch.empty(n_q, k.shape[1], dtype=torch.float32, device=q.device)
    jit(build_indexer_scores, "fp4", h, d)(q.contiguous(), q_seq, visible, k, k_scale, weights.float().contiguous(),
                                           out, float(softmax_scale))
    return out
