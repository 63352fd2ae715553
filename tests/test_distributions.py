import math

import pytest
import torch
from torch import nn

import snack
from snack.distributions import erk_densities, layer_sparsities

MLP_SHAPES = {"a": (1024, 784), "b": (1024, 1024), "c": (10, 1024)}


def _kept(shapes, sparsities):
    return sum((1 - sparsities[n]) * o * i for n, (o, i) in shapes.items())


def test_uniform_gives_every_layer_the_same_sparsity():
    assert layer_sparsities(MLP_SHAPES, 0.8, "uniform") == {"a": 0.8, "b": 0.8, "c": 0.8}


@pytest.mark.parametrize("sparsity", [0.5, 0.8, 0.9, 0.99])
def test_erk_meets_the_global_budget_and_caps_at_dense(sparsity):
    s = layer_sparsities(MLP_SHAPES, sparsity, "erk")
    total = sum(o * i for o, i in MLP_SHAPES.values())
    assert math.isclose(_kept(MLP_SHAPES, s), (1 - sparsity) * total, rel_tol=1e-9)
    assert all(0.0 <= v < 1.0 for v in s.values())


def test_erk_densities_are_proportional_to_out_plus_in_over_out_times_in():
    d = erk_densities(MLP_SHAPES, 0.1)
    # the 10-wide classifier would need density > 1: it becomes dense and the rest share the budget
    assert d["c"] == 1.0
    ratio = d["a"] / d["b"]
    expected = ((1024 + 784) / (1024 * 784)) / ((1024 + 1024) / (1024 * 1024))
    assert math.isclose(ratio, expected, rel_tol=1e-12)


def test_erk_weighs_every_kernel_size_of_a_3d_convolution():
    shapes = {"conv3d": (16, 8, 3, 3, 3), "linear": (64, 32)}
    d = erk_densities(shapes, 0.2)
    expected = ((16 + 8 + 3 + 3 + 3) / (16 * 8 * 27)) / ((64 + 32) / (64 * 32))
    assert math.isclose(d["conv3d"] / d["linear"], expected, rel_tol=1e-12)
    with pytest.raises(ValueError, match=r"layer 'k': .* must be in \[1, "):
        erk_densities({"k": (16, 8, 3, 0, 3)}, 0.2)
    with pytest.raises(ValueError, match=r"or \(out, in, kd, kh, kw\), got \(1, 2, 3, 4, 5, 6\)"):
        erk_densities({"k": (1, 2, 3, 4, 5, 6)}, 0.2)


def test_erk_without_capping_matches_closed_form():
    shapes = {"x": (100, 100), "y": (200, 50)}
    d = erk_densities(shapes, 0.1)
    total = 100 * 100 + 200 * 50
    epsilon = 0.1 * total / ((100 + 100) + (200 + 50))
    assert math.isclose(d["x"], epsilon * 200 / 10000)
    assert math.isclose(d["y"], epsilon * 250 / 10000)


def test_erk_at_zero_sparsity_is_dense():
    assert layer_sparsities(MLP_SHAPES, 0.0, "erk") == {"a": 0.0, "b": 0.0, "c": 0.0}


def test_unknown_distribution_is_rejected():
    with pytest.raises(ValueError, match="distribution"):
        layer_sparsities(MLP_SHAPES, 0.9, "gaussian")


def test_sparsify_with_erk_keeps_the_global_number_of_connections():
    net = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 96), nn.ReLU(), nn.Linear(96, 4))
    total = sum(m.weight.numel() for m in net if isinstance(m, nn.Linear))
    model = snack.sparsify(net, 0.9, distribution="erk", init="random")
    layers = [m for m in model if isinstance(m, snack.SparseLinear)]
    assert abs(sum(m.nnz for m in layers) - 0.1 * total) <= len(layers)
    # the narrow output layer is denser than the square hidden layer
    assert layers[2].nnz / (4 * 96) > layers[1].nnz / (96 * 96)
    assert model(torch.randn(3, 64)).shape == (3, 4)


@pytest.mark.parametrize("density", [-0.5, 0.0, 1.5, float("nan")])
def test_erk_densities_rejects_a_density_outside_zero_to_one(density):
    with pytest.raises(ValueError, match=r"density must be in \(0, 1\]"):
        erk_densities({"a": (10, 10), "b": (20, 5)}, density)


def test_erk_names_a_layer_without_rows():
    with pytest.raises(ValueError, match="layer 'b': out_features must be in"):
        erk_densities({"a": (10, 10), "b": (0, 5)}, 0.5)
    with pytest.raises(TypeError, match="density must be a float"):
        erk_densities({"a": (10, 10)}, "0.5")
