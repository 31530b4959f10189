"""Token bitmasks in xgrammar's packed int32 layout, applied with torch ops."""

import torch
import xgrammar as xgr

from deepinfer.sampling.bitmask import allocate_bitmask, apply_bitmask_, set_single_token_, unpack_bitmask


def test_layout_matches_xgrammar_and_starts_all_allowed():
    ours = allocate_bitmask(3, 70)
    assert ours.shape == xgr.allocate_token_bitmask(3, 70).shape and ours.dtype == torch.int32
    assert unpack_bitmask(ours, 70).all()


def test_single_token_masks_for_every_bit_position_including_the_sign_bit():
    for token in (0, 1, 30, 31, 32, 63, 69):
        mask = allocate_bitmask(2, 70)
        set_single_token_(mask, 1, token)
        allowed = unpack_bitmask(mask, 70)
        assert allowed[0].all()
        assert torch.nonzero(allowed[1]).flatten().tolist() == [token]


def test_apply_sets_disallowed_logits_to_minus_infinity_and_leaves_uncovered_columns():
    mask = allocate_bitmask(1, 32)
    set_single_token_(mask, 0, 5)
    logits = torch.zeros(1, 40)
    apply_bitmask_(logits, mask)
    finite = torch.isfinite(logits[0])
    assert torch.nonzero(finite[:32]).flatten().tolist() == [5]
    assert finite[32:].all()  # beyond the mask's 32 columns: padding, blacklisted elsewhere
