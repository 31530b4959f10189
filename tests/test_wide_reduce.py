"""deepinfer.sampling.wide_reduce: the two-pass argmax and max of a vocabulary-wide row give torch's one-pass results
(the lowest index on ties, -inf and +inf where they are), on rows with many ties, padded slices and transposed
views; narrow rows and widths with no divisor in range take the one pass."""

import pytest
import torch

from deepinfer.sampling import wide_reduce
from deepinfer.sampling.wide_reduce import chunks, first_argmax, row_max


def test_the_chunk_count_divides_the_width_or_the_row_takes_one_pass():
    assert chunks(129280) == 256 and 129280 % 256 == 0  # V4.1's vocabulary: 256 chunks of 505
    assert chunks(65536) == 256 and chunks(32768 * 3) == 256
    assert chunks(1000) == 0  # narrower than MIN_WIDTH
    assert chunks(32771) == 0  # a prime: no divisor from 256 down to 16


@pytest.mark.parametrize("width", [129280, 40000, 65536, 98304])
def test_argmax_and_max_are_torchs_on_rows_full_of_ties(width):
    g = torch.Generator().manual_seed(width)
    for trial in range(20):
        x = torch.randint(-3, 4, (4, width), generator=g).float()  # each value ~width/7 times: ties everywhere
        x[1] = float("-inf")
        x[1, width - 1] = 0.0  # the only finite value, in the last chunk
        x[2, ::2] = float("-inf")
        x[3, [5 + trial, width - 3]] = float("inf")
        assert torch.equal(first_argmax(x), x.argmax(dim=-1))
        assert torch.equal(row_max(x), x.max(dim=-1).values)


def test_a_tie_across_chunks_goes_to_the_lowest_index():
    x = torch.zeros(1, 129280)
    x[0, [129279, 70000, 1010, 1009]] = 1.0  # 1009 sits in chunk 1 (505 a chunk), before 1010
    assert first_argmax(x).item() == 1009 == x.argmax(dim=-1).item()


def test_padded_slices_and_transposed_views_reduce_as_their_values():
    g = torch.Generator().manual_seed(1)
    padded = torch.randn(3, 129280 + 128, generator=g)[:, :129280]
    assert torch.equal(first_argmax(padded), padded.argmax(dim=-1))
    assert torch.equal(row_max(padded), padded.max(dim=-1).values)
    transposed = torch.randn(40000, 3, generator=g).t()
    assert torch.equal(first_argmax(transposed), transposed.argmax(dim=-1))


def test_a_nan_row_has_a_nan_max_as_in_torch():
    x = torch.randn(2, 65536, generator=torch.Generator().manual_seed(2))
    x[1, 30000] = float("nan")
    top = row_max(x)
    assert torch.isnan(top[1]) and top[0] == x[0].max()
    assert first_argmax(x).shape == (2,) and first_argmax(x)[0] == x[0].argmax()


def test_narrow_rows_take_torchs_one_pass(monkeypatch):
    calls = []
    real = torch.Tensor.unflatten
    monkeypatch.setattr(torch.Tensor, "unflatten", lambda t, *a: calls.append(a) or real(t, *a))
    x = torch.randn(2, wide_reduce.MIN_WIDTH - 1)
    assert torch.equal(first_argmax(x), x.argmax(dim=-1)) and not calls
    first_argmax(torch.randn(2, 129280))
    assert calls == [(-1, (256, 505))]
