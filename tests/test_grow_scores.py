"""The native kernels of RigL's and SRigL's gradient growth (``snack/backends/cpu/grow_scores.cpp``)
against torch.

``torch.ops.snack_cpu.gradient_scores_above`` returns the free positions of a range of rows whose
``|dyᵀ·x|`` key reaches a bar, and their keys. The reference forms every score with a matrix
product, takes the keys (``snack.ranking.ordering_keys``), marks the connections and compares.
Integer-valued records make every sum exact in any order, so the two agree bit for bit; shapes
cross the kernel's boundaries (16- and 32-column panels, 8- and 4-row groups, row blocks, panel
sweeps, the split between threads).

``torch.ops.snack_cpu.gradient_scores_top_rows`` returns, for each row of a range, its quota of free
positions with the largest keys (ties to the lower position): against a stable sort of each row's
dense keys.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from snack.backends.cpu import native  # noqa: F401  (builds and loads the kernels)
from snack.ranking import ordering_keys
from snack.topology import Topology, random_coo

scores_above = torch.ops.snack_cpu.gradient_scores_above
top_rows = torch.ops.snack_cpu.gradient_scores_top_rows
NAN_KEY = {torch.float32: 0x7F800001, torch.float64: 0x7FF0000000000001}


def _reference(dyt, x, topo, first, last, bar, strict):
    """``(keys, positions)`` as the kernel promises them, from the dense scores of the rows."""
    keys = ordering_keys((dyt[first:last] @ x).abs()).reshape(-1).clone()
    row = topo.row.long()
    mine = (row >= first) & (row < last)
    keys[(row[mine] - first) * x.shape[1] + topo.col[mine].long()] = -1
    hit = (keys > bar if strict else keys >= bar).nonzero().squeeze(1)
    return keys[hit], hit + first * x.shape[1]


def _case(out, in_, batch, sparsity, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    topo = Topology(*random_coo(out, in_, sparsity, generator=generator), (out, in_))
    dyt = torch.randint(-3, 4, (out, batch), generator=generator).to(dtype)
    x = torch.randint(-3, 4, (batch, in_), generator=generator).to(dtype)
    return topo, dyt, x


def _run(dyt, x, topo, first, last, bar, strict):
    return scores_above(dyt, x, topo.rowptr, topo.col, first, last, bar, strict)


def _assert_same(got, expected):
    assert got[0].dtype == expected[0].dtype and got[1].dtype == torch.int64
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@given(
    st.integers(1, 20), st.integers(1, 70), st.integers(0, 9), st.floats(0.0, 0.95),
    st.sampled_from([torch.float32, torch.float64]), st.booleans(), st.data(),
)  # fmt: skip
@settings(max_examples=150, deadline=None)
def test_matches_the_dense_reference(out, in_, batch, sparsity, dtype, strict, data):
    topo, dyt, x = _case(out, in_, batch, sparsity, dtype, seed=data.draw(st.integers(0, 9)))
    first = data.draw(st.integers(0, out))
    last = data.draw(st.integers(first, out))
    keys = ordering_keys((dyt @ x).abs()).reshape(-1)
    # a bar among the scores (many are equal: ties at the bar), or the ends of the keys' range
    bar = data.draw(st.sampled_from([0, NAN_KEY[dtype], int(keys[data.draw(st.integers(0, keys.numel() - 1))])]))
    _assert_same(_run(dyt, x, topo, first, last, bar, strict), _reference(dyt, x, topo, first, last, bar, strict))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "out, in_, batch",
    [
        (300, 1000, 33),  # several row blocks, two threads
        (50, 1000, 100),  # x's panels do not fit one sweep
        (9, 4096, 8),  # long rows
        (200, 3, 5),  # one padded panel per row
    ],
)
def test_large_shapes_match_the_reference_on_any_thread_count(out, in_, batch, dtype):
    topo, dyt, x = _case(out, in_, batch, 0.9, dtype)
    bar = int(torch.quantile(ordering_keys((dyt @ x).abs()).double().reshape(-1)[:100_000], 0.9))
    expected = _reference(dyt, x, topo, 0, out, bar, False)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            _assert_same(_run(dyt, x, topo, 0, out, bar, False), expected)
            _assert_same(_run(dyt, x, topo, 1, out - 1, bar, True), _reference(dyt, x, topo, 1, out - 1, bar, True))
    finally:
        torch.set_num_threads(threads)
    assert expected[1].numel() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nan_ranks_above_inf_and_every_nan_has_one_key(dtype):
    topo = Topology(torch.tensor([0], dtype=torch.int32), torch.tensor([3], dtype=torch.int32), (1, 5))
    x = torch.tensor([[float("nan"), float("inf"), 1.0, float("nan"), -float("nan")]], dtype=dtype)
    dyt = torch.tensor([[-1.0]], dtype=dtype)
    keys, positions = _run(dyt, x, topo, 0, 1, 0, False)
    assert positions.tolist() == [0, 1, 2, 4]  # position 3 is a connection
    one = int(ordering_keys(torch.ones(1, dtype=dtype)))
    assert keys.tolist() == [NAN_KEY[dtype], NAN_KEY[dtype] - 1, one, NAN_KEY[dtype]]
    assert _run(dyt, x, topo, 0, 1, NAN_KEY[dtype] - 1, True)[1].tolist() == [0, 4]  # only NaN is above inf
    assert _run(dyt, x, topo, 0, 1, NAN_KEY[dtype], True)[1].numel() == 0


def test_a_bar_outside_the_keys_range_takes_all_or_nothing():
    topo, dyt, x = _case(6, 40, 3, 0.5, torch.float32)
    free = 6 * 40 - topo.nnz
    assert _run(dyt, x, topo, 0, 6, -(2**40), False)[1].numel() == free
    assert _run(dyt, x, topo, 0, 6, 2**40, False)[1].numel() == 0
    assert _run(dyt, x, topo, 0, 6, 2**63 - 1, True)[1].numel() == 0


def test_empty_ranges_layers_and_batches():
    topo, dyt, x = _case(5, 7, 2, 0.5, torch.float32)
    assert _run(dyt, x, topo, 3, 3, 0, False)[1].numel() == 0
    full = Topology(*random_coo(4, 6, 0.0), (4, 6))
    assert _run(dyt[:4], x[:, :6].contiguous(), full, 0, 4, 0, False)[1].numel() == 0  # no free position
    keys, positions = _run(dyt[:, :0], x[:0], topo, 0, 5, 0, False)  # batch 0: every score is 0
    assert positions.numel() == 35 - topo.nnz and not keys.any()
    # no inputs, no outputs (shapes a Topology refuses; the op takes them)
    none, zeros = torch.zeros(0, dtype=torch.int32), torch.zeros(6, dtype=torch.int32)
    assert scores_above(dyt, x[:, :0].contiguous(), zeros, none, 0, 5, 0, False)[1].numel() == 0
    assert scores_above(dyt[:0], x, zeros[:1], none, 0, 0, 0, False)[1].numel() == 0


def _bad_calls():
    topo, dyt, x = _case(5, 7, 2, 0.5, torch.float32)
    rowptr, col = topo.rowptr, topo.col
    wild_col = col.clone()
    wild_col[0] = 7
    return {
        "dyt must be": (dyt.half(), x, rowptr, col, 0, 5),
        "x must be a contiguous": (dyt, x.t().contiguous().t(), rowptr, col, 0, 5),
        "x must be \\(B, in\\)": (dyt, x.double(), rowptr, col, 0, 5),
        "rowptr must be a contiguous 1-D int32": (dyt, x, rowptr.long(), col, 0, 5),
        "rowptr must have out \\+ 1": (dyt, x, rowptr[:-1], col, 0, 5),
        "rows must satisfy": (dyt, x, rowptr, col, 2, 6),
        "col\\[0\\] = 7 is outside": (dyt, x, rowptr, wild_col, 0, 5),
        "must lie in": (dyt, x, rowptr, col[:-1], 0, 5),
    }


@pytest.mark.parametrize("message", list(_bad_calls()))
def test_bad_input_raises_a_clear_error(message):
    dyt, x, rowptr, col, first, last = _bad_calls()[message]
    with pytest.raises(RuntimeError, match=message):
        scores_above(dyt, x, rowptr, col, first, last, 0, False)


def _top_rows_reference(dyt, x, topo, quotas, first, last):
    """Each row's quota of free positions with the largest keys, ties to the lower one, increasing."""
    keys = ordering_keys((dyt @ x).abs())
    keys[topo.row.long(), topo.col.long()] = -1
    picked = []
    for r in range(first, last):
        order = torch.sort(keys[r], descending=True, stable=True).indices[: int(quotas[r])]
        picked.append(order.sort().values + r * x.shape[1])
    return torch.cat(picked) if picked else torch.empty(0, dtype=torch.int64)


def _quotas(topo, in_, generator, *, fraction=None):
    free = in_ - topo.rowptr.diff().long()
    if fraction is not None:
        return (free * fraction).long()
    return (torch.rand(free.shape, generator=generator, dtype=torch.float64) * (free + 1)).long().clamp_max(free)


@given(
    st.integers(1, 20), st.integers(1, 70), st.integers(0, 9), st.floats(0.0, 0.95),
    st.sampled_from([torch.float32, torch.float64]), st.data(),
)  # fmt: skip
@settings(max_examples=150, deadline=None)
def test_top_rows_matches_the_dense_reference(out, in_, batch, sparsity, dtype, data):
    seed = data.draw(st.integers(0, 9))
    topo, dyt, x = _case(out, in_, batch, sparsity, dtype, seed=seed)  # small integers: many ties
    quotas = _quotas(topo, in_, torch.Generator().manual_seed(seed))
    first = data.draw(st.integers(0, out))
    last = data.draw(st.integers(first, out))
    got = top_rows(dyt, x, topo.rowptr, topo.col, quotas, first, last)
    assert got.dtype == torch.int64 and torch.equal(got, _top_rows_reference(dyt, x, topo, quotas, first, last))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fraction", [0.01, 0.05, 0.3, 1.0], ids=["1%", "5%", "30%", "all"])
@pytest.mark.parametrize("out, in_, batch", [(300, 1000, 33), (9, 4096, 8), (200, 3, 5)])
def test_top_rows_of_large_shapes_on_any_thread_count(out, in_, batch, fraction, dtype):
    """Quotas small and large against rows of many columns: the sampled bar, and the fallback where
    too few reach it (integer scores: many ties at the bar)."""
    topo, dyt, x = _case(out, in_, batch, 0.9, dtype)
    quotas = _quotas(topo, in_, None, fraction=fraction)
    expected = _top_rows_reference(dyt, x, topo, quotas, 0, out)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            assert torch.equal(top_rows(dyt, x, topo.rowptr, topo.col, quotas, 0, out), expected)
    finally:
        torch.set_num_threads(threads)
    assert expected.numel() == int(quotas.sum())


def test_top_rows_of_random_scores_match_and_rank_nan_first():
    generator = torch.Generator().manual_seed(3)
    topo = Topology(*random_coo(64, 2000, 0.9, generator=generator), (64, 2000))
    dyt, x = torch.randn(64, 16, generator=generator), torch.randn(16, 2000, generator=generator)
    x[3, 77] = float("nan")  # column 77 scores NaN in every row: the first pick of each row holding it free
    quotas = _quotas(topo, 2000, None, fraction=0.04)
    got = top_rows(dyt, x, topo.rowptr, topo.col, quotas, 0, 64)
    assert torch.equal(got, _top_rows_reference(dyt, x, topo, quotas, 0, 64))
    free77 = ~torch.isin(torch.arange(64) * 2000 + 77, topo.row.long() * 2000 + topo.col.long())
    assert bool(torch.isin(torch.arange(64)[free77] * 2000 + 77, got).all())


def test_top_rows_refuses_bad_quotas():
    topo, dyt, x = _case(5, 7, 2, 0.5, torch.float32)
    free = 7 - topo.rowptr.diff().long()
    with pytest.raises(RuntimeError, match="quotas must be a contiguous 1-D int64"):
        top_rows(dyt, x, topo.rowptr, topo.col, free.int(), 0, 5)
    with pytest.raises(RuntimeError, match=r"quotas must have one entry per row \(5\), got 4"):
        top_rows(dyt, x, topo.rowptr, topo.col, free[:4], 0, 5)
    too_many = free.clone()
    too_many[2] += 1
    with pytest.raises(RuntimeError, match=rf"quotas\[2\] = {int(too_many[2])} must lie in \[0, {int(free[2])}\]"):
        top_rows(dyt, x, topo.rowptr, topo.col, too_many, 0, 5)
    with pytest.raises(RuntimeError, match="rows must satisfy"):
        top_rows(dyt, x, topo.rowptr, topo.col, free, 2, 6)
    assert top_rows(dyt, x, topo.rowptr, topo.col, free, 0, 5).numel() == int(free.sum())


def test_top_rows_falls_back_to_every_column_when_the_sampled_bar_is_too_high():
    # the bar is read off every 16th column's key: make those the largest, so that fewer than a
    # quota of 600 reach it, and the pick must run among every free column
    generator = torch.Generator().manual_seed(4)
    topo = Topology(*random_coo(3, 4096, 0.9, generator=generator), (3, 4096))
    x = torch.rand(4, 4096, generator=generator, dtype=torch.float64)
    x[:, ::16] += 100
    dyt = torch.rand(3, 4, generator=generator, dtype=torch.float64)
    quotas = torch.tensor([600, 1, 3000])
    got = top_rows(dyt, x, topo.rowptr, topo.col, quotas, 0, 3)
    assert torch.equal(got, _top_rows_reference(dyt, x, topo, quotas, 0, 3))
