"""The sparse format: construction, validation, derived data."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import snack
from snack.topology import Topology, coo_from_dense, largest_magnitudes, random_coo, validate_coo


def _assert_sorted_unique_in_range(row, col, shape):
    assert row.dtype == torch.int32 and col.dtype == torch.int32
    validate_coo(row, col, shape)  # raises on any violation


@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (64, 40), (300, 200)])
@pytest.mark.parametrize("sparsity", [0.0, 0.3, 0.5, 0.9, 0.99])
def test_random_coo_has_exact_nnz_and_valid_coordinates(shape, sparsity):
    row, col = random_coo(*shape, sparsity)
    total = shape[0] * shape[1]
    assert row.numel() == max(1, round((1 - sparsity) * total))
    _assert_sorted_unique_in_range(row, col, shape)


def test_random_coo_is_uniform_over_positions():
    # each of the 20 positions is kept with probability 1/4; 4000 draws -> mean 1000, sd ~27
    counts = torch.zeros(4, 5)
    generator = torch.Generator().manual_seed(0)
    for _ in range(4000):
        row, col = random_coo(4, 5, 0.75, generator=generator)
        counts[row.long(), col.long()] += 1
    assert counts.sum() == 4000 * 5
    assert (counts - 1000).abs().max() < 150


def test_random_coo_is_reproducible_with_a_generator():
    a = random_coo(50, 60, 0.9, generator=torch.Generator().manual_seed(3))
    b = random_coo(50, 60, 0.9, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_random_coo_huge_layer_is_sparse_in_memory():
    row, col = random_coo(100_000, 100_000, 0.9999)
    assert row.numel() == 1_000_000
    _assert_sorted_unique_in_range(row, col, (100_000, 100_000))


def test_coo_from_dense_keeps_nonzeros():
    weight = torch.tensor([[0.0, 2.0, 0.0], [-1.0, 0.0, 3.0]])
    row, col, values = coo_from_dense(weight)
    assert row.tolist() == [0, 1, 1] and col.tolist() == [1, 0, 2]
    assert values.tolist() == [2.0, -1.0, 3.0]


def test_coo_from_dense_keeps_largest_magnitudes():
    weight = torch.tensor([[0.1, -5.0, 0.2], [4.0, -0.3, 3.0]])
    row, col, values = coo_from_dense(weight, sparsity=0.5)
    assert list(zip(row.tolist(), col.tolist())) == [(0, 1), (1, 0), (1, 2)]
    assert values.tolist() == [-5.0, 4.0, 3.0]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 200),
    fraction=st.floats(0, 1),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
    kind=st.sampled_from(["normal", "ties", "zeros", "special"]),
    block=st.sampled_from([1, 7, 64, 1 << 20]),
    seed=st.integers(0, 2**16),
)
def test_largest_magnitudes_picks_what_a_stable_descending_sort_picks(n, fraction, dtype, kind, block, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=generator, dtype=torch.float64)
    if kind == "ties":  # many equal magnitudes: the earlier position must win
        x = x.round()
    elif kind == "zeros":
        x[torch.rand(n, generator=generator) < 0.6] = 0.0
        x[torch.rand(n, generator=generator) < 0.2] = -0.0
    elif kind == "special":  # NaN counts as the largest, as torch.sort orders it
        for value in (float("inf"), -float("inf"), float("nan")):
            x[torch.rand(n, generator=generator) < 0.1] = value
    x = x.to(dtype)
    k = round(fraction * n)
    expected = torch.sort(x.abs(), descending=True, stable=True).indices[:k].sort().values
    assert torch.equal(largest_magnitudes(x, k, block=block), expected)


def test_largest_magnitudes_rejects_a_bad_k():
    with pytest.raises(ValueError, match=r"k must be in \[0, 3\], got 4"):
        largest_magnitudes(torch.ones(3), 4)


# the column order sorts 16-bit columns up to 2**15 columns, the int32 ones beyond
@pytest.mark.parametrize("in_features, sparsity", [(23, 0.8), (1 << 15, 0.999), ((1 << 15) + 1, 0.999)])
def test_topology_derived_data_matches_definitions(in_features, sparsity):
    row, col = random_coo(37, in_features, sparsity, generator=torch.Generator().manual_seed(1))
    if in_features > 23:  # also the first and the last column (where 16 bits would overflow) in every row
        edges = {(r, c) for r in range(37) for c in (0, in_features - 1)}
        pairs = {(r, c) for r, c in zip(row.tolist(), col.tolist())} | edges
        row, col = (torch.tensor(t, dtype=torch.int32) for t in zip(*sorted(pairs)))
    topo = Topology(row, col, (37, in_features))
    counts_by_row = torch.bincount(row.long(), minlength=37)
    assert torch.equal(topo.rowptr[1:] - topo.rowptr[:-1], counts_by_row.int())
    perm = topo.csc_perm.long()
    assert sorted(perm.tolist()) == list(range(topo.nnz))
    key = col[perm].long() * 37 + row[perm].long()  # column-major order
    assert bool((key[1:] > key[:-1]).all())
    assert torch.equal(topo.colptr[1:] - topo.colptr[:-1], torch.bincount(col.long(), minlength=in_features).int())


def test_topology_derived_data_is_computed_once():
    topo = Topology(*random_coo(10, 10, 0.5), (10, 10))
    assert topo.rowptr is topo.rowptr and topo.csc_perm is topo.csc_perm and topo.colptr is topo.colptr


def test_cpu_topology_tensors_carry_a_column_order_only_once_built(monkeypatch):
    """No CPU kernel reads csc_perm: the ops get an empty one from a CPU topology that has not
    built it; one that has, and a topology on any other device (e.g. a GPU's), pass the real one."""
    row, col = random_coo(10, 12, 0.5, generator=torch.Generator().manual_seed(0))
    fresh = Topology(row, col, (10, 12)).tensors()
    assert fresh.csc_perm.shape == (0,) and fresh.csc_perm.dtype == torch.int32
    assert fresh.rowptr.numel() == 11 and fresh.colptr.numel() == 13
    built = Topology(row, col, (10, 12))
    perm = built.csc_perm
    assert built.tensors().csc_perm is perm
    monkeypatch.setattr(Topology, "device", property(lambda self: torch.device("cuda")))  # (no GPU here)
    assert torch.equal(Topology(row, col, (10, 12)).tensors().csc_perm, perm)


def test_empty_topology():
    empty = torch.empty(0, dtype=torch.int32)
    topo = Topology(empty, empty, (3, 4))
    assert topo.nnz == 0
    assert topo.rowptr.tolist() == [0, 0, 0, 0] and topo.colptr.tolist() == [0] * 5
    assert topo.csc_perm.numel() == 0


@pytest.mark.parametrize(
    "row, col, shape, message",
    [
        ([0, 1], [0], (2, 2), "same length"),
        ([0, 2], [0, 0], (2, 2), "row index 2 is out of range"),
        ([0, 1], [0, -1], (2, 2), "col index -1 is out of range"),
        ([0, 0], [1, 1], (2, 2), "duplicate coordinate"),
        ([1, 0], [0, 0], (2, 2), "sorted"),
        ([0], [0], (0, 2), "out_features must be in"),
    ],
)
def test_validate_coo_rejects_bad_coordinates(row, col, shape, message):
    with pytest.raises(ValueError, match=message):
        validate_coo(torch.tensor(row), torch.tensor(col), shape)


def test_validate_coo_rejects_bad_types():
    with pytest.raises(TypeError, match="int32 or int64"):
        validate_coo(torch.tensor([0.0]), torch.tensor([0]), (1, 1))
    with pytest.raises(ValueError, match="1-D"):
        validate_coo(torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), (1, 1))


@pytest.mark.parametrize(
    "shape, error, message",
    [
        ((2.9, 3), TypeError, "out_features must be an int, got float 2.9"),
        ((True, 3), TypeError, "out_features must be an int, got bool"),
        (("2", 3), TypeError, "out_features must be an int, got str"),
        ((2, 3, 4), ValueError, r"shape must be \(out_features, in_features\), got \(2, 3, 4\)"),
        (6, ValueError, r"shape must be \(out_features, in_features\), got 6"),
    ],
)
def test_a_shape_that_is_not_two_ints_is_refused_not_coerced(shape, error, message):
    row, col = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
    for build in (
        lambda: Topology(row, col, shape),
        lambda: Topology(row, col, shape, validate=False),
        lambda: snack.SparseLinear.from_coo(row, col, torch.ones(2), shape),
    ):
        with pytest.raises(error, match=message):
            build()


def test_meta_coordinates_are_refused_with_a_clear_error():
    meta = torch.tensor([0, 1], dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="row is on the meta device, which holds no coordinates"):
        Topology(meta, meta, (2, 2))
    layer = snack.SparseLinear(2, 2, sparsity=0.5)
    with pytest.raises(ValueError, match="row is on the meta device"):
        layer.set_topology(meta, meta)


@pytest.mark.parametrize("sparsity", [-0.1, 1.0, 1.5, float("nan")])
def test_random_coo_rejects_bad_sparsity(sparsity):
    with pytest.raises(ValueError, match=r"sparsity must be in \[0, 1\)"):
        random_coo(4, 4, sparsity)


def test_largest_magnitudes_treats_nans_of_any_payload_alike():
    """torch.sort treats every NaN alike, so among NaNs the earliest positions win, whatever the
    payload (NaNs from different computations, or -NaN, carry different bits). block=4 forces
    the radix select."""
    payloads = [0x7FC00000, 0x7FC00001, 0x7FFFFFFF, 0xFFC00000 - (1 << 32), 0x7F800001]
    flat = torch.randn(20, generator=torch.Generator().manual_seed(0))
    nan_positions = [2, 5, 9, 13, 17]
    bits = flat.view(torch.int32).clone()
    for position, payload in zip(nan_positions, reversed(payloads)):  # largest payload last
        bits[position] = payload
    flat = bits.view(torch.float32)
    assert bool(flat[nan_positions].isnan().all())
    for k in range(1, 6):
        expected = torch.sort(flat.abs(), descending=True, stable=True).indices[:k].sort().values
        assert expected.tolist() == nan_positions[:k]
        assert largest_magnitudes(flat, k, block=4).tolist() == nan_positions[:k]


def test_validate_coo_without_require_sorted_accepts_any_order_but_not_duplicates():
    """validate_coo(require_sorted=False): any order, but still no duplicates."""
    validate_coo(torch.tensor([1, 0, 1]), torch.tensor([0, 2, 2]), (2, 3), require_sorted=False)
    with pytest.raises(ValueError, match="duplicate coordinate"):
        validate_coo(torch.tensor([1, 0, 1]), torch.tensor([2, 2, 2]), (2, 3), require_sorted=False)
