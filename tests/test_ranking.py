"""snack.ranking: positions of the k largest/smallest keys, and integer keys ordering floats."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from snack import ranking
from snack.ranking import k_largest_positions, k_smallest_positions, ordering_keys


def _stable_reference(keys, k, *, largest):
    """What a stable sort picks: the k first in (key, position) order, sorted by position."""
    return torch.sort(keys, descending=largest, stable=True).indices[:k].sort().values


# few distinct values, so that most keys tie with others
@given(st.lists(st.integers(-3, 3), max_size=40), st.data())
@settings(max_examples=200, deadline=None)
def test_k_extreme_positions_pick_what_a_stable_sort_picks(values, data):
    keys = torch.tensor(values, dtype=torch.int32)
    k = data.draw(st.integers(0, len(values) + 2))
    for largest, select in ((True, k_largest_positions), (False, k_smallest_positions)):
        got = select(keys, k)
        assert got.dtype == torch.int64
        assert torch.equal(got, _stable_reference(keys, k, largest=largest))


@pytest.mark.parametrize("distinct", [False, True], ids=["ties", "distinct"])
def test_k_extreme_positions_of_large_inputs(distinct):
    # beyond the sizes hypothesis draws: ties spread over a million keys, or none (one pass)
    generator = torch.Generator().manual_seed(0)
    if distinct:
        keys = torch.randperm(1 << 20, generator=generator)
    else:
        keys = torch.randint(0, 1000, (1 << 20,), generator=generator)
    for k in (1, 777, 1 << 19):
        assert torch.equal(k_largest_positions(keys, k), _stable_reference(keys, k, largest=True))
        assert torch.equal(k_smallest_positions(keys, k), _stable_reference(keys, k, largest=False))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_ordering_keys_order_floats_as_a_sort_does_with_every_nan_last_and_equal(dtype):
    info = torch.finfo(dtype)
    floats = torch.tensor(
        [0.0, info.tiny / 4, info.tiny, 1.0, 1.0, 2.5, info.max, float("inf"), float("nan"), 0.5, float("nan")],
        dtype=dtype,
    )
    integer = {2: torch.int16, 4: torch.int32, 8: torch.int64}[floats.element_size()]
    floats.view(integer)[-1] += 1  # another NaN payload, which a sort ranks equal to the first
    assert floats[-1].isnan()
    expected = torch.sort(floats, stable=True).indices
    keys = ordering_keys(floats.clone())
    assert keys.dtype == integer
    assert torch.equal(torch.sort(keys, stable=True).indices, expected)
    assert keys[-1] == keys[-3]  # both NaNs


def test_ordering_keys_work_in_place():
    floats = torch.tensor([2.0, float("nan")])
    keys = ordering_keys(floats)
    assert keys.data_ptr() == floats.data_ptr()


@pytest.mark.parametrize("tensor", [torch.tensor([3, 1]), torch.zeros(2, dtype=torch.float8_e4m3fn)])
def test_ordering_keys_refuse_what_has_no_ordered_bit_pattern(tensor):
    with pytest.raises(TypeError, match="16-, 32- or 64-bit floating tensor, got torch"):
        ordering_keys(tensor)


@pytest.mark.parametrize("largest", [True, False])
def test_a_sample_that_misjudges_the_keys_falls_back_to_a_whole_selection(largest, monkeypatch):
    """Long inputs are narrowed by a bar read off an evenly strided sample. Keys that hold their
    extremes exactly at the sampled positions make the bar too tight: the narrowing notices (too
    few keys reach it) and the selection runs on every key; a random input is narrowed."""
    n = 1 << 18
    stride = n // ranking._SAMPLE
    sampled = torch.arange(0, n, stride)
    keys = torch.zeros(n, dtype=torch.int32)
    keys[sampled] = torch.arange(1, sampled.numel() + 1, dtype=torch.int32) * (1 if largest else -1)
    narrowed = []
    real = ranking._narrowed
    monkeypatch.setattr(ranking, "_narrowed", lambda *a, **kw: narrowed.append(real(*a, **kw)) or narrowed[-1])
    select = k_largest_positions if largest else k_smallest_positions
    k = 1000
    assert torch.equal(select(keys, k), _stable_reference(keys, k, largest=largest))
    assert narrowed[0] is None  # the fallback ran
    narrowed.clear()
    keys = torch.randint(-50, 50, (n,), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    assert torch.equal(select(keys, k), _stable_reference(keys, k, largest=largest))
    assert narrowed[0] is not None and narrowed[0].numel() < n // 4
