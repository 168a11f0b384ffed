"""Tests of `specops._seeds`: the project's default-seed rule and its per-row seed rule."""

from __future__ import annotations

import pytest
import torch

from specops._seeds import draw_seed, row_seeds

STRIDE = 0x9E3779B97F4A7C15


def as_int64(values: list[int]) -> list[int]:
    return [v - 2**64 if v >= 2**63 else v for v in values]


def test_draw_seed_is_in_range_and_follows_torch_manual_seed():
    torch.manual_seed(0)
    first = [draw_seed() for _ in range(200)]
    torch.manual_seed(0)
    assert [draw_seed() for _ in range(200)] == first
    assert all(0 <= s < 2**63 for s in first)
    assert len(set(first)) == 200
    # Uniform over [0, 2**63): of 200 draws, about half have the top bit (2**62) set.
    assert 60 < sum(s >> 62 for s in first) < 140


@pytest.mark.parametrize("seed", [0, 7, 2**63 - 5, -3, 2**64 + 11])
def test_int_seeds_are_spread_by_the_golden_ratio_stride(seed):
    seeds = row_seeds(seed, 4, "cpu")
    assert seeds.dtype == torch.int64 and seeds.shape == (4,)
    assert seeds.tolist() == as_int64([(seed + b * STRIDE) % 2**64 for b in range(4)])


def test_tensor_seeds_are_the_rows_seeds():
    seeds = torch.tensor([5, -1, 2**62], dtype=torch.int64)
    assert torch.equal(row_seeds(seeds, 3, "cpu"), seeds)
    assert row_seeds(torch.tensor([1, 2, 3], dtype=torch.int32), 3, "cpu").dtype == torch.int64
    assert row_seeds(torch.tensor(9), 3, "cpu").tolist() == [9, 9, 9]


@pytest.mark.parametrize("seed, error, pattern", [
    (torch.tensor([1.0, 2.0, 3.0]), TypeError, r"seed must hold integers"),
    (torch.tensor([1, 2]), ValueError, r"seed must be a scalar or a \[3\] tensor, got shape \(2,\)"),
    (True, TypeError, r"seed must be a number or a tensor, got bool"),
    ("7", TypeError, r"seed must be a number or a tensor, got str"),
])
def test_bad_seeds_raise(seed, error, pattern):
    with pytest.raises(error, match=pattern):
        row_seeds(seed, 3, "cpu")
