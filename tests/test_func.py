"""torch.func transforms and forward-mode AD through the sparse layers and ops (snack.func),
against eager autograd and dense math on the masked weight, in float64."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fw
from torch import nn
from torch.func import functional_call, grad, jacrev, jvp, vmap

import snack
from snack import func
from snack.topology import Topology, random_coo

DTYPE = torch.float64


def _model() -> nn.Module:
    torch.manual_seed(0)
    first = snack.SparseLinear(6, 5, sparsity=0.5, dtype=DTYPE)
    return nn.Sequential(first, nn.Tanh(), snack.SparseLinear(5, 3, sparsity=0.4, dtype=DTYPE))


def _data(n: int = 8):
    generator = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=generator, dtype=DTYPE), torch.randint(0, 3, (n,), generator=generator)


def _loss_of(model: nn.Module):
    buffers = dict(model.named_buffers())

    def loss(params: dict, x, y):
        return nn.functional.cross_entropy(functional_call(model, (params, buffers), (x,)), y)

    return loss


def _params(model: nn.Module) -> dict:
    return {name: p.detach() for name, p in model.named_parameters()}


def test_grad_matches_eager_backward():
    model, (x, y) = _model(), _data()
    got = grad(_loss_of(model))(_params(model), x, y)
    nn.functional.cross_entropy(model(x), y).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=0, atol=1e-12)


def test_per_sample_gradients_with_vmap_match_one_backward_per_example():
    """The DP-SGD pattern: ``vmap(grad(loss))`` over examples."""
    model, (x, y) = _model(), _data()
    loss = _loss_of(model)
    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(_params(model), x[:, None], y[:, None])
    for i in range(len(y)):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        for name, p in model.named_parameters():
            assert per_sample[name].shape == (len(y), *p.shape)
            torch.testing.assert_close(per_sample[name][i], p.grad, rtol=0, atol=1e-12)


def _dense_values_function(layer: snack.SparseLinear, x: torch.Tensor):
    """``values -> x · Wᵀ`` with ``W`` built densely from ``values``: the oracle."""
    index = (layer.row.long(), layer.col.long())

    def forward(values):
        weight = torch.zeros(layer.out_features, layer.in_features, dtype=DTYPE).index_put(index, values)
        return torch.tanh(x @ weight.T).square().sum()

    return forward


def test_second_derivatives_match_dense_math():
    """The Hessian in ``values`` (``jacrev(grad)``): backward of backward, all sparse."""
    layer, (x, _) = _model()[0], _data()
    buffers = dict(layer.named_buffers())

    no_bias = torch.zeros(5, dtype=DTYPE)

    def sparse(values):
        return torch.tanh(functional_call(layer, ({"values": values, "bias": no_bias}, buffers), (x,))).square().sum()

    values = layer.values.detach()
    hessian = jacrev(grad(sparse))(values)
    expected = torch.autograd.functional.hessian(_dense_values_function(layer, x), values)
    torch.testing.assert_close(hessian, expected, rtol=1e-10, atol=1e-10)


def test_vmap_over_an_ensemble_of_weights_on_one_topology():
    layer, (x, _) = _model()[0], _data()
    buffers = dict(layer.named_buffers())
    ensemble = torch.randn(4, layer.nnz, dtype=DTYPE, generator=torch.Generator().manual_seed(2))
    bias = layer.bias.detach()

    def run(values):
        return functional_call(layer, ({"values": values, "bias": bias}, buffers), (x,))

    got = vmap(run)(ensemble)
    for member, values in zip(got, ensemble):
        dense = torch.zeros(5, 6, dtype=DTYPE).index_put((layer.row.long(), layer.col.long()), values)
        torch.testing.assert_close(member, x @ dense.T + bias, rtol=0, atol=1e-12)


def test_jvp_and_forward_mode_ad_match_dense_math():
    layer, (x, _) = _model()[0], _data()
    dense = layer.to_dense().detach()
    x_tangent = torch.randn_like(x)
    values_tangent = torch.randn(layer.nnz, dtype=DTYPE)
    tangent_weight = torch.zeros_like(dense).index_put((layer.row.long(), layer.col.long()), values_tangent)
    buffers = dict(layer.named_buffers())

    def run(x, values):
        return functional_call(layer, ({"values": values, "bias": layer.bias.detach()}, buffers), (x,))

    _, got = jvp(run, (x, layer.values.detach()), (x_tangent, values_tangent))
    torch.testing.assert_close(got, x_tangent @ dense.T + x @ tangent_weight.T, rtol=0, atol=1e-12)
    # dual tensors on the layer itself, frozen or not (a frozen layer used to drop the tangent)
    for trainable in (True, False):
        layer.requires_grad_(trainable)
        with fw.dual_level():
            tangent = fw.unpack_dual(layer(fw.make_dual(x, x_tangent))).tangent
        torch.testing.assert_close(tangent, x_tangent @ dense.T, rtol=0, atol=1e-12)


@pytest.mark.parametrize("op", ["spmm", "spmm_t", "sddmm"])
def test_the_public_ops_under_vmap_match_a_loop(op):
    generator = torch.Generator().manual_seed(3)
    topology = Topology(*random_coo(5, 7, 0.5, generator=generator), (5, 7))
    values = torch.randn(topology.nnz, dtype=DTYPE, generator=generator)
    x = torch.randn(4, 3, 7, dtype=DTYPE, generator=generator)
    dy = torch.randn(4, 3, 5, dtype=DTYPE, generator=generator)
    first, second, dims = {"spmm": (x, values, (0, None)), "spmm_t": (dy, values, (0, None)),
                           "sddmm": (dy, x, (0, 0))}[op]
    function = getattr(snack.ops, op)
    got = vmap(lambda a, b: function(a, b, topology), in_dims=dims)(first, second)
    expected = torch.stack([function(a, second if dims[1] is None else b, topology)
                            for a, b in zip(first, second if dims[1] == 0 else [second] * 4)])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("function", [func.Spmm, func.SpmmT, func.Sddmm])
def test_the_functions_pass_gradcheck_and_gradgradcheck(function):
    generator = torch.Generator().manual_seed(4)
    topology = Topology(*random_coo(5, 7, 0.5, generator=generator), (5, 7)).tensors()
    x = torch.randn(3, 7, dtype=DTYPE, generator=generator)
    dy = torch.randn(3, 5, dtype=DTYPE, generator=generator)
    values = torch.randn(topology.row.numel(), dtype=DTYPE, generator=generator)
    a, b = {func.Spmm: (x, values), func.SpmmT: (dy, values), func.Sddmm: (dy, x)}[function]
    a, b = a.requires_grad_(), b.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: function.apply(a, b, topology), (a, b))
    assert torch.autograd.gradgradcheck(lambda a, b: function.apply(a, b, topology), (a, b))


def test_outside_transforms_the_layer_keeps_its_fast_path(monkeypatch):
    """The Functions cost an autograd.Function with setup_context (~40 µs per call more)."""
    monkeypatch.setattr(func.Spmm, "apply", lambda *args: pytest.fail("the torch.func path ran"))
    layer, (x, _) = _model()[0], _data()
    layer(x).sum().backward()
    assert not func.transforms_active()


def test_a_topology_first_built_inside_a_transform_serves_later_ones():
    """Its cached index tensors used to be wrapped for the transform that built them, and a
    later nested transform failed an internal PyTorch assert."""
    layer, (x, _) = _model()[0], _data()
    grad(lambda x: layer(x).sum())(x)  # a fresh layer: its topology is built inside grad
    assert not any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in layer.topology.tensors())
    hessian = torch.func.hessian(lambda x: torch.tanh(layer(x)).sum())(x[:2])
    assert hessian.shape == (2, 6, 2, 6)


def test_vmap_over_empty_batches():
    layer = _model()[0]
    assert vmap(layer)(torch.randn(4, 0, 6, dtype=DTYPE)).shape == (4, 0, 5)
    assert vmap(layer)(torch.randn(0, 3, 6, dtype=DTYPE)).shape == (0, 3, 5)
    # one sample of shape (in,) each, none of them: reshape(-1, in) could not infer the batch
    assert vmap(layer)(torch.randn(0, 6, dtype=DTYPE)).shape == (0, 5)


def test_per_group_gradients_with_several_rows_each():
    """vmap(grad) over groups of 3 examples: the SDDMM of several rows per vmapped pair."""
    model, (x, y) = _model(), _data(12)
    per_group = vmap(grad(_loss_of(model)), in_dims=(None, 0, 0))(_params(model), x.view(4, 3, 6), y.view(4, 3))
    for group in range(4):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[3 * group : 3 * group + 3]), y[3 * group : 3 * group + 3]).backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(per_group[name][group], p.grad, rtol=0, atol=1e-12)


def test_vmapped_buffers_get_a_clear_error():
    """torch.func.stack_module_state stacks the buffers too; members must share one topology."""
    members = [_model()[0] for _ in range(3)]
    params, buffers = torch.func.stack_module_state(members)
    x = _data()[0]

    def run(params, buffers):
        return functional_call(members[0], (params, buffers), (x,))

    with pytest.raises(ValueError, match="vmap over a layer's topology"):
        vmap(run)(params, buffers)
    assert vmap(run, in_dims=(0, None))(params, dict(members[0].named_buffers())).shape == (3, 8, 5)


def test_a_backward_after_the_use_backend_block_runs_on_its_backend(monkeypatch):
    calls = []
    reference = snack.backends.get_backend("reference")
    monkeypatch.setattr(reference, "sddmm", lambda *args, real=reference.sddmm: calls.append(1) or real(*args))
    layer, (x, _) = _model()[0], _data()
    buffers = dict(layer.named_buffers())
    with snack.use_backend("reference"):
        _, vjp_fn = torch.func.vjp(lambda v: functional_call(layer, ({"values": v, "bias": layer.bias}, buffers), (x,)),
                                   layer.values.detach())
    vjp_fn(torch.ones(8, 5, dtype=DTYPE))
    assert calls == [1]


def test_a_non_tensor_argument_inside_a_transform_is_a_type_error():
    layer, (x, _) = _model()[0], _data()
    with pytest.raises(TypeError, match="snack.ops.spmm: x must be a Tensor, got list"):
        grad(lambda v: snack.ops.spmm(x.tolist(), v, layer.topology).sum())(layer.values.detach())


def _case():
    generator = torch.Generator().manual_seed(3)
    topology = Topology(*random_coo(5, 7, 0.5, generator=generator), (5, 7))
    values = torch.randn(topology.nnz, dtype=DTYPE, generator=generator)
    return topology, values, generator


def test_vmap_over_a_non_leading_dimension_of_the_dense_input():
    """vmap(in_dims=1) over a (B, V, in) input equals the loop over V (the vmap rule moves the
    vmapped dimension of x/dy first)."""
    topology, values, generator = _case()
    x = torch.randn(3, 4, 7, dtype=DTYPE, generator=generator)  # (B, V, in), vmapped dim 1
    dy = torch.randn(3, 4, 5, dtype=DTYPE, generator=generator)
    for op, dense in (("spmm", x), ("spmm_t", dy)):
        function = getattr(snack.ops, op)
        got = vmap(lambda a: function(a, values, topology), in_dims=1)(dense)
        expected = torch.stack([function(dense[:, v], values, topology) for v in range(dense.shape[1])])
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_vmap_over_a_non_leading_dimension_of_values():
    """An ensemble stored as (nnz, V) and vmapped with in_dims=1 equals the loop over its columns."""
    topology, _, generator = _case()
    ensemble = torch.randn(topology.nnz, 4, dtype=DTYPE, generator=generator)  # (nnz, V)
    x = torch.randn(3, 7, dtype=DTYPE, generator=generator)
    got = vmap(lambda v: snack.ops.spmm(x, v, topology), in_dims=1)(ensemble)
    expected = torch.stack([snack.ops.spmm(x, ensemble[:, v], topology) for v in range(4)])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
