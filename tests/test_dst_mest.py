"""MEST: drop by |w| + λ|∂L/∂w| (the dense model's gradient as reference), random growth up to a
soft bound above each layer's target, back to the targets at the end."""

import copy
import math
import warnings

import pytest
import torch
from torch import nn

import snack
from conftest import check_topology_invariants
from dst_models import batches, cnn, loss, mlp, sparse_layers, step_with_dense_gradients, train
from snack.dst.prune_grow import linear_index, random_grow

SPARSITY = 0.6  # of the models built by dst_models


@pytest.mark.parametrize("make", [mlp, cnn], ids=["mlp", "cnn"])
def test_an_update_drops_the_lowest_scores_and_grows_at_random_up_to_the_bound(make):
    """Two updates: the first from the targets, the second from above them. Each drops the lowest
    |w| + λ|∂L/∂w| (the dense model's gradient at the active positions) down to the target less
    floor(f · n), then grows random inactive positions, at zero, up to the target plus floor(e · n)."""
    model, x = make(SPARSITY)
    layers = sparse_layers(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay put: the drop is predictable
    dst = snack.dst.MEST(model, opt, total_steps=10, update_every=1, drop_fraction=0.2, extra_fraction=0.5,
                         gradient_weight=0.7, schedule="constant")  # fmt: skip
    targets = [m.nnz for m in layers]
    generator = torch.Generator().manual_seed(0)  # MEST's, drawn in the same order
    score_mattered = False
    for step in (1, 2):
        old = [(m.topology, linear_index(m.topology), m.values.detach().clone()) for m in layers]
        dense_grads = step_with_dense_gradients(model, opt, x)
        assert dst.step()
        for layer, (topology, key, values), n, grad in zip(layers, old, targets, dense_grads, strict=True):
            kept = n - math.floor(0.2 * n)
            grown_count = math.floor(0.2 * n) + math.floor(0.5 * n)
            score = values.abs() + 0.7 * grad.reshape(-1)[key].abs()
            dropped = key[score.sort(stable=True).indices[: key.numel() - kept]]
            grown = random_grow(topology, grown_count, generator)
            assert not set(grown.tolist()) & set(key.tolist())  # inactive before the update
            expected = (set(key.tolist()) - set(dropped.tolist())) | set(grown.tolist())
            assert set(linear_index(layer.topology).tolist()) == expected
            check_topology_invariants(layer, kept + grown_count)
            assert bool((layer.values[torch.isin(linear_index(layer.topology), grown)] == 0).all())
            by_magnitude = key[values.abs().sort(stable=True).indices[: key.numel() - kept]]
            score_mattered |= set(by_magnitude.tolist()) != set(dropped.tolist())
    assert score_mattered  # the gradient term changed some choice: the test would see it ignored


def test_nnz_rises_to_the_bound_follows_its_decay_and_ends_at_the_targets():
    model, _ = mlp(SPARSITY)
    layers = sparse_layers(model)
    targets = [m.nnz for m in layers]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dst = snack.dst.MEST(model, opt, total_steps=30, update_every=4, extra_fraction=0.6, drop_fraction=0.1)
    assert dst.decay.end_step == 22  # floor(0.75 · 30)
    history = []
    for x in batches(30):
        train(model, opt, dst, [x])
        history.append((linear_index(layers[0].topology), [m.nnz for m in layers]))
        for m in layers:
            check_topology_invariants(m, m.nnz)
            assert opt.state[m.values]["exp_avg"].shape == (m.nnz,)
    # every 4th step until 22, and 22 itself: the last update, back to the targets
    assert [dst._is_update_step(t) for t in range(1, 31)] == [t in (4, 8, 12, 16, 20, 22) for t in range(1, 31)]
    for t, (_, counts) in enumerate(history, start=1):
        last = max([u for u in (4, 8, 12, 16, 20, 22) if u <= t], default=None)
        extra = 0.0 if last is None else dst.fractions(last)[1]
        assert counts == [n + math.floor(extra * n) for n in targets]
    assert dst.fractions(22) == (0.0, 0.0) and history[-1][1] == targets
    assert history[3][1] != targets  # above them after the first update, at step 4
    assert all(torch.equal(key, history[21][0]) for key, _ in history[22:])  # static after the last update


def test_with_a_hard_bound_and_no_gradient_term_it_is_set():
    runs = []
    for make_dst in (
        lambda m, o: snack.dst.SET(m, o, drop_fraction=0.3, update_every=4, total_steps=20, schedule="constant"),
        lambda m, o: snack.dst.MEST(m, o, drop_fraction=0.3, extra_fraction=0.0, update_every=4, total_steps=20,
                                    schedule="constant"),
    ):  # fmt: skip
        model, _ = mlp(SPARSITY)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        flags = train(model, opt, make_dst(model, opt), batches(20))
        runs.append((model.state_dict(), opt.state_dict()["state"], flags))
    (set_model, set_opt, set_flags), (mest_model, mest_opt, mest_flags) = runs
    assert set_flags == mest_flags == [t in (4, 8, 12) for t in range(1, 21)]  # (MEST's last update, 15, is empty)
    assert all(torch.equal(set_model[key], mest_model[key]) for key in set_model)
    assert all(torch.equal(set_opt[i][name], mest_opt[i][name]) for i in set_opt for name in set_opt[i])


def test_a_missing_gradient_is_an_error_that_changes_nothing():
    model, x = mlp(SPARSITY)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dst = snack.dst.MEST(model, opt, total_steps=10, update_every=1, gradient_weight=0.1, drop_fraction=0.2)
    loss(model, x).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)  # before dst.step(): the score has no gradient to read
    before = copy.deepcopy(model.state_dict())
    rng = dst.generator.get_state()
    with pytest.raises(RuntimeError, match=r"MEST update at step 1: layer '0' has no gradient \(values.grad is None\)"):
        dst.step()
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())
    assert dst.step_count == 0 and torch.equal(dst.generator.get_state(), rng)
    assert snack.dst.MEST(model, opt, total_steps=10, update_every=1, drop_fraction=0.2).step()  # λ = 0: no gradient


def test_a_layer_whose_gradient_is_not_finite_is_left_alone_with_a_warning():
    torch.manual_seed(0)
    left, right = snack.SparseLinear(10, 8, sparsity=0.5), snack.SparseLinear(10, 8, sparsity=0.5)
    model = nn.ModuleList([left, right])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dst = snack.dst.MEST(model, opt, total_steps=10, update_every=1, gradient_weight=1.0, drop_fraction=0.2,
                         schedule="constant")  # fmt: skip
    keys = [linear_index(m.topology) for m in (left, right)]
    a = torch.randn(4, 10)
    a[1, 3] = float("inf")
    (left(a).sum() + right(torch.randn(4, 10)).sum()).backward()  # no optimizer step: as GradScaler skips it
    with pytest.warns(RuntimeWarning, match=r"MEST update at step 1: the gradient for layer '0' has non-finite"):
        assert dst.step()
    assert torch.equal(linear_index(left.topology), keys[0]) and left.nnz == 40
    assert right.nnz == 60 and not torch.equal(linear_index(right.topology), keys[1])


def test_resume_from_a_model_loaded_before_construction_is_bitwise_identical():
    """The model, loaded first, holds connections above the targets: these come from the saved state."""

    def build(model=None):
        fresh, _ = mlp(SPARSITY)
        model = model or fresh
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        dst = snack.dst.MEST(model, opt, total_steps=24, update_every=3, drop_fraction=0.2, gradient_weight=0.3,
                             grow_init="random")  # fmt: skip
        return model, opt, dst

    inputs = batches(24)
    model, opt, dst = build()
    train(model, opt, dst, inputs)
    straight = model.state_dict()
    model, opt, dst = build()
    train(model, opt, dst, inputs[:7])
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "dst": dst.state_dict()})
    model, _ = mlp(SPARSITY)
    model.load_state_dict(saved["model"])
    model, opt, dst = build(model)
    assert dst.target_nnz != saved["dst"]["target_nnz"]  # built on a model above its targets
    opt.load_state_dict(saved["opt"])
    dst.load_state_dict(saved["dst"])
    assert dst.target_nnz == saved["dst"]["target_nnz"]
    train(model, opt, dst, inputs[7:])
    assert all(torch.equal(straight[key], value) for key, value in model.state_dict().items())


def test_load_state_dict_rejects_another_configuration():
    model, _ = mlp(SPARSITY)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = snack.dst.MEST(model, opt, total_steps=1000).state_dict()
    with pytest.raises(ValueError, match=r"configuration differs \(extra_fraction: saved 0.5, this object 0.25\)"):
        snack.dst.MEST(model, opt, total_steps=1000, extra_fraction=0.25).load_state_dict(state)
    with pytest.raises(ValueError, match="algorithm"):
        snack.dst.SET(model, opt, total_steps=1000).load_state_dict(state)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(extra_fraction=-0.5), ValueError, r"extra_fraction must be a finite number >= 0, got -0.5"),
        (dict(extra_fraction=float("nan")), ValueError, "extra_fraction must be a finite number"),
        (dict(extra_fraction="0.5"), TypeError, "extra_fraction must be a float >= 0, got str '0.5'"),
        (dict(gradient_weight=float("inf")), ValueError, "gradient_weight must be a finite number >= 0, got inf"),
        (dict(gradient_weight=True), TypeError, "gradient_weight must be a float"),
        (dict(drop_fraction=1.5), ValueError, r"drop_fraction must be in \[0, 1\]"),
        (dict(grow_init="ones"), ValueError, "grow_init must be one of"),
        (dict(total_steps=0), ValueError, "total_steps"),
        (dict(schedule="linear"), ValueError, "schedule"),
        (dict(layers=["nope"]), ValueError, "layers"),
    ],
)
def test_bad_arguments_raise_and_change_nothing(kwargs, error, match):
    model, _ = mlp(SPARSITY)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(error, match=match):
        snack.dst.MEST(model, opt, **{"total_steps": 1000, **kwargs})
    assert not any(m._forward_hooks or m._backward_hooks for m in model.modules())
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())


def test_a_schedule_without_updates_warns_at_construction():
    model, _ = mlp(SPARSITY)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=r"MEST will never change the topology: updates stop at step 7 of 10"):
        snack.dst.MEST(model, opt, total_steps=10, update_every=100)
    with warnings.catch_warnings():  # a deliberate static run (both fractions 0) does not warn
        warnings.simplefilter("error")
        snack.dst.MEST(model, opt, total_steps=10, update_every=100, extra_fraction=0.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_layer_is_scored_in_float32(dtype):
    """|w| + λ|g| of 16-bit weights, in float32: the same drop as the score formed in float64."""
    torch.manual_seed(0)
    layer = snack.SparseLinear(12, 10, sparsity=0.5, dtype=dtype)
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    dst = snack.dst.MEST(layer, opt, total_steps=10, update_every=1, drop_fraction=0.3, extra_fraction=0.0,
                         gradient_weight=0.5, schedule="constant")  # fmt: skip
    layer(torch.randn(4, 12, dtype=dtype)).float().square().sum().backward()
    key, values, grad = linear_index(layer.topology), layer.values.detach().clone(), layer.values.grad.clone()
    assert dst.step()
    score = values.double().abs() + 0.5 * grad.double().abs()
    dropped = key[score.sort(stable=True).indices[: math.floor(0.3 * key.numel())]]
    now = set(linear_index(layer.topology).tolist())
    assert set(key.tolist()) - now == set(dropped.tolist())  # exactly those dropped, the rest kept
    check_topology_invariants(layer, key.numel())


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
def test_a_compiled_model_rewires_as_the_eager_one():
    """MEST reads ``values.grad`` and records nothing: a model compiled with ``fullgraph=True``
    trains as the eager one, though its nnz changes at every update."""
    (model, _), (reference, _) = mlp(SPARSITY), mlp(SPARSITY)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    dsts = [snack.dst.MEST(m, opt, total_steps=10, update_every=2, drop_fraction=0.2, gradient_weight=0.5)
            for m, opt in zip((model, reference), opts)]  # fmt: skip
    inputs = batches(8)
    flags = train(compiled, opts[0], dsts[0], inputs)
    assert flags == train(reference, opts[1], dsts[1], inputs) and sum(flags) == 4  # steps 2, 4, 6 and 7 (the last)
    for layer, expected in zip(sparse_layers(model), sparse_layers(reference), strict=True):
        assert torch.equal(layer.row, expected.row) and torch.equal(layer.col, expected.col)
        torch.testing.assert_close(layer.values, expected.values)
