"""snack.indexing: the native CPU index kernels against the torch calls they replace.

Every function is checked on the native path (CPU tensors, the native backend loaded) and on the
torch path it falls back to (forced here by patching ``native_for``), on sizes that cross the
kernels' chunk boundaries (65536 entries) and on the edge cases: empty inputs, all false/true,
full and empty layers, repeated ranks.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from snack import indexing
from snack.backends.cpu import native  # noqa: F401  (builds and loads the kernels)
from snack.indexing import (
    flat_nonzero, inactive_positions, matching_positions, merge_connections, positions_where, segment_pointer,
    take_or_fill,
)

CHUNK = 1 << 16  # index_ops.cpp's kMinChunk


@pytest.fixture(params=["native", "torch"])
def path(request, monkeypatch):
    """Run a test on each path; the native one must really be taken on the CPU."""
    if request.param == "torch":
        monkeypatch.setattr(indexing, "native_for", lambda *tensors: False)
    else:
        assert indexing.native_for(torch.zeros(1))
    return request.param


def test_a_forced_backend_other_than_cpu_runs_the_torch_calls(monkeypatch):
    """``use_backend("reference")`` runs no native code; under ``"triton"`` the CPU runs what a GPU
    would."""
    import snack

    keys = torch.randint(0, 9, (5 * CHUNK + 7,), generator=torch.Generator().manual_seed(0))
    native_results = positions_where(keys, ">=", 4), segment_pointer(keys.int(), 9)
    with snack.use_backend("cpu"):
        assert indexing.native_for(keys)

    def no_native(*args):
        raise AssertionError("a native index kernel ran under use_backend('reference')")

    for name in ("positions_where", "segment_pointer", "flat_nonzero"):
        monkeypatch.setattr(torch.ops.snack_cpu, name, no_native)
    with snack.use_backend("reference"):
        assert not indexing.native_for(keys)
        assert torch.equal(positions_where(keys, ">=", 4), native_results[0])
        assert torch.equal(segment_pointer(keys.int(), 9), native_results[1])
    assert indexing.native_for(keys), "as before the block"


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


def _free_positions(row, col, shape):
    """The positions no connection holds, increasing, from a dense mask (the reference)."""
    held = torch.zeros(shape, dtype=torch.bool)
    held[row.long(), col.long()] = True
    return (~held).flatten().nonzero().squeeze(1)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6), st.data())
def test_inactive_positions_are_the_free_positions_by_rank_on_small_layers(out_features, in_features, data):
    positions = data.draw(st.sets(st.integers(0, out_features * in_features - 1)))
    linear = torch.tensor(sorted(positions), dtype=torch.int64)
    row, col = (linear // in_features).to(torch.int32), (linear % in_features).to(torch.int32)
    free = _free_positions(row, col, (out_features, in_features))
    ranks = torch.tensor(sorted(data.draw(st.lists(st.integers(0, max(free.numel() - 1, 0)), max_size=20))))
    ranks = ranks[: 0 if free.numel() == 0 else None].to(torch.int64)
    assert torch.equal(inactive_positions(row, col, in_features, ranks), free[ranks])


@pytest.mark.parametrize(
    "shape, density, k",
    [
        ((3, 4), 1.0, 0),  # full: nothing free
        ((1, 7), 0.0, 7),  # empty: every position, in order
        ((512, 1024), 0.9, 3 * CHUNK + 5),  # many ranks, in several chunks, mostly a few connections apart
        ((512, 1024), 0.5, 100),  # ranks far apart: galloping
        ((2048, 2048), 0.02, 4 * CHUNK),  # dense ranks between sparse connections, repeated ranks
    ],
)
def test_inactive_positions_across_chunks(path, shape, density, k):
    generator = torch.Generator().manual_seed(k)
    total = shape[0] * shape[1]
    linear = torch.randperm(total, generator=generator)[: int(total * density)].sort().values
    row, col = (linear // shape[1]).to(torch.int32), (linear % shape[1]).to(torch.int32)
    free = _free_positions(row, col, shape)
    ranks = torch.randint(0, max(free.numel(), 1), (k,), generator=generator).sort().values
    got = inactive_positions(row, col, shape[1], ranks)
    assert got.dtype == torch.int64 and torch.equal(got, free[ranks])


def test_inactive_positions_refuses_ranks_out_of_order(path):
    row, col = torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="ranks must be non-decreasing, got 5 before 4 at position 2"):
        inactive_positions(row, col, 10, torch.tensor([1, 5, 4]))
    ranks = torch.arange(5 * CHUNK)  # the same from a chunk run by another thread
    ranks[4 * CHUNK + 1] = 3
    with pytest.raises(RuntimeError, match=rf"got {4 * CHUNK} before 3 at position {4 * CHUNK + 1}"):
        inactive_positions(row, col, 10, ranks)


def test_inactive_positions_refuses_negative_ranks(path):
    row, col = torch.tensor([0], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="ranks must be at least 0, got -1"):
        inactive_positions(row, col, 10, torch.tensor([-1, 0]))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_native_inactive_positions_refuses_a_decrease_at_any_chunk_boundary(threads):
    # (each chunk checks its own ranks, and its first against the one before it)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ranks = torch.arange(6 * CHUNK)
        for boundary in range(CHUNK, 6 * CHUNK, CHUNK // 2):
            ranks_down = ranks.clone()
            ranks_down[boundary:] -= 10
            with pytest.raises(RuntimeError, match=f"at position {boundary}$"):
                inactive_positions(torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), 4, ranks_down)
    finally:
        torch.set_num_threads(previous)


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
        ("inactive_positions", (torch.arange(3, dtype=torch.int32), torch.arange(3), 4, torch.arange(3))),
        ("segment_pointer", (torch.arange(3), 3)),
        ("merge_connections", (torch.zeros(2, dtype=torch.int32), torch.zeros(2), torch.ones(2, dtype=torch.bool),
                               torch.zeros(0, dtype=torch.int64), 1, 1)),
        ("take_or_fill", (torch.zeros(3), torch.zeros(2, dtype=torch.int32), 0.0)),
        ("matching_positions", (torch.zeros(2, dtype=torch.int32),) * 3 + (torch.zeros(2, dtype=torch.int64),)),
    ],
)
def test_native_ops_name_the_argument_they_refuse(op, args):
    with pytest.raises(RuntimeError, match=rf"snack_cpu\.{op}: \w+ must be a 1-D \w+ CPU tensor, got"):
        getattr(torch.ops.snack_cpu, op)(*args)


def _rewiring(shape, density, drop_fraction, grow_fraction, seed):
    """A sorted topology of ``shape``, a random ``keep`` and increasing grow positions among the
    positions no kept connection holds (dropped ones included)."""
    generator = torch.Generator().manual_seed(seed)
    out_features, in_features = shape
    total = out_features * in_features
    linear = torch.randperm(total, generator=generator)[: int(total * density)].sort().values
    keep = torch.rand(linear.numel(), generator=generator) >= drop_fraction
    held = torch.zeros(total, dtype=torch.bool)
    held[linear[keep]] = True
    free = (~held).nonzero().squeeze(1)
    grow = free[torch.randperm(free.numel(), generator=generator)[: int(free.numel() * grow_fraction)]].sort().values
    row, col = (linear // in_features).to(torch.int32), (linear % in_features).to(torch.int32)
    return row, col, keep, grow, linear


@pytest.mark.parametrize(
    "shape, density, drop_fraction, grow_fraction",
    [
        ((1, 1), 0.0, 0.0, 1.0),  # nothing to keep: only grown
        ((3, 5), 1.0, 0.0, 0.0),  # full, nothing changes
        ((3, 5), 1.0, 1.0, 1.0),  # everything dropped and regrown in place
        ((17, 64), 0.5, 0.3, 0.2),
        ((4096, 128), 0.5, 0.3, 0.05),  # 262144 connections: four chunks
        ((300, 1000), 0.9, 0.01, 0.5),  # grown positions crowd into few chunks
        ((5, 200_000), 0.1, 0.3, 0.01),
    ],
)
def test_merge_connections_merges_in_row_major_order(path, shape, density, drop_fraction, grow_fraction):
    row, col, keep, grow, linear = _rewiring(shape, density, drop_fraction, grow_fraction, seed=sum(shape))
    new_row, new_col, src, grown_slots = merge_connections(row, col, keep, grow, shape)
    assert (new_row.dtype, new_col.dtype, src.dtype, grown_slots.dtype) == (torch.int32,) * 2 + (torch.int64,) * 2
    new_linear = new_row.to(torch.int64) * shape[1] + new_col
    assert torch.equal(new_linear, torch.cat([linear[keep], grow]).sort().values)  # sorted, unique, all of them
    assert (new_col >= 0).all() and (new_col < shape[1]).all()
    kept = src >= 0
    assert torch.equal(src[kept], keep.nonzero().squeeze(1))  # each kept one at its old coordinates
    assert torch.equal(new_linear[kept], linear[src[kept]])
    assert torch.equal(new_linear[grown_slots], grow) and torch.equal((~kept).nonzero().squeeze(1), grown_slots)


def test_merge_connections_refuses_to_grow_where_a_connection_stays(path):
    # the clash in the last of several chunks, the connection before it dropped
    row, col, keep, grow, linear = _rewiring((4096, 128), 0.5, 0.3, 0.05, seed=3)
    stays = int(keep.nonzero()[-1])
    keep[stays - 1] = False
    clashing = torch.cat([grow, linear[stays - 1 : stays + 1]]).unique()
    position = int(linear[stays])
    with pytest.raises(ValueError, match=rf"grow position {position} is a connection that stays "
                                         rf"\(row {position // 128}, column {position % 128}\)"):
        merge_connections(row, col, keep, clashing, (4096, 128))


@pytest.mark.parametrize("bad_grow", [[2, 2], [3, 1], [-1], [15]])
def test_merge_connections_refuses_grow_positions_out_of_order_or_range(path, bad_grow):
    row, col = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32)
    keep = torch.tensor([True, False])
    message = r"grow positions must be in \[0, 15\)" if len(bad_grow) == 1 else "grow positions must increase, got"
    with pytest.raises(RuntimeError, match=message):
        merge_connections(row, col, keep, torch.tensor(bad_grow), (3, 5))


@pytest.mark.parametrize("dtype", [torch.bool, torch.bfloat16, torch.float32, torch.int64, torch.complex128])
@pytest.mark.parametrize("n", [0, 1, 3 * CHUNK + 5])
def test_take_or_fill_gathers_and_fills(path, dtype, n):
    generator = torch.Generator().manual_seed(n)
    values = (torch.randn(n + 3, generator=generator) * 10).to(dtype)
    src = torch.randint(-1, n + 3, (n,), generator=generator)
    got = take_or_fill(values, src, 1)
    expected = torch.where(src >= 0, values[src.clamp(min=0)], torch.ones((), dtype=dtype))
    assert got.dtype == dtype and torch.equal(got, expected)


def test_take_or_fill_refuses_a_fill_its_dtype_cannot_hold(path):
    with pytest.raises(RuntimeError, match="cannot be converted to type c10::Half without overflow"):
        take_or_fill(torch.ones(2, dtype=torch.float16), torch.tensor([-1, 0]), 1e5)


def test_merge_connections_of_the_tallest_layer(path):
    # grown positions 2^31 - 2 rows apart (each row found by division, not walked to)
    last = (1 << 31) - 2
    empty = torch.zeros(0, dtype=torch.int32)
    new_row, new_col, src, slots = merge_connections(
        empty, empty, torch.zeros(0, dtype=torch.bool), torch.tensor([0, last]), (last + 1, 1)
    )
    assert new_row.tolist() == [0, last] and new_col.tolist() == [0, 0]
    assert src.tolist() == [-1, -1] and slots.tolist() == [0, 1]


def test_take_or_fill_from_nothing_is_all_fill(path):
    assert take_or_fill(torch.zeros(0), torch.full((4,), -1), 2.5).tolist() == [2.5] * 4


@pytest.mark.parametrize("bad", [-2, 7])
@pytest.mark.parametrize("at", [0, 2 * CHUNK + 1, 3 * CHUNK - 1], ids=["first", "inside", "last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_take_or_fill_refuses_src_out_of_range(path, bad, at, dtype):
    # (the native kernel gathers 8 entries at a time: the first bad one of a vector is named)
    src = torch.zeros(3 * CHUNK, dtype=torch.int64)
    src[[at, min(at + 3, 3 * CHUNK - 1)]] = bad
    with pytest.raises(IndexError, match=rf"src\[{at}\] = {bad} is outside \[-1, 7\)"):
        take_or_fill(torch.zeros(7, dtype=dtype), src, 0.0)


def _coordinates(linear: torch.Tensor, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (linear // in_features).to(torch.int32), (linear % in_features).to(torch.int32)


@pytest.mark.parametrize(
    "shape, density, drop_fraction, grow_fraction",
    [
        ((1, 1), 0.0, 0.0, 1.0),  # from nothing
        ((3, 5), 1.0, 1.0, 0.0),  # to nothing
        ((3, 5), 1.0, 0.0, 0.0),  # the same topology
        ((17, 64), 0.5, 0.3, 0.2),
        ((4096, 128), 0.5, 0.3, 0.05),  # 262144 connections: four chunks
        ((300, 1000), 0.9, 0.01, 0.5),  # the new ones crowd into few chunks
        ((5, 200_000), 0.1, 0.9, 0.001),  # few connections left in a long old list
        ((2, 2**31 - 1), None, None, None),  # the widest layer: keys beyond 32 bits (positions below)
    ],
)
def test_matching_positions_find_each_connection_in_the_other_topology(path, shape, density, drop_fraction,
                                                                       grow_fraction):
    if density is None:
        wide = 2**31 - 1
        linear, new_linear = torch.tensor([0, 5, wide - 1, wide + 3]), torch.tensor([1, 5, wide - 1, wide, wide + 3])
    else:
        _, _, keep, grow, linear = _rewiring(shape, density, drop_fraction, grow_fraction, seed=sum(shape))
        new_linear = torch.cat([linear[keep], grow]).sort().values
    row, col = _coordinates(linear, shape[1])
    new_row, new_col = _coordinates(new_linear, shape[1])
    src = matching_positions(row, col, new_row, new_col)
    assert src.dtype == torch.int64 and src.shape == new_linear.shape
    where = {position: i for i, position in enumerate(linear.tolist())}
    assert src.tolist() == [where.get(position, -1) for position in new_linear.tolist()]


def test_the_torch_calls_run_inside_fake_tensor_mode_and_compiled_code():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert not indexing.native_for(torch.empty(3))

    @torch.compile(backend="eager", fullgraph=True)  # (no graph break: a native op would be one)
    def free(row, col, ranks):
        return inactive_positions(row, col, 4, ranks)

    row, col = torch.tensor([0, 0, 1], dtype=torch.int32), torch.tensor([1, 2, 0], dtype=torch.int32)
    assert free(row, col, torch.tensor([0, 1, 2, 4])).tolist() == [0, 3, 5, 7]
