"""SRigL: RigL's drop balanced per row, regrowth per row by the dense model's gradient, every row at
its target; balanced_drop and gradient_grow_rows against loops written from their definitions."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import snack
from conftest import check_topology_invariants
from dst_models import cnn, mlp, sparse_layers, step_with_dense_gradients
from snack.dst.prune_grow import gradient_grow, gradient_grow_rows, linear_index
from snack.dst.srigl import balanced_drop

SPARSITY = 0.6  # of the models built by dst_models


def _row_counts(layer) -> list[int]:
    return layer.topology.rowptr.diff().tolist()


def _expected_drop_and_quotas(values, rows, counts, in_features, proposal):
    """balanced_drop written out row by row from its docstring."""
    nnz, out = len(values), len(counts)
    fan_in, extra = divmod(nnz, out)
    proposed = set(proposal)
    dropped = [sum(1 for p in proposal if rows[p] == r) for r in range(out)]
    kept = [counts[r] - dropped[r] for r in range(out)]
    plus_one = sorted(range(out), key=lambda r: (-kept[r], r))[:extra]
    target = [fan_in + (r in plus_one) for r in range(out)]
    drop = set(proposed)
    quotas = []
    for r in range(out):
        members = [p for p in range(nnz) if rows[p] == r]
        balanced = min(max(dropped[r], counts[r] - target[r]), in_features - target[r])
        if balanced > dropped[r]:  # the smallest |w| still kept go too
            kept_members = sorted((p for p in members if p not in proposed), key=lambda p: (abs(values[p]), p))
            drop |= set(kept_members[: balanced - dropped[r]])
        elif balanced < dropped[r]:  # the largest proposed stay
            proposed_members = sorted((p for p in members if p in proposed), key=lambda p: (-abs(values[p]), p))
            drop -= set(proposed_members[: dropped[r] - balanced])
        quotas.append(target[r] - counts[r] + balanced)
    return sorted(drop), quotas


def _expected_grow(gradient, active, quotas):
    """Per row, its quota of inactive positions with the largest |gradient| (ties to the lower one)."""
    out, in_features = gradient.shape
    grown = []
    for r in range(out):
        free = [c for c in range(in_features) if (r, c) not in active]
        free.sort(key=lambda c: (-abs(float(gradient[r, c])), c))
        grown += [r * in_features + c for c in free[: quotas[r]]]
    return sorted(grown)


@pytest.mark.parametrize("make", [mlp, cnn], ids=["mlp", "cnn"])
def test_updates_balance_the_drop_regrow_each_row_by_the_dense_gradient_and_keep_nnz(make):
    """Two updates: the first balances rows of the random topology's varying counts, the second
    finds them balanced. Each drops RigL's k smallest |w| balanced per row, and regrows each row to
    its target with its largest |∂L/∂W| (the dense model's gradient) among positions inactive
    before, at zero; the other weights are kept."""
    model, x = make(SPARSITY)
    layers = sparse_layers(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay put: the update is predictable
    dst = snack.dst.SRigL(model, opt, drop_fraction=0.05, update_every=1, total_steps=10, schedule="constant")
    nnz = [m.nnz for m in layers]
    assert any(len(set(_row_counts(m))) > 2 for m in layers)  # unbalanced to begin with
    moved_rows = False
    for _ in (1, 2):
        old = [(linear_index(m.topology).tolist(), m.values.detach().clone(), _row_counts(m)) for m in layers]
        dense_grads = step_with_dense_gradients(model, opt, x)
        assert dst.step()
        for layer, (key, values, counts), n, grad in zip(layers, old, nnz, dense_grads, strict=True):
            in_features = layer.in_features
            rows = [p // in_features for p in key]
            proposal = values.abs().sort(stable=True).indices[: math.floor(0.05 * n)].tolist()
            drop, quotas = _expected_drop_and_quotas(values.tolist(), rows, counts, in_features, proposal)
            moved_rows |= drop != sorted(proposal)
            active = {(p // in_features, p % in_features) for p in key}
            grown = _expected_grow(grad, active, quotas)
            expected = (set(key) - {key[p] for p in drop}) | set(grown)
            now = linear_index(layer.topology)
            assert set(now.tolist()) == expected
            check_topology_invariants(layer, n)
            fan_in, extra = divmod(n, layer.out_features)
            assert sorted(_row_counts(layer)) == [fan_in] * (layer.out_features - extra) + [fan_in + 1] * extra
            assert bool((layer.values[torch.isin(now, torch.tensor(grown, dtype=now.dtype))] == 0).all())
            kept = torch.tensor([p for p in range(len(key)) if p not in set(drop)], dtype=torch.int64)
            assert torch.equal(layer.values[torch.isin(now, torch.tensor(key)[kept])].detach(), values[kept])
    assert moved_rows  # the balancing changed some drop: the test would see it skipped


def test_a_constant_fan_in_stays_constant_each_row_regrowing_what_it_lost():
    torch.manual_seed(0)
    out_features, in_features, fan_in = 12, 40, 7
    cols = torch.stack([torch.randperm(in_features)[:fan_in] for _ in range(out_features)])
    rows = torch.arange(out_features).repeat_interleave(fan_in)
    layer = snack.SparseLinear.from_coo(rows, cols.reshape(-1), torch.randn(out_features * fan_in),
                                        (out_features, in_features))  # fmt: skip
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    dst = snack.dst.SRigL(layer, opt, drop_fraction=0.4, update_every=1, total_steps=100, schedule="constant")
    for _ in range(5):
        before = linear_index(layer.topology)
        opt.zero_grad()
        layer(torch.randn(6, in_features)).square().sum().backward()
        opt.step()
        assert dst.step()
        after = linear_index(layer.topology)
        assert _row_counts(layer) == [fan_in] * out_features
        lost = torch.bincount(before[~torch.isin(before, after)] // in_features, minlength=out_features)
        gained = torch.bincount(after[~torch.isin(after, before)] // in_features, minlength=out_features)
        assert torch.equal(lost, gained) and int(lost.sum()) > 0


def test_rows_stay_balanced_over_many_updates_of_an_erk_model_under_adam():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(30, 50), nn.ReLU(), nn.Linear(50, 50), nn.ReLU(), nn.Linear(50, 7))
    model = snack.sparsify(net, 0.85, distribution="erk", init="random")
    layers = sparse_layers(model)
    nnz = [m.nnz for m in layers]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dst = snack.dst.SRigL(model, opt, update_every=2, total_steps=60, stop_fraction=1.0, grow_init="random")
    for step in range(60):
        x, y = torch.randn(16, 30), torch.randint(0, 7, (16,))
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        dst.step()
        if step >= 1:  # from the first update on
            for layer, n in zip(layers, nnz):
                counts = _row_counts(layer)
                assert layer.nnz == n and max(counts) - min(counts) <= 1
                assert opt.state[layer.values]["exp_avg"].shape == (n,)


def test_balanced_drop_drops_more_in_full_rows_and_less_in_nearly_dense_ones():
    # in = 4. Row 0: 4 connections, row 1: 3, row 2: 1 (nnz 8, out 3: targets 3, 3, 2 or so)
    rows = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2], dtype=torch.int32)
    rowptr = torch.tensor([0, 4, 7, 8], dtype=torch.int32)
    values = torch.tensor([0.9, -0.1, 0.5, 0.4, 0.3, -0.2, 0.8, 0.05])
    # RigL's proposal (k = 2): the two smallest |w|, positions 7 (row 2) and 1 (row 0)
    proposal = torch.tensor([1, 7])
    drop, quotas = balanced_drop(values, rows, rowptr, 4, proposal)
    # kept after the proposal: 3, 3, 0 -> targets 3, 3 (the two rows keeping most) and 2
    assert drop.tolist() == [1, 7] and quotas.tolist() == [0, 0, 2]
    # proposing all three of row 1's: kept 4, 0, 1 -> the two extra connections (nnz 8 = 3·2 + 2)
    # go to rows 0 and 2, targets 3, 2, 3. Row 0, above its target, also drops its smallest |w|
    # (position 1); row 1 has one free position, so to end at 2 it may drop only 2 of the 3: its
    # largest proposed (0.8, position 6) stays
    drop, quotas = balanced_drop(values, rows, rowptr, 4, torch.tensor([4, 5, 6]))
    assert drop.tolist() == [1, 4, 5] and quotas.tolist() == [0, 1, 2]
    assert int(quotas.sum()) == drop.numel()


def test_balanced_drop_breaks_ties_by_position():
    rows = torch.tensor([0, 0, 0, 0, 0, 0, 1], dtype=torch.int32)
    rowptr = torch.tensor([0, 6, 7], dtype=torch.int32)
    values = torch.tensor([0.5, -0.5, 0.5, 0.5, -0.5, 0.5, 1.0])
    # nothing proposed: nnz 7 = 3·2 + 1, the extra one to row 0 (it keeps the most): target 4, so it
    # drops its 2 smallest |w|, all equal: the first two positions; row 1 regrows to 3
    drop, quotas = balanced_drop(values, rows, rowptr, 8, torch.empty(0, dtype=torch.int64))
    assert drop.tolist() == [0, 1] and quotas.tolist() == [0, 2]


@pytest.mark.parametrize(
    "proposal, match",
    [([0, 9], r"positions into the layer's 3 values, got some outside \[0, 3\)"),
     ([-1], "outside"),
     ([1, 1], "unique positions")],
)  # fmt: skip
def test_balanced_drop_refuses_a_bad_proposal(proposal, match):
    rows, rowptr = torch.tensor([0, 0, 1], dtype=torch.int32), torch.tensor([0, 2, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        balanced_drop(torch.ones(3), rows, rowptr, 5, torch.tensor(proposal))


@settings(max_examples=60, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 6), st.integers(1, 7)),
    density=st.floats(0.0, 1.0),
    fraction=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_balanced_drop_matches_its_definition_and_lands_every_row_on_its_target(shape, density, fraction, seed):
    out_features, in_features = shape
    generator = torch.Generator().manual_seed(seed)
    nnz = round(density * out_features * in_features)
    positions = torch.randperm(out_features * in_features, generator=generator)[:nnz].sort().values
    rows = (positions // in_features).to(torch.int32)
    rowptr = torch.zeros(out_features + 1, dtype=torch.int32)
    rowptr[1:] = torch.bincount(rows.long(), minlength=out_features).cumsum(0)
    values = torch.randint(-3, 4, (nnz,), generator=generator).double()  # small integers: many ties
    proposal = torch.randperm(nnz, generator=generator)[: math.floor(fraction * nnz)]
    drop, quotas = balanced_drop(values, rows, rowptr, in_features, proposal)
    counts = rowptr.diff().tolist()
    expected = _expected_drop_and_quotas(values.tolist(), rows.tolist(), counts, in_features, proposal.tolist())
    assert (drop.tolist(), quotas.tolist()) == expected
    final = [c - int((rows[drop] == r).sum()) + q for r, (c, q) in enumerate(zip(counts, quotas.tolist()))]
    fan_in, extra = divmod(nnz, out_features)
    assert sorted(final) == [fan_in] * (out_features - extra) + [fan_in + 1] * extra
    assert all(0 <= q <= in_features - c for q, c in zip(quotas.tolist(), counts))


def _gradient_case(seed=0, out_features=9, in_features=13, batch=5, sparsity=0.6):
    generator = torch.Generator().manual_seed(seed)
    layer = snack.SparseLinear(in_features, out_features, sparsity=sparsity)
    x = torch.randn(batch, in_features, generator=generator, dtype=torch.float64)
    x[:, 3] = 0  # a dead input: its scores tie at zero in every row
    dy = torch.randn(batch, out_features, generator=generator, dtype=torch.float64)
    inactive = in_features - layer.topology.rowptr.diff()
    quotas = torch.minimum(torch.randint(0, in_features, (out_features,), generator=generator), inactive)
    return layer, x, dy, quotas


@pytest.mark.parametrize("block_elements", [1, 30, 1 << 20], ids=["row-blocks", "few-rows", "one-block"])
def test_gradient_grow_rows_takes_each_rows_quota_of_the_largest_inactive_gradients(block_elements):
    layer, x, dy, quotas = _gradient_case()
    quotas[0] = 13 - _row_counts(layer)[0]  # every free position of row 0, zero scores included
    active = {(r, c) for r, c in zip(layer.row.tolist(), layer.col.tolist())}
    expected = _expected_grow(dy.t() @ x, active, quotas.tolist())
    grown = gradient_grow_rows(x, dy, layer.topology, quotas, block_elements=block_elements)
    assert grown.tolist() == expected and grown.dtype == torch.int64


def test_gradient_grow_rows_breaks_ties_by_position():
    layer, _, dy, quotas = _gradient_case(seed=2)
    x = torch.ones(5, 13, dtype=torch.float64)  # every score of a row equal
    active = set(zip(layer.row.tolist(), layer.col.tolist()))
    expected = [r * 13 + c for r in range(9) for c in [c for c in range(13) if (r, c) not in active][: quotas[r]]]
    assert gradient_grow_rows(x, dy, layer.topology, quotas).tolist() == expected


def test_gradient_grow_rows_ranks_nan_first_and_agrees_with_gradient_grow():
    layer, x, dy, _ = _gradient_case(seed=1)
    x[0, 5] = float("nan")  # column 5's scores are NaN in every row
    free = 13 - layer.topology.rowptr.diff()
    quotas = torch.minimum(torch.full_like(free, 1), free)
    active = {(r, c) for r, c in zip(layer.row.tolist(), layer.col.tolist())}
    grown = gradient_grow_rows(x, dy, layer.topology, quotas)
    for position in grown.tolist():
        r, c = divmod(position, 13)
        assert c == 5 or (r, 5) in active
    # quotas of RigL's own choice: the same positions
    chosen = gradient_grow(x, dy, layer.topology, 20)
    per_row = torch.bincount(chosen // 13, minlength=layer.out_features)
    assert torch.equal(gradient_grow_rows(x, dy, layer.topology, per_row), chosen)


def test_gradient_grow_rows_of_a_convolution_from_its_padded_input_equals_from_its_rows():
    torch.manual_seed(0)
    conv = snack.SparseConv2d(4, 6, 3, padding=1, groups=2, sparsity=0.5).double()
    x = torch.randn(2, 4, 5, 5, dtype=torch.float64)
    y = conv(x)
    dy = torch.randn_like(y)
    padded = nn.functional.pad(x, (1, 1, 1, 1))
    rows = conv._rows_of_record(padded)
    dy_rows = dy.permute(0, 2, 3, 1).reshape(-1, 6)
    quotas = torch.minimum(torch.tensor([1, 2, 3, 0, 4, 5]), conv.in_features - conv.topology.rowptr.diff())
    from_padded = gradient_grow_rows(padded, dy_rows, conv.topology, quotas, convolution=conv)
    from_rows = gradient_grow_rows(rows, dy_rows, conv.topology, quotas, convolution=conv)
    assert torch.equal(from_padded, from_rows) and from_rows.numel() == int(quotas.sum())


@pytest.mark.parametrize(
    "quotas, error, match",
    [(torch.zeros(8, dtype=torch.int64), ValueError, r"counts must be \(9,\) integers, one per row"),
     (torch.zeros(9), ValueError, "counts must be"),
     ([0] * 9, ValueError, "got list"),
     (torch.full((9,), 13), ValueError, r"counts\[0\] is 13, but row 0 has \d+ inactive positions"),
     (torch.full((9,), -1), ValueError, r"counts\[0\] is -1")],
)  # fmt: skip
def test_gradient_grow_rows_refuses_bad_counts(quotas, error, match):
    layer, x, dy, _ = _gradient_case()
    with pytest.raises(error, match=match):
        gradient_grow_rows(x, dy, layer.topology, quotas)


def test_gradient_grow_rows_refuses_ids_and_rows_of_another_width():
    layer, x, dy, quotas = _gradient_case()
    with pytest.raises(TypeError, match="x must be a floating tensor"):
        gradient_grow_rows(torch.zeros(5, dtype=torch.int64), dy, layer.topology, quotas)
    with pytest.raises(ValueError, match=r"x must be \(B, 13\) rows"):
        gradient_grow_rows(x[:, :12], dy, layer.topology, quotas)


def test_an_embedding_is_refused_before_anything_is_armed():
    model = snack.sparsify(nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 3)), 0.5, embeddings=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"layer '0' is a SparseEmbedding, whose rows are tokens: leave it out"):
        snack.dst.SRigL(model, opt, total_steps=10)
    assert not model[0]._forward_hooks and not model[1]._forward_hooks
    dst = snack.dst.SRigL(model, opt, total_steps=10, update_every=2, layers=["1"])  # without it
    assert [name for name, _ in dst.layers] == ["1"]


def test_live_rows_ablates_rows_with_too_few_salient_connections():
    # in = 6; rows' counts 3, 3, 3, 0 (row 3 ablated before); nnz 9, fan-in 9 // 3 = 3
    rows = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2], dtype=torch.int32)
    rowptr = torch.tensor([0, 3, 6, 9, 9], dtype=torch.int32)
    proposal = torch.tensor([0, 1, 2, 3, 6])  # row 0 loses all 3, row 1 one, row 2 one
    growth = torch.tensor([1 * 6 + 4, 2 * 6 + 5, 3 * 6 + 0])  # RigL would grow one in rows 1, 2 and 3
    # salient: row 0 0, row 1 2 + 1, row 2 2 + 1; row 3 has no connection: stays ablated
    live = snack.dst.srigl.live_rows(rows, rowptr, 6, proposal, growth, 0.5)
    assert live.tolist() == [False, True, True, False]
    assert snack.dst.srigl.live_rows(rows, rowptr, 6, proposal, growth, 1.0).tolist() == [False, True, True, False]
    # nine connections need two rows of six: the most salient are kept however high the bar
    growth_row_2 = torch.tensor([2 * 6 + 4, 2 * 6 + 5])
    assert snack.dst.srigl.live_rows(rows, rowptr, 6, proposal, growth_row_2, 1.0).tolist() == [
        False, True, True, False]  # fmt: skip
    drop, quotas = balanced_drop(torch.ones(9), rows, rowptr, 6, proposal, live)
    assert drop.tolist() == [0, 1, 2, 3, 6]  # row 0 drops everything
    # nine connections over the two live rows: 4 each and the extra to the one keeping more, a tie
    # of 2 and 2 that the lower row wins: rows 1 and 2 end at 5 and 4
    assert quotas.tolist() == [0, 3, 2, 0]
    final = torch.tensor([3, 3, 3, 0]) - torch.bincount(rows[drop].long(), minlength=4) + quotas
    assert final.tolist() == [0, 5, 4, 0]


def test_ablation_empties_the_outputs_that_nothing_needs_and_spreads_nnz_over_the_others():
    """Outputs 0-2 feed nothing (zero gradient) and hold the smallest weights: RigL's drop takes
    them and its growth gives them nothing, so they are ablated and stay so; the layer's nnz is
    spread over the other five outputs, each at nnz // 5 or one more."""
    torch.manual_seed(0)
    layer = snack.SparseLinear(20, 8, sparsity=0.7)
    with torch.no_grad():
        layer.values[layer.row < 3] *= 1e-6
    nnz = layer.nnz
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    dst = snack.dst.SRigL(layer, opt, ablation=0.3, drop_fraction=0.5, update_every=1, total_steps=100,
                          schedule="constant")  # fmt: skip
    for _ in range(3):
        opt.zero_grad()
        layer(torch.randn(16, 20))[:, 3:].square().sum().backward()
        opt.step()
        assert dst.step()
        counts = _row_counts(layer)
        assert counts[:3] == [0, 0, 0] and layer.nnz == nnz
        assert sorted(counts[3:]) == sorted([nnz // 5 + (i < nnz % 5) for i in range(5)])
        check_topology_invariants(layer, nnz)


def test_without_ablation_an_output_without_connections_gets_its_share():
    layer = snack.SparseLinear.from_coo(torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 2, 3]), torch.ones(4), (3, 5))
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    dst = snack.dst.SRigL(layer, opt, drop_fraction=0.25, update_every=1, total_steps=100, schedule="constant")
    layer(torch.randn(4, 5)).sum().backward()
    opt.step()
    assert dst.step()
    assert sorted(_row_counts(layer)) == [1, 1, 2]


@pytest.mark.parametrize("ablation, error", [(1.5, ValueError), (-0.1, ValueError), ("0.3", TypeError)])
def test_a_bad_ablation_is_refused_naming_it(ablation, error):
    layer = snack.SparseLinear(6, 4, sparsity=0.5)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    with pytest.raises(error, match="ablation must be"):
        snack.dst.SRigL(layer, opt, ablation=ablation, total_steps=10, update_every=2)
    assert not layer._forward_hooks


def test_a_state_saved_with_another_ablation_is_refused():
    layer = snack.SparseLinear(6, 4, sparsity=0.5)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    state = snack.dst.SRigL(layer, opt, ablation=0.3, total_steps=10, update_every=2).state_dict()
    with pytest.raises(ValueError, match="ablation"):
        snack.dst.SRigL(layer, opt, total_steps=10, update_every=2).load_state_dict(state)
