"""SparseConv1d against nn.Conv1d on its densified weight: forward and every gradient (native
kernels and im2col), constructors, conversion, RigL, errors."""

from __future__ import annotations

import contextlib
import copy
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import snack
from snack.dst.capture import GradientCapture
from tests.test_conv import PATHS, _check_against_dense, _dense_twin, _run

GEOMETRIES = [
    dict(kernel_size=3),
    dict(kernel_size=3, padding=1),
    dict(kernel_size=4, padding="same"),  # an odd total: the extra column last, as nn.Conv1d
    dict(kernel_size=5, stride=2, padding=2),
    dict(kernel_size=3, stride=3, dilation=2, padding=(1,)),
    dict(kernel_size=1, stride=2),
    dict(kernel_size=3, padding=2, padding_mode="reflect"),
    dict(kernel_size=3, padding=1, padding_mode="circular", bias=False),
    dict(kernel_size=2, padding="valid", padding_mode="replicate"),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
def test_matches_dense_conv1d_forward_and_gradients(geometry, path):
    layer = snack.SparseConv1d(3, 5, sparsity=0.6, dtype=torch.float64, **geometry)
    _check_against_dense(layer, torch.randn(4, 3, 11, dtype=torch.float64), path)


@pytest.mark.parametrize("path", PATHS)
def test_batch_one_unbatched_odd_lengths_and_no_connections(path):
    layer = snack.SparseConv1d(2, 3, 3, padding=1, sparsity=0.5, dtype=torch.float64)
    _check_against_dense(layer, torch.randn(1, 2, 7, dtype=torch.float64), path)
    x = torch.randn(2, 13, dtype=torch.float64)
    assert _run(layer, x, path).shape == (3, 13)
    torch.testing.assert_close(_run(layer, x, path), _dense_twin(layer)(x))
    empty = snack.SparseConv1d.from_coo(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long),
                                        torch.empty(0, dtype=torch.float64), (3, 2, 3),
                                        bias=torch.randn(3, dtype=torch.float64))  # fmt: skip
    assert empty.nnz == 0
    _check_against_dense(empty, torch.randn(2, 2, 5, dtype=torch.float64), path)


@pytest.mark.parametrize("path", PATHS)
def test_empty_batch(path):
    layer = snack.SparseConv1d(2, 3, 3, padding=1)
    x = torch.randn(0, 2, 5, requires_grad=True)
    y = _run(layer, x, path)
    assert y.shape == (0, 3, 5)
    y.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(layer.values.grad, torch.zeros_like(layer.values))


@pytest.mark.parametrize("path", PATHS)
def test_gradcheck_and_gradgradcheck(path):
    layer = snack.SparseConv1d(2, 3, 3, stride=2, padding=1, sparsity=0.5, dtype=torch.float64)

    def conv(x, values, bias):
        with snack.use_backend("reference") if path == "reference" else contextlib.nullcontext():
            return torch.func.functional_call(layer, {"values": values, "bias": bias}, (x,))

    x = torch.randn(2, 2, 7, dtype=torch.float64, requires_grad=True)
    inputs = (x, layer.values.detach().clone().requires_grad_(), layer.bias.detach().clone().requires_grad_())
    assert torch.autograd.gradcheck(conv, inputs)
    assert torch.autograd.gradgradcheck(conv, inputs)


def test_attributes_and_repr_are_conv1d_ones():
    layer = snack.SparseConv1d(4, 6, 5, stride=2, padding=2, dilation=1, sparsity=0.75)
    dense = nn.Conv1d(4, 6, 5, stride=2, padding=2)
    for name in ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups",
                 "padding_mode"):  # fmt: skip
        assert getattr(layer, name) == getattr(dense, name), name
    assert layer.in_features == 20 and layer.to_dense().shape == (6, 4, 5)
    assert repr(layer).startswith("SparseConv1d(4, 6, kernel_size=(5,), stride=(2,), padding=(2,), nnz=")
    with pytest.raises(AttributeError, match=r"SparseConv1d has no dense weight.*\(out_channels, in_channels / groups, "
                                             r"kernel_size\) weight.*nn\.Conv1d"):  # fmt: skip
        layer.weight


def test_from_dense_from_coo_and_round_trips():
    conv = nn.Conv1d(3, 4, 3, stride=2, padding=1, padding_mode="reflect")
    layer = snack.SparseConv1d.from_dense(conv, sparsity=0.5)
    assert (layer.stride, layer.padding, layer.padding_mode) == ((2,), (1,), "reflect")
    assert layer.nnz == 18
    kept = layer.to_dense().detach()
    assert torch.equal(kept[kept != 0], conv.weight.detach()[kept != 0])
    assert (conv.weight.detach().abs()[kept == 0].max() <= kept.abs()[kept != 0].min())
    from_weight = snack.SparseConv1d.from_dense(conv.weight.detach(), bias=conv.bias.detach(), stride=2, padding=1,
                                                padding_mode="reflect")  # fmt: skip
    x = torch.randn(2, 3, 9)
    torch.testing.assert_close(from_weight(x), conv(x))
    coo = snack.SparseConv1d.from_coo(layer.row, layer.col, layer.values.detach(), (4, 3, 3), bias=layer.bias.detach(),
                                      stride=2, padding=1, padding_mode="reflect")  # fmt: skip
    torch.testing.assert_close(coo(x), layer(x))
    for copied in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert isinstance(copied, snack.SparseConv1d) and torch.equal(copied(x), layer(x))
    loaded = snack.SparseConv1d(3, 4, 3, stride=2, padding=1, padding_mode="reflect", sparsity=0.9)
    loaded.load_state_dict(layer.state_dict())
    torch.testing.assert_close(loaded(x), layer(x))


def test_sparsify_and_densify_convert_conv1d():
    net = nn.Sequential(nn.Conv1d(3, 8, 5, padding="same"), nn.ReLU(), nn.Conv1d(8, 8, 3, groups=2),
                        nn.Conv1d(8, 4, 3, stride=2), nn.Flatten(), nn.Linear(4 * 4, 2))  # fmt: skip
    x = torch.randn(2, 3, 12)
    model = snack.sparsify(net, 0.7, distribution="erk")
    assert [type(m).__name__ for m in model] == ["SparseConv1d", "ReLU", "SparseConv1d", "SparseConv1d", "Flatten",
                                                 "SparseLinear"]  # fmt: skip
    assert model[2].groups == 2 and model[2].to_dense().shape == (8, 4, 3)
    total = 8 * 15 + 8 * 12 + 4 * 24 + 2 * 16
    assert abs(sum(m.nnz for m in model if isinstance(m, snack.SparseLinear)) - 0.3 * total) <= 4
    y = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dense = snack.densify(model)
    assert [type(m).__name__ for m in dense] == ["Conv1d", "ReLU", "Conv1d", "Conv1d", "Flatten", "Linear"]
    assert dense[0].padding == "same" and dense[3].stride == (2,)
    torch.testing.assert_close(dense(x), y, atol=1e-5, rtol=1e-5)


def test_erk_weighs_a_1d_kernel_by_its_sides():
    densities = snack.distributions.erk_densities({"conv": (64, 32, 9), "linear": (10, 512)}, 0.2)
    ratio = densities["conv"] / densities["linear"]
    expected = ((64 + 32 + 9) / (64 * 32 * 9)) / ((10 + 512) / (10 * 512))
    assert abs(ratio - expected) < 1e-9


@pytest.mark.parametrize("path", PATHS)
def test_rigl_records_and_grows_from_the_dense_weight_gradient(path):
    layer = snack.SparseConv1d(3, 4, 3, stride=2, padding=1, sparsity=0.6, dtype=torch.float64)
    capture = GradientCapture([layer])
    capture.arm()
    x = torch.randn(3, 3, 10, dtype=torch.float64)
    _run(layer, x, path).square().sum().backward()
    x_kept, dy_rows = capture.batch(0)
    capture.disarm()
    assert x_kept.shape == (3, 3, 1, 12)  # the padded input as a 2-D convolution's
    dense = _dense_twin(layer)
    dense(x).square().sum().backward()
    gradient = dense.weight.grad.reshape(4, -1)
    torch.testing.assert_close(dy_rows.T @ layer._rows_of_record(x_kept), gradient)
    inactive = gradient.abs().flatten()
    inactive[snack.dst.prune_grow.linear_index(layer.topology)] = -1
    grown = snack.dst.gradient_grow(x_kept, dy_rows, layer.topology, 5, convolution=layer)
    assert torch.equal(grown, inactive.topk(5).indices.sort().values)


def test_rigl_trains_a_small_1d_cnn():
    torch.manual_seed(0)
    model = nn.Sequential(snack.SparseConv1d(1, 8, 5, padding=2, sparsity=0.7), nn.ReLU(), nn.AdaptiveAvgPool1d(4),
                          nn.Flatten(), snack.SparseLinear(32, 2, sparsity=0.5))  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    dst = snack.dst.RigL(model, optimizer, update_every=2, total_steps=40, schedule="constant")
    x = torch.randn(32, 1, 16)
    target = (x[:, 0, :8].sum(1) > x[:, 0, 8:].sum(1)).long()  # which half holds more
    before = (model[0].row.clone(), model[0].col.clone())
    losses = []
    for _ in range(40):
        loss = F.cross_entropy(model(x), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        dst.step()
        losses.append(loss.item())
    assert not (torch.equal(before[0], model[0].row) and torch.equal(before[1], model[0].col))
    assert losses[-1] < 0.5 * losses[0]


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match=r"SparseConv1d: kernel_size must be a positive int or a tuple of 1"):
        snack.SparseConv1d(2, 3, (3, 3))
    with pytest.raises(ValueError, match="SparseConv1d: groups must divide in_channels and out_channels"):
        snack.SparseConv1d(2, 4, 3, groups=4)
    with pytest.raises(ValueError, match=r"padding='same' needs stride 1 \(as nn.Conv1d\)"):
        snack.SparseConv1d(2, 3, 3, stride=2, padding="same")
    with pytest.raises(ValueError, match=r"SparseConv1d: in_channels and out_channels must be positive"):
        snack.SparseConv1d(0, 3, 3)
    layer = snack.SparseConv1d(2, 3, 3, sparsity=0.5)
    with pytest.raises(ValueError, match=r"input must have shape \(N, 2, L\) or \(2, L\), got \(1, 2, 5, 5\)"):
        layer(torch.randn(1, 2, 5, 5))
    with pytest.raises(ValueError, match=r"input must have shape .* got \(1, 3, 5\)"):
        layer(torch.randn(1, 3, 5))
    with pytest.raises(ValueError, match=r"padded to length 2, is shorter than the dilated kernel \(3\)"):
        layer(torch.randn(1, 2, 2))
    with pytest.raises(ValueError, match=r"a weight must be \(out_channels, in_channels / groups, kernel_size\)"):
        snack.SparseConv1d.from_dense(torch.randn(3, 2, 3, 3))
    with pytest.raises(TypeError, match="conv_or_weight must be an nn.Conv1d or a Tensor"):
        snack.SparseConv1d.from_dense(nn.Conv2d(2, 3, 3))
    with pytest.raises(ValueError, match=r"shape must be \(out_channels, in_channels / groups, kernel_size\)"):
        snack.SparseConv1d.from_coo(torch.tensor([0]), torch.tensor([0]), torch.ones(1), (3, 2, 3, 3))


def test_tracing_compiling_exporting_torch_func_and_autocast():
    model = nn.Sequential(snack.SparseConv1d(3, 4, 3, padding=1, sparsity=0.5), nn.ReLU())
    x = torch.randn(2, 3, 9)
    expected = model(x)
    torch.testing.assert_close(torch.fx.symbolic_trace(model)(x), expected)
    torch.testing.assert_close(torch.fx.symbolic_trace(model[0])(x), model[0](x))
    torch.testing.assert_close(torch.jit.trace(model, x)(x), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(torch.compile(model, fullgraph=True, backend="eager")(x), expected,
                               atol=1e-6, rtol=1e-5)  # fmt: skip
    exported = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},)).module()
    other = torch.randn(5, 3, 9)
    torch.testing.assert_close(exported(other), model(other), atol=1e-6, rtol=1e-5)
    layer = model[0]  # per-sample gradients by torch.func
    params = {"values": layer.values.detach(), "bias": layer.bias.detach()}

    def loss(params, sample):
        return torch.func.functional_call(layer, params, (sample.unsqueeze(0),)).square().sum()

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    for i in range(2):
        layer.zero_grad()
        layer(x[i : i + 1]).square().sum().backward()
        torch.testing.assert_close(per_sample["values"][i], layer.values.grad, atol=1e-5, rtol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(x)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), expected, atol=0.1, rtol=0.05)
