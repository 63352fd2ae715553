"""SparseConv3d against nn.Conv3d on the same (densified) weight: forward and every gradient on the
CPU's 2-D direct kernels (depth and height laid end to end), the im2col path and the reference
ops; plus conversion, serialisation, RigL's records and scores, tracing and the truly-sparse
guarantee."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import snack
from snack.dst.capture import GradientCapture
from snack.dst.prune_grow import gradient_grow, linear_index
from snack.topology import BLOCK_ELEMENTS
from tests.test_conv import (
    _check_against_dense, _check_results_do_not_depend_on_the_thread_count, _check_rigl_rewires_the_convolutions,
    _dense_twin, _direct_calls, _gradcheck_and_gradgradcheck, _on_path, _run,
)
from tests.test_truly_sparse import LargestTensorMode

GEOMETRIES = [
    dict(kernel_size=3),
    dict(kernel_size=3, padding=1),
    dict(kernel_size=3, stride=2, padding=1),  # half the flattened rows dropped
    dict(kernel_size=(2, 3, 1), stride=(2, 1, 3), padding=(1, 0, 2), dilation=(1, 2, 1)),
    dict(kernel_size=(3, 1, 2), stride=(1, 2, 1), padding=(0, 1, 1)),  # a plane of Hp + 1 rows (odd Hp, stride 2)
    dict(kernel_size=3, padding="same", dilation=2),
    dict(kernel_size=(2, 2, 4), padding="same"),  # even kernel: asymmetric padding
    dict(kernel_size=3, stride=2, padding=1, padding_mode="reflect"),
    dict(kernel_size=3, padding=2, padding_mode="circular", dilation=(2, 1, 2)),
    dict(kernel_size=1, padding=1, padding_mode="replicate"),
    dict(kernel_size=1, stride=2),  # stride phases no tap reads
    dict(kernel_size=(1, 3, 3), padding=(0, 1, 1)),  # a 2-D kernel per plane
    dict(kernel_size=(3, 1, 1), stride=(3, 1, 1)),  # across planes only
    dict(kernel_size=3, padding=1, groups=2),
    dict(kernel_size=3, padding=1, groups=4),  # depthwise: the depthwise kernels
]
# the CPU's own choice; im2col through the reference ops; the direct kernels forced
PATHS = ["native", "reference", "direct"]


def _layer(in_channels=4, out_channels=8, sparsity=0.6, dtype=torch.float64, **geometry) -> snack.SparseConv3d:
    return snack.SparseConv3d(in_channels, out_channels, sparsity=sparsity, dtype=dtype, **geometry)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
def test_matches_dense_conv_forward_and_gradients(geometry, path):
    torch.manual_seed(0)
    layer = _layer(**geometry)
    _check_against_dense(layer, torch.randn(2, 4, 6, 7, 5, dtype=torch.float64), path)


@given(
    channels=st.sampled_from([(1, 1, 1), (3, 5, 1), (4, 2, 2), (3, 6, 3), (4, 8, 4)]),
    kernel=st.tuples(*[st.integers(1, 3)] * 3),
    stride=st.tuples(*[st.integers(1, 3)] * 3),
    dilation=st.tuples(*[st.integers(1, 2)] * 3),
    padding=st.tuples(*[st.integers(0, 2)] * 3),
    size=st.tuples(*[st.integers(1, 8)] * 3),
    batch=st.integers(1, 3),
    sparsity=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=30, deadline=None)
def test_random_geometries_on_the_direct_kernels(channels, kernel, stride, dilation, padding, size, batch, sparsity,
                                                 seed):  # fmt: skip
    spans = [d * (k - 1) + 1 for k, d in zip(kernel, dilation)]
    if any(s + 2 * p < span for s, p, span in zip(size, padding, spans)):
        return  # smaller than the kernel: the layer refuses it (test_bad_input_raises_clear_errors)
    torch.manual_seed(seed)
    in_channels, out_channels, groups = channels
    sparsity = min(sparsity, 1 - 1 / (out_channels * in_channels // groups * kernel[0] * kernel[1] * kernel[2]))
    layer = snack.SparseConv3d(in_channels, out_channels, kernel, stride, padding, dilation, groups,
                               sparsity=sparsity, dtype=torch.float64)  # fmt: skip
    _check_against_dense(layer, torch.randn(batch, in_channels, *size, dtype=torch.float64), "direct")


@pytest.mark.parametrize("path", PATHS)
def test_batch_one_unbatched_and_odd_sizes(path):
    layer = _layer(kernel_size=(3, 2, 3), stride=(2, 1, 2), padding=1)
    _check_against_dense(layer, torch.randn(1, 4, 5, 3, 7, dtype=torch.float64), path)
    unbatched = torch.randn(4, 3, 5, 4, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(_run(layer, unbatched, path), _dense_twin(layer)(unbatched))


@pytest.mark.parametrize("path", PATHS)
def test_empty_output_channels_no_connections_and_an_empty_batch(path):
    layer = _layer(kernel_size=3, padding=1)
    keep = layer.row != 2  # output channel 2 reads nothing
    layer.set_topology(layer.row[keep], layer.col[keep])
    _check_against_dense(layer, torch.randn(2, 4, 4, 5, 3, dtype=torch.float64), path)
    empty = snack.SparseConv3d.from_coo(torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                                        torch.zeros(0, dtype=torch.float64), (8, 4, 3, 3, 3), padding=1)  # fmt: skip
    _check_against_dense(empty, torch.randn(2, 4, 4, 5, 3, dtype=torch.float64), path)
    x = torch.randn(0, 4, 4, 5, 3, dtype=torch.float64, requires_grad=True)
    y = _run(layer, x, path)
    assert y.shape == (0, 8, 4, 5, 3)
    y.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(layer.values.grad, torch.zeros_like(layer.values))


@pytest.mark.parametrize("frozen", ["values", "bias", "input"])
@pytest.mark.parametrize("path", PATHS)
def test_gradients_of_whatever_requires_them(frozen, path):
    layer = _layer(kernel_size=3, stride=(1, 2, 1), padding=1)
    x = torch.randn(2, 4, 5, 5, 4, dtype=torch.float64, requires_grad=frozen != "input")
    getattr(layer, frozen if frozen != "input" else "values").requires_grad_(frozen == "input")
    if frozen != "input":
        getattr(layer, frozen).requires_grad_(False)
    y = _run(layer, x, path)
    y.square().sum().backward()
    dense = _dense_twin(layer)
    x_dense = x.detach().clone().requires_grad_()
    dense(x_dense).square().sum().backward()
    if frozen != "input":
        torch.testing.assert_close(x.grad, x_dense.grad)
    if frozen != "values":
        flat = dense.weight.grad.reshape(8, -1)[layer.row.long(), layer.col.long()]
        torch.testing.assert_close(layer.values.grad, flat)
    if frozen != "bias":
        torch.testing.assert_close(layer.bias.grad, dense.bias.grad)


@pytest.mark.parametrize("geometry", [dict(kernel_size=2, padding=1), dict(kernel_size=(2, 1, 2), stride=2),
                                      dict(kernel_size=2, groups=2, padding=(0, 1, 0))], ids=str)  # fmt: skip
@pytest.mark.parametrize("path", PATHS)
def test_gradcheck_and_gradgradcheck(geometry, path):
    layer = _layer(2, 2, **geometry)
    _gradcheck_and_gradgradcheck(layer, torch.randn(2, 2, 3, 4, 3, dtype=torch.float64), path)


def test_results_do_not_depend_on_the_thread_count():
    _check_results_do_not_depend_on_the_thread_count(_layer(kernel_size=3, padding=1, dtype=torch.float32),
                                                     torch.randn(5, 4, 6, 6, 6))  # fmt: skip


@pytest.mark.parametrize("layout", ["channels_last", "sliced", "offset"])
@pytest.mark.parametrize("path", PATHS)
def test_inputs_of_any_memory_layout(layout, path):
    # the layout copies each stride phase through as_strided views of the input's storage
    layer = _layer(kernel_size=3, stride=2, padding=1)
    base = torch.randn(3, 4, 7, 6, 5, dtype=torch.float64)
    if layout == "channels_last":
        x = base.to(memory_format=torch.channels_last_3d)
    elif layout == "sliced":
        x = base[:, :, :, 1:]
    else:
        x = base[1:]  # contiguous, at an offset into its storage
    _check_against_dense(layer, x, path)


def test_direct_kernels_run_where_they_should(monkeypatch):
    calls = []
    original = snack.backends.cpu.conv.direct_conv2d

    def spy(*args, **kwargs):
        calls.append(kwargs["depthwise"])
        return original(*args, **kwargs)

    monkeypatch.setattr(snack.backends.cpu.conv, "direct_conv2d", spy)
    x = torch.randn(2, 4, 6, 6, 6)
    _layer(kernel_size=3, padding=1, sparsity=0.9, dtype=torch.float32)(x)
    _layer(4, 8, kernel_size=3, padding=1, groups=4, sparsity=0.5, dtype=torch.float32)(x)
    assert calls == [False, True]  # ungrouped, then the depthwise kernels
    with snack.use_backend("reference"):
        _layer(kernel_size=3, dtype=torch.float32)(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _layer(kernel_size=3, dtype=torch.float32)(x)
    full = _layer(kernel_size=3, sparsity=0.0, dtype=torch.float32)
    assert full.nnz == full.out_features * full.in_features
    _check_against_dense(full.double(), x.double(), "native")  # F.conv3d on the values
    assert calls == [False, True]


def test_rows_where_the_output_has_few_positions_for_the_connections(monkeypatch):
    calls = _direct_calls(monkeypatch)
    layer = _layer(16, 16, kernel_size=3, sparsity=0.5, dtype=torch.float32)
    layer(torch.randn(1, 16, 3, 3, 3))  # one output position, 1152 connections: rows
    assert calls == []
    layer(torch.randn(8, 16, 12, 12, 12))
    assert calls == [1]


def test_a_flattened_kernel_past_int32_falls_back_to_im2col(monkeypatch):
    calls = _direct_calls(monkeypatch)
    monkeypatch.setattr(snack.nn.plane, "_INT32_MAX", 100)  # (as a huge input's kernel would)
    layer = _layer(kernel_size=3, padding=1)
    _check_against_dense(layer, torch.randn(2, 4, 5, 6, 5, dtype=torch.float64), "direct")
    assert calls == [] and layer._flattened_cache is None


def test_the_flattened_kernel_is_built_once_per_topology_and_height():
    layer = _layer(kernel_size=3, padding=1, dtype=torch.float32)
    x = torch.randn(1, 4, 6, 6, 6)
    with snack.use_backend("cpu"):
        layer(x)
        kernel, order = layer._flattened_cache[2]
        assert order is None  # stride 1: the kernel's connections in the layer's order
        layer(x)
        assert layer._flattened_cache[2][0] is kernel
        layout = layer._layout_cache[1]
        layer(torch.randn(1, 4, 6, 9, 6))  # another height: another layout and kernel
        assert layer._flattened_cache[2][0] is not kernel and layer._layout_cache[1] is not layout
        assert any(t is layer._flattened_cache[2][0].col for t in layer.index_tensors())  # counted as index data
        layer.set_topology(layer.row[1:], layer.col[1:])
        _check_against_dense(layer.double(), x.double(), "direct")


@pytest.mark.parametrize("path", PATHS)
def test_backward_after_values_changed_in_place_raises(path):
    # at a depth stride the direct kernels take the values in another order (a copy)
    layer = _layer(kernel_size=3, stride=2, padding=1)
    y = _run(layer, torch.randn(2, 4, 5, 5, 5, dtype=torch.float64), path)
    if path == "direct":
        assert layer._flattened_cache[2][1] is not None
    with torch.no_grad():
        layer.values.clamp_(-0.1, 0.1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_from_dense_from_coo_and_to_dense():
    dense = nn.Conv3d(4, 6, (3, 2, 1), stride=2, padding=(1, 0, 0), groups=2, bias=False, padding_mode="reflect")
    layer = snack.SparseConv3d.from_dense(dense, sparsity=0.75)
    assert (layer.in_channels, layer.out_channels, layer.kernel_size, layer.stride, layer.padding, layer.groups,
            layer.padding_mode, layer.bias) == (4, 6, (3, 2, 1), (2, 2, 2), (1, 0, 0), 2, "reflect", None)  # fmt: skip
    assert layer.nnz == round(0.25 * dense.weight.numel())
    kept = layer.to_dense() != 0
    assert kept.shape == dense.weight.shape
    smallest_kept = dense.weight.detach().abs()[kept].min()
    assert (dense.weight.detach().abs()[~kept] <= smallest_kept).all()
    again = snack.SparseConv3d.from_coo(layer.row, layer.col, layer.values.detach(), tuple(dense.weight.shape),
                                        stride=2, padding=(1, 0, 0), groups=2, padding_mode="reflect")  # fmt: skip
    assert torch.equal(again.to_dense(), layer.to_dense())
    assert "kernel_size=(3, 2, 1)" in repr(layer) and "groups=2" in repr(layer)


def test_bad_input_raises_clear_errors():
    layer = _layer(kernel_size=3, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"input must have shape \(N, 4, D, H, W\) or \(4, D, H, W\), got \(2, 4, 5\)"):
        layer(torch.randn(2, 4, 5))
    with pytest.raises(ValueError, match=r"got \(2, 3, 5, 5, 5\)"):
        layer(torch.randn(2, 3, 5, 5, 5))
    with pytest.raises(ValueError, match=r"padded to \(5, 2, 5\), is smaller than the dilated kernel \(3, 3, 3\)"):
        layer(torch.randn(2, 4, 5, 2, 5))
    with pytest.raises(TypeError, match="expects a Tensor input"):
        layer([1.0])
    with pytest.raises(TypeError, match="input dtype torch.float64 does not match"):
        layer(torch.randn(1, 4, 3, 3, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="kernel_size must be a positive int or a tuple of 3 of them"):
        snack.SparseConv3d(4, 6, (3, 3))
    with pytest.raises(ValueError, match="padding='same' needs stride 1"):
        snack.SparseConv3d(4, 6, 3, stride=2, padding="same")
    with pytest.raises(ValueError, match="groups must divide"):
        snack.SparseConv3d(4, 6, 3, groups=4)
    with pytest.raises(ValueError, match=r"a weight must be \(out_channels, in_channels / groups, kd, kh, kw\)"):
        snack.SparseConv3d.from_dense(torch.randn(6, 4, 3, 3))
    with pytest.raises(AttributeError, match=r"builds the \(out_channels, in_channels / groups, kd, kh, kw\) weight"):
        layer.weight


def test_training_under_autocast_and_compiled_code_follow_the_im2col_path():
    model = nn.Sequential(snack.SparseConv3d(3, 4, 3, padding=1, sparsity=0.5), nn.ReLU())
    x = torch.randn(2, 3, 4, 5, 4)
    expected = model(x)
    torch.testing.assert_close(torch.fx.symbolic_trace(model)(x), expected)
    torch.testing.assert_close(torch.compile(model, fullgraph=True, backend="eager")(x), expected,
                               atol=1e-6, rtol=1e-5)  # fmt: skip
    torch.testing.assert_close(torch.jit.trace(model, x)(x), expected, atol=1e-6, rtol=1e-5)
    exported = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},)).module()
    other = torch.randn(5, 3, 4, 5, 4)
    torch.testing.assert_close(exported(other), model(other), atol=1e-6, rtol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(x)
        low.float().sum().backward()
    assert low.dtype == torch.bfloat16 and model[0].values.grad.dtype == torch.float32
    torch.testing.assert_close(low.float(), expected, atol=0.1, rtol=0.05)


def test_per_sample_gradients_by_torch_func():
    layer = _layer(2, 3, kernel_size=2, stride=(1, 2, 1), sparsity=0.5)
    params = {"values": layer.values.detach(), "bias": layer.bias.detach()}
    x = torch.randn(3, 2, 3, 4, 3, dtype=torch.float64)

    def loss(params, sample):
        return torch.func.functional_call(layer, params, (sample,)).square().sum()

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    for i in range(3):
        torch.testing.assert_close(per_sample["values"][i], torch.func.grad(loss)(params, x[i])["values"])


def test_state_dict_pickle_and_deepcopy_round_trip():
    layer = _layer(kernel_size=3, padding=1, dtype=torch.float32)
    x = torch.randn(1, 4, 5, 5, 5)
    expected = layer(x)  # (builds the flattened kernel: copies must not carry it)
    for other in (pickle.loads(pickle.dumps(layer)), copy.deepcopy(layer)):
        assert other._flattened_cache is None
        torch.testing.assert_close(other(x), expected)
    fresh = _layer(kernel_size=3, padding=1, sparsity=0.3, dtype=torch.float32)
    fresh.load_state_dict(layer.state_dict())
    torch.testing.assert_close(fresh(x), expected)


def test_sparsify_densify_and_erk():
    model = nn.Sequential(nn.Conv3d(2, 8, 3, padding=1), nn.ReLU(), nn.Conv3d(8, 8, (1, 3, 3)), nn.Flatten(),
                          nn.LazyLinear(3))  # fmt: skip
    x = torch.randn(2, 2, 4, 5, 5)
    model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left dense
        snack.sparsify(model, 0.8, distribution="erk")
    assert isinstance(model[0], snack.SparseConv3d) and isinstance(model[2], snack.SparseConv3d)
    # ERK weighs the kernel: (out + in + kd + kh + kw) / (out · in · kd · kh · kw)
    assert model[0].sparsity < model[2].sparsity
    sparse_out = model(x)
    snack.densify(model)
    assert type(model[0]) is nn.Conv3d and model[0].padding == (1, 1, 1)
    torch.testing.assert_close(model(x), sparse_out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("geometry", [dict(stride=2, padding=1), dict(dilation=(1, 2, 1), padding=(1, 2, 0),
                                                                     padding_mode="reflect", groups=2)], ids=str)
@pytest.mark.parametrize("path", PATHS)
def test_rigl_records_give_the_dense_weight_gradient(path, geometry):
    layer = _layer(4, 4, kernel_size=3, **geometry)
    capture = GradientCapture([layer])
    capture.arm()
    x = torch.randn(2, 4, 5, 6, 5, dtype=torch.float64)
    _run(layer, x, path).square().sum().backward()
    x_kept, dy_rows = capture.batch(0)
    capture.disarm()
    torch.testing.assert_close(x_kept, layer._padded(x))  # the padded input, not its im2col rows
    dense = _dense_twin(layer)
    dense(x).square().sum().backward()
    gradient = dense.weight.grad.reshape(4, -1)
    if layer.groups == 1:
        torch.testing.assert_close(dy_rows.T @ layer._rows_of_record(x_kept), gradient)
    inactive = gradient.abs().flatten()
    inactive[linear_index(layer.topology)] = -1
    expected = inactive.topk(12).indices.sort().values
    for block_elements in (BLOCK_ELEMENTS, layer.in_features):
        grown = gradient_grow(x_kept, dy_rows, layer.topology, 12, block_elements=block_elements, convolution=layer)
        assert torch.equal(grown, expected)
    rows = layer._rows_of_record(x_kept)  # scored from the rows (calls on several sizes): the same
    assert torch.equal(gradient_grow(rows, dy_rows, layer.topology, 12, convolution=layer), expected)
    with pytest.raises(ValueError, match=r"a 3-D one's \(N, C, Dp, Hp, Wp\)"):
        gradient_grow(x_kept[0], dy_rows, layer.topology, 12, convolution=layer)


def test_rigl_trains_a_small_3d_cnn():
    model = nn.Sequential(snack.SparseConv3d(1, 8, 3, padding=1, sparsity=0.8), nn.ReLU(inplace=True),
                          snack.SparseConv3d(8, 8, 3, stride=2, sparsity=0.8), nn.Flatten(),
                          snack.SparseLinear(8 * 8, 3, sparsity=0.5))  # fmt: skip
    _check_rigl_rewires_the_convolutions(model, torch.randn(8, 1, 6, 6, 6), "direct")


@pytest.mark.parametrize("path", ["reference", "autocast", "direct"])
def test_the_backward_keeps_no_unfolded_rows(path):
    # im2col rows are kd·kh·kw (27) copies of the input: the rows node keeps the input instead, the
    # direct kernels its laid-out copy
    layer = _layer(kernel_size=3, padding=1, sparsity=0.8, dtype=torch.float32)
    x = torch.randn(2, 4, 8, 8, 8)
    saved = []
    context = torch.autocast("cpu", dtype=torch.bfloat16) if path == "autocast" else _on_path(path)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t), context:
        layer(x).float().sum().backward()
    largest = max(t.numel() for t in saved)
    assert x.numel() <= largest <= 3 * x.numel()  # the input, or its layout (padded 8³ → 11·10·10), not 27 copies
    _check_against_dense(layer.double(), x.double(), "reference" if path == "autocast" else path)


@pytest.mark.parametrize("path", ["native", "direct"])
def test_no_out_by_in_tensor_in_a_training_step(path):
    with LargestTensorMode() as mode:
        layer = snack.SparseConv3d(32, 256, 3, padding=1, sparsity=0.95)
        x = torch.randn(1, 32, 4, 4, 4, requires_grad=True)
        _run(layer, x, path).square().sum().backward()
        torch.optim.Adam(layer.parameters()).step()
    assert layer.values.grad is not None and x.grad is not None
    out_by_in = 256 * 32 * 27
    assert mode.largest < out_by_in // 4, f"{mode.largest_op} produced {mode.largest} elements"
