"""The dense math for topologies that hold every connection (snack.backends.full): when it runs,
and that every path through it gives the sparse kernels' results."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import snack
from snack import backends
from snack.backends import full
from snack.topology import Topology

from conftest import make_layer

CPU = torch.device("cpu")


def full_layer(out_features=7, in_features=5, dtype=torch.float64) -> snack.SparseLinear:
    layer = make_layer(out_features, in_features, 0.0, dtype=dtype)
    assert layer.nnz == out_features * in_features
    return layer


def test_it_applies_only_to_a_topology_of_every_connection():
    assert full.applies(CPU, full_layer().topology.tensors())
    one_missing = Topology(*(t[1:] for t in full_layer().indices()), (7, 5))
    assert not full.applies(CPU, one_missing.tensors())
    empty = torch.empty(0, dtype=torch.int32)
    assert not full.applies(CPU, Topology(empty, empty, (1, 1)).tensors())


def test_not_on_a_gpu_under_deterministic_algorithms():
    # cuBLAS raises there unless CUBLAS_WORKSPACE_CONFIG is set; the Triton kernels need nothing
    topo = full_layer().topology.tensors()
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert not full.applies(torch.device("cuda"), topo)
        assert full.applies(CPU, topo)
    finally:
        torch.use_deterministic_algorithms(before)
    assert full.applies(torch.device("cuda"), topo)


def test_resolve_picks_it_unless_a_backend_is_forced():
    topo = full_layer().topology.tensors()
    assert backends.resolve(CPU, topo) is full
    assert backends.resolve(CPU) is backends.get_backend("cpu")  # no topology given: the device's backend
    for name in ("reference", "cpu"):
        with snack.use_backend(name):
            assert backends.resolve(CPU, topo) is backends.get_backend(name)


@pytest.mark.parametrize("full_topology", [True, False])
def test_a_training_step_runs_no_sparse_kernel_on_a_full_layer(monkeypatch, full_topology):
    calls = []
    native = backends.get_backend("cpu")
    for op in ("spmm", "spmm_t", "sddmm", "spmm_backward"):
        kernel = getattr(native, op)
        monkeypatch.setattr(native, op, lambda *args, kernel=kernel, op=op, **kwargs: calls.append(op) or kernel(*args, **kwargs))
    layer = make_layer(7, 5, 0.0 if full_topology else 0.5, dtype=torch.float32)
    x = torch.randn(3, 5, requires_grad=True)
    layer(x).sum().backward()
    with torch.no_grad():
        layer(x)
    assert calls == ([] if full_topology else ["spmm", "spmm_backward", "spmm"])


def _step(layer: snack.SparseLinear, x: torch.Tensor, dy: torch.Tensor, **grad_kwargs):
    x = x.detach().requires_grad_()
    y = layer(x)
    grads = torch.autograd.grad(y, (x, layer.values, layer.bias), dy, **grad_kwargs)
    return (y, *grads)


@pytest.mark.parametrize("batch", [0, 1, 6])
@pytest.mark.parametrize("create_graph", [False, True], ids=["eager", "create_graph"])
def test_every_gradient_matches_the_sparse_kernels(batch, create_graph):
    layer = full_layer()
    x, dy = torch.randn(batch, 5, dtype=torch.float64), torch.randn(batch, 7, dtype=torch.float64)
    got = _step(layer, x, dy, create_graph=create_graph)
    for name in ("reference", "cpu"):
        with snack.use_backend(name):
            expected = _step(layer, x, dy)
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), got[0])
    # and as nn.Linear with the same weight computes them
    linear = nn.Linear(5, 7, dtype=torch.float64)
    with torch.no_grad():
        linear.weight.copy_(layer.to_dense())
        linear.bias.copy_(layer.bias)
    x_leaf = x.clone().requires_grad_()
    y = linear(x_leaf)
    expected = (y, *torch.autograd.grad(y, (x_leaf, linear.weight, linear.bias), dy))
    for g, e in zip(got, (expected[0], expected[1], expected[2].reshape(-1), expected[3]), strict=True):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


def test_gradcheck_and_gradgradcheck_through_the_ops():
    layer = full_layer(4, 3)
    topo = layer.topology
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    values = layer.values.detach().clone().requires_grad_()
    for op, inputs in (
        (snack.ops.spmm, (x, values)),
        (snack.ops.spmm_t, (torch.randn(2, 4, dtype=torch.float64, requires_grad=True), values)),
        (snack.ops.sddmm, (torch.randn(2, 4, dtype=torch.float64, requires_grad=True), x)),
    ):
        assert torch.autograd.gradcheck(lambda a, b, op=op: op(a, b, topo), inputs)
        assert torch.autograd.gradgradcheck(lambda a, b, op=op: op(a, b, topo), inputs)


def test_per_sample_gradients_through_torch_func():
    layer = full_layer()
    x, dy = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 7, dtype=torch.float64)
    params = {"values": layer.values.detach(), "bias": layer.bias.detach()}

    def loss(params, x, dy):
        return (torch.func.functional_call(layer, params, (x,)) * dy).sum()

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, dy)
    for i in range(4):
        with snack.use_backend("reference"):
            expected = torch.func.grad(loss)(params, x[i], dy[i])
        torch.testing.assert_close(per_sample["values"][i], expected["values"])
        torch.testing.assert_close(per_sample["bias"][i], expected["bias"])


def test_three_dimensional_input_and_autocast():
    layer = full_layer(dtype=torch.float32)
    x = torch.randn(2, 3, 5)
    with snack.use_backend("cpu"):
        expected = layer(x)
    torch.testing.assert_close(layer(x), expected)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), expected, rtol=2e-2, atol=2e-2)
