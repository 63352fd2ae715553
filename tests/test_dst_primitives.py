"""Drop/grow primitives, the generic update and schedules of snack.dst."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import snack
import snack.dst.prune_grow
import snack.indexing
from snack.dst import DropSchedule, cubic_sparsity, gradient_grow, magnitude_drop, random_grow, rewire
from snack.dst.prune_grow import linear_index
from snack.sampling import sorted_sample
from snack.topology import Topology, coo_from_linear, random_coo


def _topology(out=12, in_=9, sparsity=0.7, seed=0):
    row, col = random_coo(out, in_, sparsity, generator=torch.Generator().manual_seed(seed))
    return Topology(row, col, (out, in_))


def test_magnitude_drop_picks_the_smallest_magnitudes():
    values = torch.tensor([0.5, -0.1, 0.3, -0.9, 0.05, 0.2])
    assert magnitude_drop(values, 3).tolist() == [1, 4, 5]
    assert magnitude_drop(values, 0).numel() == 0


def test_magnitude_drop_split_sign_drops_both_signs_near_zero():
    values = torch.tensor([0.5, -0.1, 0.3, -0.9, 0.05, 0.2, -0.4, -0.02])
    # 4 positive, 4 negative: drop 2 smallest positives (0.05, 0.2) and 2 negatives nearest 0 (-0.02, -0.1)
    assert magnitude_drop(values, 4, split_sign=True).tolist() == [1, 4, 5, 7]


@pytest.mark.parametrize("split_sign", [False, True])
def test_magnitude_drop_returns_k_positions_with_nan_weights_dropped_last(split_sign):
    # a NaN is neither >= 0 nor < 0: split_sign once lost it and returned fewer than k positions
    nan = float("nan")
    values = torch.tensor([0.5, nan, -0.1, 0.3, nan, -0.9, 0.05, nan, nan, 0.2])
    for k in range(values.numel() + 1):
        drop = magnitude_drop(values, k, split_sign=split_sign)
        assert drop.numel() == k and drop.unique().numel() == k
        # the finite weights go first: of all of them, or with split_sign of the non-negative
        # ones, among which a NaN is counted
        finite = ~values.isnan() & (values >= 0 if split_sign else True)
        assert not values[drop].isnan().any() or finite[drop].sum() == finite.sum()


@pytest.mark.parametrize("sparsity", [0.9, 0.3, 0.02])
def test_random_grow_returns_distinct_inactive_positions(sparsity):
    topo = _topology(20, 30, sparsity)
    inactive = 600 - topo.nnz
    k = min(inactive, 25)
    grown = random_grow(topo, k, torch.Generator().manual_seed(1))
    assert grown.dtype == torch.int64 and grown.numel() == k
    assert torch.equal(grown, grown.unique())  # sorted and distinct
    assert not torch.isin(grown, linear_index(topo)).any()
    assert int(grown.min()) >= 0 and int(grown.max()) < 600


@pytest.mark.parametrize("k", [3, 8], ids=["few-drawn", "those-left-out-drawn"])
def test_random_grow_is_uniform_over_inactive_positions(k):
    topo = _topology(4, 5, 0.5)
    inactive = (~torch.isin(torch.arange(20), linear_index(topo))).nonzero().squeeze(1)
    assert 2 * 3 <= inactive.numel() < 2 * 8  # the two ways of drawing
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(20)
    for _ in range(2000):
        grown = random_grow(topo, k, gen)
        assert torch.equal(grown, grown.unique()) and grown.numel() == k
        counts[grown] += 1
    expected = 2000 * k / inactive.numel()
    assert counts[linear_index(topo)].sum() == 0
    assert ((counts[inactive] - expected).abs() < 0.15 * expected).all()


@pytest.mark.parametrize("shape, sparsity", [((20, 30), 0.0), ((9, 7), 0.5), ((130, 100), 0.3), ((64, 512), 0.97)])
def test_random_grow_grows_the_drawn_ranks_of_the_inactive_positions(shape, sparsity):
    """Rank r maps to the r-th inactive position: the same as listing them all, also where
    actives run together, start or end the matrix, or none are inactive (sparsity 0)."""
    topo = _topology(*shape, sparsity)
    total = shape[0] * shape[1]
    active = linear_index(topo)
    active = torch.cat([active, torch.tensor([0, total - 1])]).unique()  # runs at both ends
    topo = Topology(*coo_from_linear(active, shape[1]), shape)
    inactive = (~torch.isin(torch.arange(total), active)).nonzero().squeeze(1)
    for k in {0, min(1, inactive.numel()), inactive.numel() // 3, inactive.numel()}:
        ranks = sorted_sample(inactive.numel(), k, torch.Generator().manual_seed(k))
        assert torch.equal(random_grow(topo, k, torch.Generator().manual_seed(k)), inactive[ranks])


def test_random_grow_of_every_inactive_position_is_quick_and_exact():
    """Rejection sampling would hunt the last few for seconds (a coupon collector's tail)."""
    topo = _topology(512, 512, 0.1)
    inactive = 512 * 512 - topo.nnz
    grown = random_grow(topo, inactive, torch.Generator().manual_seed(0))
    everything = torch.cat([grown, linear_index(topo)]).sort().values
    assert torch.equal(everything, torch.arange(512 * 512))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("split_sign", [False, True])
def test_magnitude_drop_picks_what_a_stable_sort_picks(dtype, split_sign):
    """magnitude_drop selects without sorting: the same positions as the stable sorts it
    replaced, with most weights tied (one decimal), signed zeros and NaNs among them."""
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(5000, generator=generator).round(decimals=1)
    values[::17], values[::13] = float("nan"), -0.0
    values = values.to(dtype)
    for k in (0, 1, 999, 2500, 4999, 5000):
        if split_sign:
            negative = values < 0
            positive, negative = (~negative).nonzero().squeeze(1), negative.nonzero().squeeze(1)
            k_pos = min(positive.numel(), round(k * positive.numel() / values.numel()))
            k_neg = min(negative.numel(), k - k_pos)
            k_pos = k - k_neg
            expected = torch.cat([
                positive[torch.sort(values[positive], stable=True).indices[:k_pos]],
                negative[torch.sort(values[negative], stable=True, descending=True).indices[:k_neg]],
            ]).sort().values  # fmt: skip
        else:
            expected = torch.sort(values.abs(), stable=True).indices[:k].sort().values
        assert torch.equal(magnitude_drop(values, k, split_sign=split_sign), expected)


def test_random_grow_refuses_more_than_the_inactive_positions():
    topo = _topology(4, 5, 0.5)
    with pytest.raises(ValueError, match="inactive"):
        random_grow(topo, 11, torch.Generator())


@pytest.fixture(params=["native", "torch"])
def score_path(request, monkeypatch):
    """Run a gradient_grow test on the native CPU kernel and on the torch calls (what a GPU, a
    batch above 128 or a forced reference backend runs)."""
    if request.param == "torch":
        monkeypatch.setattr(snack.dst.prune_grow, "_NATIVE_MAX_BATCH", -1)
    else:
        assert snack.indexing.native_for(torch.zeros(1))  # the native kernels load here
    return request.param


def _scored_natively(x, dy, topo) -> bool:
    return snack.dst.prune_grow._GradientScores(x, dy, topo).native


def test_gradient_grow_scores_natively_on_the_cpu_up_to_batch_128():
    topo = _topology(12, 9, 0.6)
    assert _scored_natively(torch.randn(128, 9), torch.randn(128, 12), topo)
    assert not _scored_natively(torch.randn(129, 9), torch.randn(129, 12), topo)  # MKL's product is as fast
    with snack.use_backend("reference"):
        assert not _scored_natively(torch.randn(3, 9), torch.randn(3, 12), topo)


@pytest.mark.parametrize("block_elements", [1, 9, 40, 1 << 20])
def test_gradient_grow_matches_a_dense_reference(block_elements, score_path):
    torch.manual_seed(0)
    topo = _topology(12, 9, 0.6)
    x, dy = torch.randn(7, 9, dtype=torch.float64), torch.randn(7, 12, dtype=torch.float64)
    k = 15
    dense = (dy.t() @ x).abs().reshape(-1)
    dense[linear_index(topo)] = -1
    got = gradient_grow(x, dy, topo, k, block_elements=block_elements)
    assert torch.equal(got, _top_k_positions(dense, k))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gradient_grow_scores_16_bit_records_in_float32(dtype, score_path):
    """Records of a float16 or bfloat16 layer: Σ_b dy·x was formed in their dtype, where float16
    overflows at 65504 (every large score inf, the picks arbitrary) and bfloat16 rounds close
    scores together. Scored in float32, the picks are those of the exact gradient."""
    torch.manual_seed(0)
    topo = _topology(12, 9, 0.6)
    # Σ_b dy·x between 80000 and 81600: inf in float16, 4 distinct values in bfloat16 (steps of 512)
    x, dy = (torch.rand(8, 9) + 100).to(dtype), (torch.rand(8, 12) + 100).to(dtype)
    dense = (dy.double().t() @ x.double()).reshape(-1)
    dense[linear_index(topo)] = -1
    k = 10  # the 10th largest score is shared by three positions: the lowest one is grown
    assert torch.equal(gradient_grow(x, dy, topo, k), _top_k_positions(dense, k))


@given(st.integers(1, 12), st.integers(1, 12), st.floats(0.0, 0.95), st.integers(1, 60), st.booleans(), st.data())
@settings(max_examples=80, deadline=None)
def test_gradient_grow_breaks_ties_by_position_across_blocks(out, in_, sparsity, block_elements, native, data):
    """Integer records make most scores equal: the picks are the k best by (score, then lowest
    position), whatever the blocks (one row up to the whole matrix) and however often the
    candidates are cut back to the best k."""
    topo = _topology(out, in_, sparsity, seed=data.draw(st.integers(0, 3)))
    inactive = out * in_ - topo.nnz
    if inactive == 0:
        return
    k = data.draw(st.integers(1, inactive))
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 3)))
    x = torch.randint(-2, 3, (3, in_), generator=generator).double()
    dy = torch.randint(-2, 3, (3, out), generator=generator).double()
    dense = (dy.t() @ x).abs().reshape(-1)
    dense[linear_index(topo)] = -1
    saved = snack.dst.prune_grow._NATIVE_MAX_BATCH
    snack.dst.prune_grow._NATIVE_MAX_BATCH = saved if native else -1  # (hypothesis: no monkeypatch fixture)
    try:
        got = gradient_grow(x, dy, topo, k, block_elements=block_elements)
    finally:
        snack.dst.prune_grow._NATIVE_MAX_BATCH = saved
    assert torch.equal(got, _top_k_positions(dense, k))


def _bars_tried(monkeypatch) -> list:
    """The bars gradient_grow will try (its passes over the blocks), in order: 0 is no bar."""
    bars = []
    real = snack.dst.prune_grow._best_above
    monkeypatch.setattr(snack.dst.prune_grow, "_best_above", lambda *a: bars.append(a[-1]) or real(*a))
    return bars


@pytest.mark.parametrize("sampled_rows_dominate", [False, True])
def test_gradient_grow_checks_the_bar_it_reads_off_a_sample_of_rows(sampled_rows_dominate, monkeypatch, score_path):
    """Scores below a bar predicted from evenly strided rows are skipped. Rows whose gradients
    dwarf the others exactly at the sampled ones make the bar too high: fewer than k scores
    reach it, and the blocks are scored again without it. Either way the picks are exact."""
    torch.manual_seed(0)
    topo = _topology(64, 50, 0.8)
    x, dy = torch.randn(4, 50, dtype=torch.float64), torch.randn(4, 64, dtype=torch.float64)
    if sampled_rows_dominate:
        dy[:, ::8] *= 1000  # 8 blocks of 8 rows: the sample is rows 0, 8, 16, ...
    bars = _bars_tried(monkeypatch)
    k = 400
    dense = (dy.t() @ x).abs().reshape(-1)
    dense[linear_index(topo)] = -1
    assert torch.equal(gradient_grow(x, dy, topo, k, block_elements=400), _top_k_positions(dense, k))
    assert bars[0] != 0  # the sampled bar
    assert (bars[1:] == [0]) == sampled_rows_dominate  # the second pass, without a bar


@pytest.mark.parametrize("out, in_, sampled", [(300, 256, True), (200, 256, False)])
def test_gradient_grow_samples_a_bar_for_a_layer_of_one_block_from_65536_scores(out, in_, sampled, monkeypatch):
    """Without a bar every free score of the first blocks enters the candidates, and ranking them
    costs more than the sample (768×3072 at 90%: 38 ms against 21 ms, benchmarks/gradient_grow.txt)."""
    torch.manual_seed(0)
    topo = _topology(out, in_, 0.9)
    x, dy = torch.randn(8, in_, dtype=torch.float64), torch.randn(8, out, dtype=torch.float64)
    bars = _bars_tried(monkeypatch)
    k = 2000
    dense = (dy.t() @ x).abs().reshape(-1)
    dense[linear_index(topo)] = -1
    assert torch.equal(gradient_grow(x, dy, topo, k), _top_k_positions(dense, k))
    assert (bars[0] != 0) == sampled


def _top_k_positions(scores, k):
    """The sorted positions of the ``k`` largest ``scores``, equal ones going to the lower
    position (a stable sort keeps equal scores in position order), as gradient_grow picks them."""
    return torch.sort(scores, descending=True, stable=True).indices[:k].sort().values


def test_rewire_keeps_invariants_values_and_zero_initialises_new_connections():
    layer = snack.SparseLinear(9, 12, sparsity=0.6)
    old_linear = linear_index(layer.topology)
    old_values = dict(zip(old_linear.tolist(), layer.values.tolist()))
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    rowptr_before = layer.topology.rowptr
    drop = torch.tensor([0, 3, 5])
    grow = random_grow(layer.topology, 3, torch.Generator().manual_seed(0))
    rewire(layer, opt, drop, grow)
    new_linear = linear_index(layer.topology)
    assert layer.nnz == old_linear.numel()
    assert torch.equal(new_linear, new_linear.unique())
    assert set(new_linear.tolist()) == (set(old_linear.tolist()) - set(old_linear[drop].tolist())) | set(grow.tolist())
    for pos, value in zip(new_linear.tolist(), layer.values.tolist()):
        assert value == (0.0 if pos in set(grow.tolist()) else old_values[pos])
    # caches were rebuilt for the new coordinates
    assert layer.topology.rowptr is not rowptr_before
    assert torch.equal(layer.topology.rowptr.diff(), torch.bincount(layer.row.long(), minlength=12).int())


@given(st.integers(1, 9), st.integers(1, 9), st.floats(0.0, 0.9), st.data())
@settings(max_examples=60, deadline=None)
def test_rewire_matches_a_reference_kept_by_position(out, in_, sparsity, data):
    """rewire merges the kept and the grown connections without sorting them all: the result,
    the values and Adam's state follow each connection, for any drop (none, all), grow in any
    order (also regrowing dropped positions) and any grow_values."""
    torch.manual_seed(data.draw(st.integers(0, 3)))
    layer = snack.SparseLinear(in_, out, sparsity=sparsity)
    opt = torch.optim.Adam(layer.parameters(), lr=0.1)
    layer(torch.randn(2, in_)).sum().backward()
    opt.step()
    old = linear_index(layer.topology).tolist()
    drop = data.draw(st.lists(st.sampled_from(range(len(old))), unique=True)) if old else []
    free = sorted(set(range(out * in_)) - set(old) | {old[i] for i in drop})
    grow = data.draw(st.lists(st.sampled_from(free), unique=True, max_size=len(free))) if free else []
    grow_values = torch.randn(len(grow))
    values = dict(zip(old, layer.values.tolist()))
    moments = dict(zip(old, opt.state[layer.values]["exp_avg"].tolist()))
    for i in drop:
        del values[old[i]], moments[old[i]]
    for position, value in zip(grow, grow_values.tolist()):
        values[position], moments[position] = value, 0.0
    drop, grow = torch.tensor(drop, dtype=torch.int64), torch.tensor(grow, dtype=torch.int64)
    rewire(layer, opt, drop, grow, grow_values=grow_values)
    assert linear_index(layer.topology).tolist() == sorted(values)
    assert layer.values.tolist() == [values[p] for p in sorted(values)]
    assert opt.state[layer.values]["exp_avg"].tolist() == [moments[p] for p in sorted(values)]


@pytest.mark.parametrize(
    "drop, grow, grow_values, error, match",
    [
        ([0], "active", None, ValueError, r"layer: grow positions must be inactive"),
        ([0, 0], "inactive2", None, ValueError, r"layer: drop positions must be unique"),
        ([-1], "inactive1", None, ValueError, r"layer: drop positions must be in \[0, 43\), got -1..-1"),
        ([43], "inactive1", None, ValueError, r"layer: drop positions must be in \[0, 43\), got 43..43"),
        ([0], "out_of_range", None, ValueError, r"layer: grow positions must be in \[0, 108\), got 108..108"),
        ([0, 1], "duplicate", None, ValueError, r"layer: grow positions must be unique"),
        (torch.tensor([0.0]), "inactive1", None, TypeError, r"layer: drop must be a 1-D integer tensor, got \(1,\)"),
        ([0], "inactive1", torch.zeros(5), ValueError, r"grow_values must be a floating tensor of shape \(1,\)"),
        ([0], "inactive1", torch.zeros(1, dtype=torch.int64), ValueError, r"grow_values must be a floating"),
    ],
)
def test_rewire_rejects_bad_arguments_and_changes_nothing(drop, grow, grow_values, error, match):
    layer = snack.SparseLinear(9, 12, sparsity=0.6)  # 43 connections of 108
    opt = torch.optim.Adam(layer.parameters(), lr=0.1)
    layer(torch.randn(2, 9)).sum().backward()
    opt.step()
    inactive = torch.tensor(sorted(set(range(108)) - set(linear_index(layer.topology).tolist())))
    grow = {
        "active": linear_index(layer.topology)[4:5], "inactive1": inactive[:1], "inactive2": inactive[:2],
        "duplicate": inactive[:1].repeat(2), "out_of_range": torch.tensor([108]),
    }[grow]  # fmt: skip
    drop = torch.tensor(drop) if isinstance(drop, list) else drop
    before = (layer.row.clone(), layer.col.clone(), layer.values.detach().clone())
    state = {k: v.clone() for k, v in opt.state[layer.values].items()}
    with pytest.raises(error, match=match):
        rewire(layer, opt, drop, grow, grow_values=grow_values)
    assert all(torch.equal(a, b) for a, b in zip(before, (layer.row, layer.col, layer.values)))
    assert all(torch.equal(v, opt.state[layer.values][k]) for k, v in state.items())


@pytest.mark.parametrize(
    "case, error, match",
    [
        ("no optimizer", TypeError, "optimizer must be a torch.optim.Optimizer, got NoneType"),
        ("another optimizer", ValueError, r"the optimizer does not hold the values of sparse layer\(s\) \['layer'\]"),
        ("not a layer", TypeError, "layer must be a snack.SparseLinear, got Linear"),
    ],
)
def test_rewire_rejects_a_bad_layer_or_optimizer_and_changes_nothing(case, error, match):
    layer = snack.SparseLinear(9, 12, sparsity=0.6)
    opt = torch.optim.Adam(layer.parameters(), lr=0.1)
    layer(torch.randn(2, 9)).sum().backward()
    opt.step()
    inactive = sorted(set(range(108)) - set(linear_index(layer.topology).tolist()))
    target, optimizer = layer, opt
    if case == "no optimizer":
        optimizer = None
    elif case == "another optimizer":
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    else:
        target = torch.nn.Linear(9, 12)
    before = (layer.row.clone(), layer.col.clone(), layer.values.detach().clone())
    state = {k: v.clone() for k, v in opt.state[layer.values].items()}
    with pytest.raises(error, match=match):
        rewire(target, optimizer, torch.tensor([0]), torch.tensor(inactive[:1]))
    assert all(torch.equal(a, b) for a, b in zip(before, (layer.row, layer.col, layer.values)))
    assert all(torch.equal(v, opt.state[layer.values][k]) for k, v in state.items())


def test_the_stop_step_is_not_lost_to_floating_point_rounding():
    # 0.29 · 100 is 28.999999999999996
    assert DropSchedule(0.3, 1, 100, 0.29, "cosine").end_step == 29
    assert DropSchedule(0.3, 1, 7, 0.5, "cosine").end_step == 3


def test_cosine_and_constant_schedules():
    cos = DropSchedule(0.3, 10, 1000, 0.75, "cosine")
    assert cos.end_step == 750
    assert math.isclose(cos.fraction(0), 0.3) and math.isclose(cos.fraction(375), 0.15)
    assert math.isclose(cos.fraction(750), 0.0, abs_tol=1e-12)
    assert [t for t in range(1, 1001) if cos.is_update_step(t)] == list(range(10, 751, 10))
    const = DropSchedule(0.3, 10, 1000, 0.75, "constant")
    assert const.fraction(500) == 0.3


@pytest.mark.parametrize(
    "arguments, error, match",
    [
        ((0.3, 10, 1000, 0.75, "linear"), ValueError, "schedule must be one of"),  # was a silent cosine
        ((1.5, 10, 1000, 0.75, "cosine"), ValueError, "drop_fraction must be in"),
        ((0.3, 0, 1000, 0.75, "cosine"), ValueError, "update_every must be >= 1"),
        ((0.3, 10, 10.5, 0.75, "cosine"), TypeError, "total_steps must be an int"),
        ((0.3, 10, 1000, float("nan"), "cosine"), ValueError, "stop_fraction must be in"),
    ],
)
def test_a_drop_schedule_checks_its_arguments(arguments, error, match):
    with pytest.raises(error, match=match):
        DropSchedule(*arguments)


def test_cubic_sparsity_ramp():
    assert cubic_sparsity(0, 0.5, 0.9, 10, 110) == 0.5
    assert cubic_sparsity(200, 0.5, 0.9, 10, 110) == 0.9
    assert math.isclose(cubic_sparsity(60, 0.5, 0.9, 10, 110), 0.9 - 0.4 * 0.125)


def test_rewire_under_inference_mode_leaves_an_optimizer_that_can_step():
    layer = snack.SparseLinear(9, 12, sparsity=0.6)
    opt = torch.optim.Adam(layer.parameters(), lr=0.1)
    layer(torch.randn(2, 9)).sum().backward()
    opt.step()
    inactive = sorted(set(range(108)) - set(linear_index(layer.topology).tolist()))
    with torch.inference_mode():
        snack.dst.rewire(layer, opt, torch.tensor([0, 1]), torch.tensor(inactive[:2]))
    assert not any(t.is_inference() for t in opt.state[layer.values].values() if torch.is_tensor(t))
    layer(torch.randn(2, 9)).sum().backward()
    opt.step()  # in-place updates of the remapped state


def test_gradient_grow_ranks_nan_first_without_losing_larger_scores_of_later_blocks(score_path):
    # |dW| = [[nan, 0.1], [(active), 0.9]], one row per block: a kept NaN made the running k-th
    # best NaN, and every later finite score failed the prefilter
    topo = Topology(torch.tensor([1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32), (2, 2))
    x = torch.tensor([[float("nan"), 0.1]])
    dy = torch.tensor([[1.0, 9.0]])
    assert gradient_grow(x, dy, topo, 2, block_elements=2).tolist() == [0, 3]


def test_magnitude_drop_split_sign_splits_k_in_proportion_to_each_sign():
    """split_sign divides k between the signs in proportion to their counts: with 8 positive and
    2 negative weights, dropping 5 takes 4 positives and 1 negative (4 and 4 would not tell an
    even split from a proportional one)."""
    values = torch.tensor([0.1, 0.2, -0.3, 0.4, 0.5, 0.6, -0.05, 0.7, 0.8, 0.9])
    # 4 smallest positives: 0.1, 0.2, 0.4, 0.5 (positions 0, 1, 3, 4); the negative nearest 0: -0.05 (6)
    assert magnitude_drop(values, 5, split_sign=True).tolist() == [0, 1, 3, 4, 6]
