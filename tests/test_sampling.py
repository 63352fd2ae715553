"""snack.sampling: uniformly random k-subsets of range(n), drawn in increasing order."""

import math

import pytest
import torch

from snack import sampling
from snack.sampling import sorted_sample


@pytest.mark.parametrize(
    "n, k",
    [(0, 0), (1, 0), (1, 1), (10, 3), (10, 7), (10, 10), (4097, 1), (4097, 2048), (4097, 2049), (4097, 4097),
     (100_000, 0), (100_000, 31_623), (100_000, 50_000), (100_000, 50_001), (1 << 24, 503_316)],
)  # fmt: skip
def test_sorted_sample_draws_k_distinct_in_range_increasing(n, k):
    drawn = sorted_sample(n, k, torch.Generator().manual_seed(0))
    assert drawn.dtype == torch.int64 and drawn.shape == (k,)
    assert bool((drawn[1:] > drawn[:-1]).all())
    assert k == 0 or (int(drawn[0]) >= 0 and int(drawn[-1]) < n)


def test_sorted_sample_of_a_huge_range_takes_memory_for_k_only():
    # 2^40 integers: anything n-sized (a terabyte of bools) would fail
    drawn = sorted_sample(1 << 40, 1000, torch.Generator().manual_seed(0))
    assert drawn.numel() == 1000 and bool((drawn[1:] > drawn[:-1]).all()) and int(drawn[-1]) < 1 << 40


@pytest.mark.parametrize("n, k", [(10, 11), (10, -1), (0, 1)])
def test_sorted_sample_refuses_k_outside_0_to_n(n, k):
    with pytest.raises(ValueError, match=rf"cannot draw {k} distinct integers from \[0, {n}\)"):
        sorted_sample(n, k)


def test_sorted_sample_is_reproducible_with_a_generator():
    a, b, c = (sorted_sample(50_000, 900, torch.Generator().manual_seed(seed)) for seed in (3, 3, 4))
    assert torch.equal(a, b) and not torch.equal(a, c)


def _subset_counts(n, k, draws, seed=0):
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(n)
    minima = torch.empty(draws, dtype=torch.int64)
    adjacent = 0
    for i in range(draws):
        drawn = sorted_sample(n, k, generator)
        counts[drawn] += 1
        minima[i] = drawn[0]
        adjacent += int((drawn[1:] - drawn[:-1] == 1).sum())
    return counts, minima, adjacent


@pytest.mark.parametrize("k", [60, 140], ids=["drawn", "left-out-drawn"])
def test_sorted_sample_by_bernoulli_gaps_is_uniform(monkeypatch, k):
    """The Bernoulli draw (forced on a small range, as small as it may be) with its surplus
    removed (by a permutation: fewer than 128 kept), against the exact
    law of a uniform k-subset of n = 200: how often each integer is drawn (k / n), the smallest
    one's distribution, and how many drawn pairs are neighbours (all within 5 standard errors).
    An off-by-one gap, a biased surplus removal or a wrong start each fails one of them."""
    monkeypatch.setattr(sampling, "_PERMUTE_UP_TO", 127)
    n, draws = 200, 4000
    counts, minima, adjacent = _subset_counts(n, k, draws)
    share = k / n
    assert (counts - draws * share).abs().max() < 5 * math.sqrt(draws * share * (1 - share))
    for j in (1, 2, 5):  # P(min >= j) = C(n - j, k) / C(n, k)
        expected = math.comb(n - j, k) / math.comb(n, k)
        observed = float((minima >= j).double().mean())
        assert abs(observed - expected) < 5 * math.sqrt(expected * (1 - expected) / draws) + 1e-9
    # each of the n - 1 neighbour pairs is drawn with probability k (k - 1) / (n (n - 1))
    expected_adjacent = draws * k * (k - 1) / n
    assert abs(adjacent - expected_adjacent) < 5 * math.sqrt(expected_adjacent)


def test_sorted_sample_beyond_the_permutation_size_is_uniform():
    # as drawn for real layers (n > 4096): 6,000 draws of 3 from 5,000, counted in 10 bins of 500
    n, k, draws = 5000, 3, 6000
    counts, minima, _ = _subset_counts(n, k, draws, seed=1)
    per_bin = counts.view(10, -1).sum(1)
    expected = draws * k / 10
    assert (per_bin - expected).abs().max() < 5 * math.sqrt(expected)
    # E[min] = (n - k) / (k + 1); its variance is that of the first of k uniform order statistics
    mean, variance = (n - k) / (k + 1), k * (n + 1) * (n - k) / ((k + 1) ** 2 * (k + 2))
    assert abs(float(minima.double().mean()) - mean) < 5 * math.sqrt(variance / draws)


def test_sorted_sample_draws_again_when_too_few_are_kept(monkeypatch):
    """The Bernoulli draw keeps fewer than k about once in 30,000: then it draws again."""
    real = sampling._bernoulli_sample
    calls = []

    def short_first(n, p, generator, device):
        calls.append(p)
        kept = real(n, p, generator, device)
        return kept[:10] if len(calls) == 1 else kept

    monkeypatch.setattr(sampling, "_bernoulli_sample", short_first)
    drawn = sorted_sample(100_000, 500, torch.Generator().manual_seed(0))
    assert len(calls) >= 2 and drawn.numel() == 500 and bool((drawn[1:] > drawn[:-1]).all())
