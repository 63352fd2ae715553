"""GraNet: gradual pruning (global or layer-wise) with RigL's regrowth, against dense gradients."""

import copy
import math

import pytest
import torch
from torch import nn

import snack
from conftest import check_topology_invariants
from dst_models import batches, cnn, mlp, sparse_layers, step_with_dense_gradients, train
from snack.dst.prune_grow import linear_index

SPARSITY = 0.5  # of the models built by dst_models


def _expected_pruned_counts(layers, sparsity, pruning, initial_nnz):
    """How many connections each layer loses to pruning, written from the definition."""
    total = sum(m.out_features * m.in_features for m in layers)
    if pruning == "layerwise":
        ratio = (1 - sparsity) / (sum(initial_nnz) / total)
        return [max(0, m.nnz - max(1, round(n0 * ratio))) for m, n0 in zip(layers, initial_nnz)]
    excess = sum(m.nnz for m in layers) - round(total * (1 - sparsity))
    candidates = []  # (|w|, layer, position), every connection but each layer's largest
    for index, m in enumerate(layers):
        magnitudes = m.values.detach().abs().tolist()
        largest = max(range(len(magnitudes)), key=magnitudes.__getitem__)
        candidates += [(w, index, p) for p, w in enumerate(magnitudes) if p != largest]
    counts = [0] * len(layers)
    for _, index, _ in sorted(candidates)[: max(0, excess)]:
        counts[index] += 1
    return counts


@pytest.mark.parametrize("pruning", ["global", "layerwise"])
@pytest.mark.parametrize("make", [mlp, cnn], ids=["mlp", "cnn"])
def test_an_update_prunes_then_regrows_where_the_dense_gradient_is_largest(make, pruning):
    """One update: the pruning count of the schedule (global or per layer), then floor(f · survivors)
    more of the smallest |w| dropped and as many grown at the largest |dL/dW| among positions
    inactive before, at zero; the dense model's gradient is the reference."""
    model, x = make(SPARSITY)
    layers = sparse_layers(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay put: the drop is predictable
    dst = snack.dst.GraNet(model, opt, final_sparsity=0.85, start_step=0, end_step=4, total_steps=10,
                           update_every=1, drop_fraction=0.3, schedule="constant", pruning=pruning)  # fmt: skip
    old = [(linear_index(m.topology), m.values.detach().clone()) for m in layers]
    initial = [m.nnz for m in layers]
    pruned = _expected_pruned_counts(layers, dst.sparsity(1), pruning, initial)
    assert sum(pruned) > 0
    dense_grads = step_with_dense_gradients(model, opt, x)
    assert dst.step()
    for layer, (key, values), p, n0, grad in zip(layers, old, pruned, initial, dense_grads, strict=True):
        k = min(math.floor(0.3 * (n0 - p)), layer.out_features * layer.in_features - n0)
        dropped = key[values.abs().sort(stable=True).indices[: p + k]]
        scores = grad.abs().reshape(-1).clone()
        scores[key] = -1  # positions active before the update are never grown
        grown = scores.topk(k).indices
        assert set(linear_index(layer.topology).tolist()) == (set(key.tolist()) - set(dropped.tolist())) | set(
            grown.tolist()
        )
        check_topology_invariants(layer, n0 - p)
        assert bool((layer.values[torch.isin(linear_index(layer.topology), grown)] == 0).all())


@pytest.mark.parametrize("pruning", ["global", "layerwise"])
def test_nnz_follows_the_cubic_schedule_and_regrowth_continues_after_end_step_until_it_stops(pruning):
    model, _ = mlp(SPARSITY)
    layers = sparse_layers(model)
    total = sum(m.out_features * m.in_features for m in layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dst = snack.dst.GraNet(model, opt, final_sparsity=0.9, start_step=2, end_step=10, total_steps=30, update_every=4,
                           stop_fraction=0.6, schedule="constant", pruning=pruning)  # fmt: skip
    counts = []
    for x in batches(24):
        train(model, opt, dst, [x])
        counts.append(sum(m.nnz for m in layers))
        for m in layers:
            check_topology_invariants(m, m.nnz)
            assert opt.state[m.values]["exp_avg"].shape == (m.nnz,)
    # updates at 2, 6, 10 (pruning and regrowth), then 14 and 18 (regrowth alone: stop at 0.6 · 30)
    assert [dst._is_update_step(t) for t in range(1, 25)] == [t in (2, 6, 10, 14, 18) for t in range(1, 25)]
    initial = counts[0]
    for t, count in enumerate(counts, start=1):
        last_update = max([u for u in (2, 6, 10) if u <= t], default=None)
        expected_sparsity = max(1 - initial / total, dst.sparsity(last_update)) if last_update else 1 - initial / total
        assert count == pytest.approx(total * (1 - expected_sparsity), abs=len(layers) / 2 + 1e-9)
    assert counts[-1] == counts[9]


def test_regrowth_changes_the_topology_without_changing_nnz_after_end_step():
    model, _ = mlp(SPARSITY)
    layers = sparse_layers(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dst = snack.dst.GraNet(model, opt, final_sparsity=0.8, start_step=0, end_step=2, total_steps=40, update_every=2)
    train(model, opt, dst, batches(2))
    before = [(linear_index(m.topology), m.nnz) for m in layers]
    flags = train(model, opt, dst, batches(18, seed=1))
    assert flags == [t % 2 == 0 for t in range(3, 21)]  # (the cosine fraction is 0.25 at step 20)
    for m, (key, nnz) in zip(layers, before):
        assert m.nnz == nnz and not torch.equal(linear_index(m.topology), key)


def test_without_regrowth_layerwise_granet_prunes_exactly_as_gradual_pruning():
    runs = []
    for make_dst in (
        lambda m, o: snack.dst.GradualPruning(m, o, final_sparsity=0.9, start_step=0, end_step=12, update_every=3),
        lambda m, o: snack.dst.GraNet(m, o, final_sparsity=0.9, start_step=0, end_step=12, update_every=3,
                                      total_steps=20, drop_fraction=0.0, pruning="layerwise"),
    ):  # fmt: skip
        model, _ = mlp(SPARSITY)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train(model, opt, make_dst(model, opt), batches(15))
        runs.append(model.state_dict())
    assert runs[0].keys() == runs[1].keys()
    assert all(torch.equal(runs[0][key], runs[1][key]) for key in runs[0])


def test_global_pruning_keeps_one_connection_of_a_layer_whose_weights_are_all_small():
    model, _ = mlp(SPARSITY)
    layers = sparse_layers(model)
    with torch.no_grad():
        layers[1].values.mul_(1e-6)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    dst = snack.dst.GraNet(model, opt, final_sparsity=0.95, start_step=0, end_step=1, total_steps=10, update_every=1,
                           drop_fraction=0.0)  # fmt: skip
    largest = linear_index(layers[1].topology)[layers[1].values.abs().argmax()]
    total = sum(m.out_features * m.in_features for m in layers)
    train(model, opt, dst, batches(1))
    assert layers[1].nnz == 1 and linear_index(layers[1].topology).tolist() == [largest]
    assert sum(m.nnz for m in layers) == round(total * 0.05)


def test_resume_from_checkpoint_is_bitwise_identical():
    def build():
        model, _ = mlp(SPARSITY)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        dst = snack.dst.GraNet(model, opt, final_sparsity=0.9, start_step=0, end_step=12, total_steps=24,
                               update_every=3, grow_init="random")  # fmt: skip
        return model, opt, dst

    inputs = batches(24)
    model, opt, dst = build()
    train(model, opt, dst, inputs)
    straight = model.state_dict()
    model, opt, dst = build()
    train(model, opt, dst, inputs[:7])
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "dst": dst.state_dict()})
    model, opt, dst = build()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    dst.load_state_dict(saved["dst"])
    train(model, opt, dst, inputs[7:])
    assert all(torch.equal(straight[key], value) for key, value in model.state_dict().items())


def test_load_state_dict_rejects_another_configuration():
    model, _ = mlp(SPARSITY)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    options = dict(final_sparsity=0.9, start_step=0, end_step=10, total_steps=20)
    state = snack.dst.GraNet(model, opt, **options).state_dict()
    with pytest.raises(ValueError, match=r"configuration differs \(pruning: saved 'global', this object 'layerwise'\)"):
        snack.dst.GraNet(model, opt, pruning="layerwise", **options).load_state_dict(state)
    with pytest.raises(ValueError, match="algorithm"):
        snack.dst.GradualPruning(model, opt, final_sparsity=0.9, start_step=0, end_step=10).load_state_dict(state)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(pruning="random"), ValueError, r"pruning must be one of \('global', 'layerwise'\), got 'random'"),
        (dict(grow_init="ones"), ValueError, "grow_init must be one of"),
        (dict(drop_fraction=1.5), ValueError, "drop_fraction"),
        (dict(total_steps=0), ValueError, "total_steps"),
        (dict(schedule="linear"), ValueError, "schedule"),
        (dict(final_sparsity=0.2), ValueError, r"final_sparsity \(0.2\) must be >= initial_sparsity"),
        (dict(end_step=0), ValueError, "end_step"),
        (dict(layers=["nope"]), ValueError, "layers"),
    ],
)
def test_bad_arguments_raise_and_change_nothing(kwargs, error, match):
    model, _ = mlp(SPARSITY)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = copy.deepcopy(model.state_dict())
    options = dict(final_sparsity=0.9, start_step=0, end_step=10, total_steps=20)
    with pytest.raises(error, match=match):
        snack.dst.GraNet(model, opt, **{**options, **kwargs})
    assert not any(m._forward_hooks or m._backward_hooks for m in model.modules())
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())


class _TwoBranches(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.left = snack.SparseLinear(10, 8, sparsity=0.5)
        self.right = snack.SparseLinear(10, 8, sparsity=0.5)

    def forward(self, a, b):
        return self.left(a).square().sum() + self.right(b).square().sum()


def test_a_layer_whose_recorded_batch_is_not_finite_is_pruned_but_regrows_nothing():
    model = _TwoBranches()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dst = snack.dst.GraNet(model, opt, final_sparsity=0.8, start_step=0, end_step=1, total_steps=10, update_every=1,
                           pruning="layerwise", schedule="constant")  # fmt: skip
    left_key = linear_index(model.left.topology)
    right_key = linear_index(model.right.topology)
    a = torch.randn(4, 10)
    a[1, 3] = float("inf")
    model(a, torch.randn(4, 10)).backward()  # no optimizer step: as GradScaler skips it
    with pytest.warns(RuntimeWarning, match=r"GraNet update at step 1: .* layer 'left' .* pruned but regrows nothing"):
        assert dst.step()
    assert model.left.nnz == model.right.nnz == 16  # 80 positions at 80% sparsity each
    assert set(linear_index(model.left.topology).tolist()) <= set(left_key.tolist())  # pruned only
    assert not set(linear_index(model.right.topology).tolist()) <= set(right_key.tolist())  # regrown too


def test_a_frozen_layer_is_left_alone_while_frozen():
    model, _ = mlp(SPARSITY)
    layers = sparse_layers(model)
    layers[1].requires_grad_(False)
    frozen = (layers[1].row.clone(), layers[1].col.clone(), layers[1].values.detach().clone())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dst = snack.dst.GraNet(model, opt, final_sparsity=0.9, start_step=0, end_step=4, total_steps=10, update_every=2)
    others = [m.nnz for m in layers]
    assert train(model, opt, dst, batches(4)) == [False, True, False, True]
    assert all(torch.equal(a, b) for a, b in zip(frozen, (layers[1].row, layers[1].col, layers[1].values)))
    assert layers[0].nnz < others[0] and layers[2].nnz < others[2]


def test_an_update_without_a_recorded_gradient_is_an_error_that_changes_nothing():
    model, x = mlp(SPARSITY)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dst = snack.dst.GraNet(model, opt, final_sparsity=0.9, start_step=0, end_step=4, total_steps=10, update_every=1)
    before = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        model(x)  # an eval pass records nothing
    with pytest.raises(RuntimeError, match="GraNet update at step 1: no gradient was recorded for layer '0'"):
        dst.step()
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())
    assert dst.step_count == 0


def test_layers_of_different_dtypes_are_ranked_on_one_scale():
    """Global pruning compares float16 and float64 magnitudes by value (their bit patterns differ)."""
    torch.manual_seed(0)
    small = snack.SparseLinear(8, 8, sparsity=0.5, dtype=torch.float64)
    large = snack.SparseLinear(8, 8, sparsity=0.5, dtype=torch.float16)
    with torch.no_grad():
        small.values.copy_(torch.linspace(0.01, 0.02, small.nnz, dtype=torch.float64))
        large.values.copy_(torch.linspace(1.0, 2.0, large.nnz, dtype=torch.float16))
    model = nn.ModuleList([small, large])
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    dst = snack.dst.GraNet(model, opt, final_sparsity=0.75, start_step=0, end_step=1, total_steps=10, update_every=1,
                           drop_fraction=0.0)  # fmt: skip
    assert dst.step()
    assert small.nnz == 1 and large.nnz == 31  # 32 of 128 positions kept: the small layer's largest and 31 more
