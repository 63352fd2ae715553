"""snack.indexing: the native CPU index kernels against the torch calls they replace.

Every function is checked on the native path (CPU tensors, the native backend loaded) and on the
torch path it falls back to (forced here by patching ``_native_for``), on sizes that cross the
kernels' chunk boundaries (65536 entries) and on the edge cases: empty inputs, all false/true,
queries beyond both ends of the list, duplicates.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from snack import indexing
from snack.backends.cpu import native  # noqa: F401  (builds and loads the kernels)
from snack.indexing import flat_nonzero, positions_where, segment_pointer, sorted_searchsorted

CHUNK = 1 << 16  # index_ops.cpp's kMinChunk


@pytest.fixture(params=["native", "torch"])
def path(request, monkeypatch):
    """Run a test on each path; the native one must really be taken on the CPU."""
    if request.param == "torch":
        monkeypatch.setattr(indexing, "_native_for", lambda *tensors: False)
    else:
        assert indexing._native_for(torch.zeros(1))
    return request.param


def _reference_pointer(index, size):
    ptr = torch.zeros(size + 1, dtype=torch.int32)
    ptr[1:] = torch.bincount(index.to(torch.int64), minlength=size).cumsum(0)
    return ptr


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), max_size=70))
def test_flat_nonzero_is_nonzero_on_short_masks(bits):
    mask = torch.tensor(bits, dtype=torch.bool)
    assert torch.equal(flat_nonzero(mask), mask.nonzero().squeeze(1))


@pytest.mark.parametrize("density", [0.0, 0.001, 0.3, 0.97, 1.0])
@pytest.mark.parametrize("n", [0, 1, 8, 9, CHUNK - 1, 5 * CHUNK + 7])
def test_flat_nonzero_is_nonzero_across_chunks(path, n, density):
    mask = torch.rand(n, generator=torch.Generator().manual_seed(n)) < density
    got = flat_nonzero(mask)
    assert got.dtype == torch.int64 and torch.equal(got, mask.nonzero().squeeze(1))


def test_flat_nonzero_reads_any_nonzero_byte_as_true_and_takes_strided_masks(path):
    raw = torch.tensor([0, 2, 0, 255, 1, 0, 0, 0, 0, 7], dtype=torch.uint8)
    assert flat_nonzero(raw.view(torch.bool)).tolist() == [1, 3, 4, 9]
    mask = torch.rand(3 * CHUNK) < 0.5
    assert torch.equal(flat_nonzero(mask[1::3]), mask[1::3].nonzero().squeeze(1))


def test_flat_nonzero_of_a_mask_true_only_at_chunk_ends(path):
    # each chunk's last entry true (a cursor that overran its share would overwrite the next one's)
    mask = torch.zeros(4 * CHUNK + 3, dtype=torch.bool)
    mask[CHUNK - 1 :: CHUNK] = True
    mask[-1] = True
    assert torch.equal(flat_nonzero(mask), mask.nonzero().squeeze(1))


COMPARISONS = {">=": torch.ge, ">": torch.gt, "<=": torch.le, "<": torch.lt, "==": torch.eq}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-4, 4), max_size=70), st.sampled_from(sorted(COMPARISONS)), st.integers(-5, 5))
def test_positions_where_are_those_of_the_comparison_on_short_keys(keys, comparison, bar):
    keys = torch.tensor(keys, dtype=torch.int32)
    expected = COMPARISONS[comparison](keys, bar).nonzero().squeeze(1)
    assert torch.equal(positions_where(keys, comparison, bar), expected)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.int64])
@pytest.mark.parametrize("comparison", sorted(COMPARISONS))
def test_positions_where_across_chunks(path, dtype, comparison):
    keys = torch.randint(0, 200, (5 * CHUNK + 3,), generator=torch.Generator().manual_seed(1), dtype=dtype)
    for bar in (0, 1, 190, torch.tensor(199, dtype=dtype), 200):
        expected = COMPARISONS[comparison](keys, bar).nonzero().squeeze(1)
        assert torch.equal(positions_where(keys, comparison, bar), expected), bar


def test_positions_where_of_float_keys_compare_in_torch():
    keys = torch.tensor([0.5, 2.0, float("nan"), 3.0])
    assert positions_where(keys, ">=", 2).tolist() == [1, 3]


def test_positions_where_refuses_a_bar_outside_the_keys_dtype(path):
    with pytest.raises(ValueError, match=r"bar 128 is outside the range of the keys' dtype torch.int8"):
        positions_where(torch.zeros(3, dtype=torch.int8), ">=", 128)
    with pytest.raises(RuntimeError, match=r"snack_cpu.positions_where: bar -1 is outside the range"):
        torch.ops.snack_cpu.positions_where(torch.zeros(3, dtype=torch.uint8), ">=", -1)


def test_positions_where_refuses_an_unknown_comparison():
    with pytest.raises(ValueError, match="comparison must be one of .* got '=>'"):
        positions_where(torch.arange(3), "=>", 1)
    with pytest.raises(RuntimeError, match="snack_cpu.positions_where: comparison must be one of"):
        torch.ops.snack_cpu.positions_where(torch.arange(3), "!=", 1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-5, 5), max_size=30), st.lists(st.integers(-7, 7), max_size=30), st.booleans())
def test_sorted_searchsorted_is_searchsorted_on_short_lists(sequence, queries, right):
    sequence = torch.tensor(sorted(sequence), dtype=torch.int64)
    queries = torch.tensor(sorted(queries), dtype=torch.int64)
    got = sorted_searchsorted(sequence, queries, right=right)
    assert torch.equal(got, torch.searchsorted(sequence, queries, right=right))


@pytest.mark.parametrize("right", [False, True])
@pytest.mark.parametrize(
    "n, k", [(0, 5), (5, 0), (3 * CHUNK, 10), (3 * CHUNK + 1, 3 * CHUNK + 5), (100, 4 * CHUNK), (5 * CHUNK, 2 * CHUNK)]
)
def test_sorted_searchsorted_is_searchsorted_across_chunks(path, n, k, right):
    generator = torch.Generator().manual_seed(n + k)
    # many equal entries and queries (a range of 3n values), some queries beyond both ends
    sequence = torch.randint(0, 3 * n + 1, (n,), generator=generator).sort().values
    queries = torch.randint(-10, 3 * n + 10, (k,), generator=generator).sort().values
    got = sorted_searchsorted(sequence, queries, right=right)
    assert got.dtype == torch.int64 and torch.equal(got, torch.searchsorted(sequence, queries, right=right))


def test_sorted_searchsorted_of_other_dtypes_is_torch_searchsorted():
    sequence, queries = torch.tensor([1, 3, 3, 9], dtype=torch.int32), torch.tensor([0, 3, 10], dtype=torch.int32)
    assert sorted_searchsorted(sequence, queries, right=True).tolist() == [0, 3, 4]


def test_native_sorted_searchsorted_refuses_queries_out_of_order():
    with pytest.raises(RuntimeError, match="queries must be non-decreasing, got 5 before 4 at position 2"):
        sorted_searchsorted(torch.arange(10), torch.tensor([1, 5, 4]))
    queries = torch.arange(5 * CHUNK)  # the same from a chunk run by another thread
    queries[4 * CHUNK + 1] = 3
    with pytest.raises(RuntimeError, match=rf"got {4 * CHUNK} before 3 at position {4 * CHUNK + 1}"):
        sorted_searchsorted(torch.arange(10), queries)


@pytest.mark.parametrize("n, size", [(0, 0), (0, 7), (1, 1), (50, 3), (3 * CHUNK + 11, 4096), (20, 100_000)])
def test_segment_pointer_is_the_cumulative_count(path, n, size):
    index = torch.randint(0, max(size, 1), (n,), generator=torch.Generator().manual_seed(n), dtype=torch.int32)
    got = segment_pointer(index, size)
    assert got.dtype == torch.int32 and torch.equal(got, _reference_pointer(index, size))


@pytest.mark.parametrize("bad", [-1, 3])
def test_native_segment_pointer_refuses_entries_out_of_range(bad):
    index = torch.zeros(3 * CHUNK, dtype=torch.int32)
    index[2 * CHUNK + 5] = bad
    with pytest.raises(RuntimeError, match=rf"index\[{2 * CHUNK + 5}\] = {bad} is outside \[0, 3\)"):
        segment_pointer(index, 3)


@pytest.mark.parametrize(
    "op, args",
    [
        ("flat_nonzero", (torch.zeros(3, dtype=torch.uint8),)),
        ("flat_nonzero", (torch.zeros(2, 2, dtype=torch.bool),)),
        ("positions_where", (torch.zeros(3), ">=", 0)),
        ("sorted_searchsorted", (torch.arange(3, dtype=torch.int32), torch.arange(3))),
        ("segment_pointer", (torch.arange(3), 3)),
    ],
)
def test_native_ops_name_the_argument_they_refuse(op, args):
    with pytest.raises(RuntimeError, match=rf"snack_cpu\.{op}: \w+ must be a 1-D \w+ CPU tensor, got"):
        getattr(torch.ops.snack_cpu, op)(*args)


def test_the_torch_calls_run_inside_fake_tensor_mode_and_compiled_code():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert not indexing._native_for(torch.empty(3))

    @torch.compile(backend="eager", fullgraph=True)  # (no graph break: a native op would be one)
    def search(sequence, queries):
        return sorted_searchsorted(sequence, queries, right=True)

    assert search(torch.tensor([0, 3, 3, 7]), torch.tensor([-1, 3, 8])).tolist() == [0, 3, 4]
