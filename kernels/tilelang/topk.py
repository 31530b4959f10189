"""Registry-facing `index_topk_ids` and `index_topk_rows` over the radix-select kernel (topk_kernel.py), and
`index_topk`, the same kernel with the torch op `index_topk`'s outputs (selected [S, G] bool, candidate mask [S, G]
bool or None), which the tests hold to that op.

`index_topk_ids` returns the selected entry ids: int32 [S, topk], ascending, -1 padded; `index_topk_rows` the same
selection as pool rows (the kernel looks each id up in its sequence's entry rows), which the model reads. They run
the kernel for fp32 scores on CUDA; anything else (CPU, other dtypes, a non-bool or differently shaped `candidates`,
topk <= 0, G = 0 or G >= 2^22, a rows table that is not int64 [B, G] on the scores' device) goes to the torch op.

Ties: the torch op leaves the order of equal scores to torch.topk; the kernel takes the LOWEST indices among entries
equal to the k-th largest score (and the lowest block indices among equal candidate blocks), so its selection is
deterministic and independent of batching. On tie-free scores both select the same set. NaN scores are outside
the contract (the indexer never produces them).
"""

import functools

import torch

from deepinfer.kernels.registry import fall_back
from deepinfer.kernels.torch import indexer as torch_indexer

from ._build import jit
from ._fallback import reason
from .topk_kernel import MAX_ENTRIES, build_index_topk

CACHE = 16384  # keys per row held in shared memory (64 KB, 3 blocks/SM); entries beyond it are re-read from L2


def _covered(scores, visible, topk, candidates, candidate_blocks, candidate_block_size) -> bool:
    if not (isinstance(scores, torch.Tensor) and scores.is_cuda and scores.dtype == torch.float32
            and scores.dim() == 2):
        return False
    S, G = scores.shape
    if not (S > 0 and 0 < G < MAX_ENTRIES and topk > 0 and visible.shape == (S,) and not visible.is_floating_point()):
        return False
    if candidate_blocks > 0:
        return 1 <= candidate_block_size <= 64
    return candidates is None or (candidates.dtype == torch.bool and tuple(candidates.shape) == (S, G))


@functools.lru_cache(maxsize=8)
def _placeholder(device: str) -> torch.Tensor:
    """The one-byte buffer passed for outputs and inputs a launch does not use (never read or written), made once
    per device rather than by a fill kernel in every launch."""
    return torch.zeros(1, 1, dtype=torch.uint8, device=device)


def _launch(scores, visible, topk, candidates, candidate_blocks, candidate_block_size, want_mask, to_rows=None):
    """to_rows: (rows [B, G] int64, tok_seq [S] int32): write rows[tok_seq[q], id] instead of the ids."""
    S, G = scores.shape
    dev = scores.device
    level1 = candidate_blocks > 0
    use_cand = candidates is not None and not level1  # the candidate source's own selection is unrestricted
    # the block size is a compile-time constant; without the candidate level any value serves, so reuse 8
    bs = candidate_block_size if level1 else 8
    kernel = jit(build_index_topk, CACHE, bs) if to_rows is None else jit(build_index_topk, CACHE, bs, 512, True)
    dummy = _placeholder(str(dev))
    ids = torch.empty(S, topk, dtype=torch.int32, device=dev)
    sel = torch.empty(S, G, dtype=torch.bool, device=dev) if want_mask else None
    cand = torch.empty(S, G, dtype=torch.bool, device=dev) if level1 else None
    tensors = (scores.contiguous(), visible.to(device=dev, dtype=torch.int32).contiguous(),
               candidates.to(dev).contiguous().view(torch.uint8) if use_cand else dummy, ids,
               sel.view(torch.uint8) if want_mask else dummy, cand.view(torch.uint8) if level1 else dummy)
    if to_rows is not None:
        rows, seq = to_rows
        tensors += (rows.contiguous(), seq.to(device=dev, dtype=torch.int32).contiguous())
    kernel(*tensors, int(use_cand), int(want_mask), int(candidate_blocks) if level1 else 0)
    return ids, sel, cand


def index_topk_rows(scores, visible, topk, rows, tok_seq, candidates=None, candidate_blocks=0,
                    candidate_block_size=0):
    """Same contract as deepinfer.kernels.torch.indexer.index_topk_rows: index_topk_ids's selection as pool rows
    (rows[tok_seq[q], id], int32, -1 padded), written by the selecting kernel itself (the gather, mask and cast
    were six launches); with its candidate mask when candidate_blocks > 0."""
    covered = _covered(scores, visible, topk, candidates, candidate_blocks, candidate_block_size)
    tables = covered and (rows.dtype == torch.int64 and rows.dim() == 2 and rows.shape[1] == scores.shape[1]
                          and rows.device == scores.device and tok_seq.shape == (scores.shape[0],)
                          and not tok_seq.is_floating_point() and tok_seq.device == scores.device)
    if not tables:
        why = _why_not(scores) if not covered else "rows not int64 [B, G] or tok_seq not [S] on the scores' device"
        return fall_back("index_topk_rows", why, torch_indexer.index_topk_rows, scores, visible, topk, rows, tok_seq,
                         candidates, candidate_blocks, candidate_block_size)
    sel, _, cand = _launch(scores, visible, topk, candidates, candidate_blocks, candidate_block_size,
                           want_mask=False, to_rows=(rows, tok_seq))
    return (sel, cand) if candidate_blocks > 0 else sel


def index_topk(scores, visible, topk, candidates=None, candidate_blocks=0, candidate_block_size=0):
    """Same contract as deepinfer.kernels.torch.indexer.index_topk: scores [S, G] fp32, visible [S] -> (selected
    [S, G] bool, candidate mask [S, G] bool or None)."""
    if not _covered(scores, visible, topk, candidates, candidate_blocks, candidate_block_size):
        return fall_back("index_topk", _why_not(scores), torch_indexer.index_topk, scores, visible, topk, candidates,
                         candidate_blocks, candidate_block_size)
    _, sel, cand = _launch(scores, visible, topk, candidates, candidate_blocks, candidate_block_size, want_mask=True)
    return sel, cand


def _why_not(scores) -> str:
    if not isinstance(scores, torch.Tensor):
        return "scores not a tensor"
    return reason(scores, "entries, top-k or candidates not covered", (torch.float32,))


def index_topk_ids(scores, visible, topk, candidates=None, candidate_blocks=0, candidate_block_size=0):
    """Same contract as deepinfer.kernels.torch.indexer.index_topk_ids (the op the model calls): the selection as
    ids int32 [S, topk], ascending entry order, -1 padded; the candidate source (candidate_blocks > 0) also returns
    its candidate mask: (ids, mask [S, G] bool). The kernel writes no [S, G] selection mask."""
    if not _covered(scores, visible, topk, candidates, candidate_blocks, candidate_block_size):
        return fall_back("index_topk_ids", _why_not(scores), torch_indexer.index_topk_ids, scores, visible, topk,
                         candidates, candidate_blocks, candidate_block_size)
    ids, _, cand = _launch(scores, visible, topk, candidates, candidate_blocks, candidate_block_size, want_mask=False)
    return (ids, cand) if candidate_blocks > 0 else ids
