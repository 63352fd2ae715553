"""The native kernel of RigL's gradient growth (``snack/backends/cpu/grow_scores.cpp``) against torch.

``torch.ops.snack_cpu.gradient_scores_above`` returns the free positions of a range of rows whose
``|dyᵀ·x|`` key reaches a bar, and their keys. The reference forms every score with a matrix
product, takes the keys (``snack.ranking.ordering_keys``), marks the connections and compares.
Integer-valued records make every sum exact in any order, so the two agree bit for bit; shapes
cross the kernel's boundaries (16- and 32-column panels, 8- and 4-row groups, row blocks, panel
sweeps, the split between threads).
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from snack.backends.cpu import native  # noqa: F401  (builds and loads the kernels)
from snack.ranking import ordering_keys
from snack.topology import Topology, random_coo

scores_above = torch.ops.snack_cpu.gradient_scores_above
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
