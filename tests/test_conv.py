"""SparseConv2d against nn.Conv2d on the same (densified) weight: forward and every gradient, on the
native direct kernels and the im2col path, plus conversion, serialisation, RigL's records, tracing
and the truly-sparse guarantee."""

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
from snack.dst.prune_grow import gradient_grow, linear_index
from snack.topology import BLOCK_ELEMENTS
from tests.test_truly_sparse import LargestTensorMode

GEOMETRIES = [
    dict(kernel_size=3),
    dict(kernel_size=3, padding=1),
    dict(kernel_size=(3, 2), stride=(2, 3), padding=(1, 2)),
    dict(kernel_size=3, padding="same", dilation=2),
    dict(kernel_size=(2, 4), padding="same"),  # even kernel: asymmetric padding
    dict(kernel_size=3, stride=2, padding=1, padding_mode="reflect"),
    dict(kernel_size=3, padding=2, padding_mode="circular", dilation=(1, 2)),
    dict(kernel_size=1, padding=1, padding_mode="replicate"),
    dict(kernel_size=5, padding="valid", stride=(1, 2)),
    # stride phases no tap reads (their input gradient is zero), inputs no multiple of the stride
    dict(kernel_size=1, stride=2),
    dict(kernel_size=2, stride=3, padding=1),
    dict(kernel_size=3, stride=2, dilation=2, padding=2),  # every tap in phase (0, 0)
    dict(kernel_size=(3, 2), stride=(3, 2), dilation=(1, 3), padding=(0, 1)),
]
# the CPU's own choice (the direct kernels, or im2col rows where they are faster); im2col through
# the reference ops. "direct" forces the direct kernels (snack.use_backend("cpu")).
PATHS = ["native", "reference"]


def _dense_twin(layer: snack.SparseConv2d) -> nn.Module:
    """The dense layer of ``layer``'s weight: its ``nn.Conv2d`` (``nn.Conv1d``, ``nn.ConvTranspose2d``,
    ... for the other sparse convolutions)."""
    dense = layer._dense_class(**layer._dense_arguments(), dtype=layer.values.dtype)
    with torch.no_grad():
        dense.weight.copy_(layer.to_dense())
        if layer.bias is not None:
            dense.bias.copy_(layer.bias)
    return dense


def _on_path(path: str) -> contextlib.AbstractContextManager:
    """Where ``path`` runs a layer: "reference" on the reference ops, "direct" on the CPU's direct
    kernels (``snack.use_backend("cpu")``); any other path is the layer's own choice."""
    forced = {"reference": "reference", "direct": "cpu"}.get(path)
    return contextlib.nullcontext() if forced is None else snack.use_backend(forced)


def _run(layer, x, path):
    with _on_path(path):
        return layer(x)


def _check_against_dense(layer, x, path, atol=1e-10, *, forward=lambda module, inp: module(inp)):
    """``layer``'s output and its gradients in the input, ``values`` and ``bias`` on ``path``
    against its dense twin's, both called as ``forward(module, input)``."""
    dense = _dense_twin(layer)
    x = x.detach().requires_grad_()
    x_dense = x.detach().clone().requires_grad_()
    with _on_path(path):  # the backward too: it runs on the forward's path
        y = forward(layer, x)
        y_dense = forward(dense, x_dense)
        assert y.shape == y_dense.shape
        torch.testing.assert_close(y, y_dense, atol=atol, rtol=1e-7)
        dy = torch.randn_like(y_dense)
        wanted = [x, layer.values] + ([layer.bias] if layer.bias is not None else [])
        grads = torch.autograd.grad(y, wanted, dy)
    dense_wanted = [x_dense, dense.weight] + ([dense.bias] if dense.bias is not None else [])
    dense_grads = torch.autograd.grad(y_dense, dense_wanted, dy)
    torch.testing.assert_close(grads[0], dense_grads[0], atol=atol, rtol=1e-7)
    # the weight's rows are the sparse layer's out_features (a transposed convolution's input channels)
    flat = dense_grads[1].reshape(layer.out_features, -1)[layer.row.long(), layer.col.long()]
    torch.testing.assert_close(grads[1], flat, atol=atol, rtol=1e-7)
    if layer.bias is not None:
        torch.testing.assert_close(grads[2], dense_grads[2], atol=atol, rtol=1e-7)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
def test_matches_dense_conv_forward_and_gradients(geometry, path):
    layer = snack.SparseConv2d(3, 5, sparsity=0.6, dtype=torch.float64, **geometry)
    _check_against_dense(layer, torch.randn(2, 3, 11, 9, dtype=torch.float64), path)


@pytest.mark.parametrize("path", PATHS)
def test_batch_one_unbatched_and_odd_sizes(path):
    layer = snack.SparseConv2d(4, 7, 3, padding=1, sparsity=0.7, dtype=torch.float64)
    _check_against_dense(layer, torch.randn(1, 4, 13, 5, dtype=torch.float64), path)
    x = torch.randn(4, 6, 7, dtype=torch.float64)
    torch.testing.assert_close(_run(layer, x, path), _dense_twin(layer)(x))


@pytest.mark.parametrize("path", PATHS)
def test_empty_output_channels_and_no_connections(path):
    row = torch.tensor([0, 0, 2])  # channels 1 and 3 have no connection: bias only
    col = torch.tensor([0, 17, 5])
    layer = snack.SparseConv2d.from_coo(row, col, torch.randn(3, dtype=torch.float64), (4, 2, 3, 3),
                                        bias=torch.randn(4, dtype=torch.float64), padding=1)  # fmt: skip
    _check_against_dense(layer, torch.randn(2, 2, 6, 6, dtype=torch.float64), path)
    empty = snack.SparseConv2d.from_coo(
        torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.float64),
        (3, 2, 3, 3), bias=torch.randn(3, dtype=torch.float64),
    )  # fmt: skip
    assert empty.nnz == 0
    _check_against_dense(empty, torch.randn(2, 2, 5, 5, dtype=torch.float64), path)


@pytest.mark.parametrize("stride", [1, (2, 1), (1, 2)])
def test_rows_and_columns_of_many_connections(stride):
    # passes of up to eight connections per row (forward, values gradient) and per column (input
    # gradient): 16 output channels over 2 input channels at 95% density fill every pass size
    layer = snack.SparseConv2d(2, 16, 3, stride=stride, padding=1, sparsity=0.05, dtype=torch.float64)
    assert layer.nnz < 16 * 18  # not full: the native kernels run
    _check_against_dense(layer, torch.randn(3, 2, 9, 10, dtype=torch.float64), "direct")


# The kernels fold samples side by side on small images (fold_samples in conv_walk.h: the
# power of two up to 2048 / run positions and 16 a group, groups balanced), for layers with at
# least a third as many connections as an input and an output sample have elements (32 channels at
# 10% sparsity are, in all four geometries): for 3×3, padding 1, (batch, side) → one sample a group
# on 36×36; 17 on 8×8 → two groups of 9, one short; 20 on 4×4 → two of 10; 3 on 5×5 → one of 3.
@pytest.mark.parametrize("batch, side", [(2, 36), (17, 8), (20, 4), (3, 5)])
@pytest.mark.parametrize("geometry", [dict(kernel_size=3, padding=1), dict(kernel_size=3, stride=2, padding=1),
                                      dict(kernel_size=1, stride=2), dict(kernel_size=2)], ids=str)  # fmt: skip
def test_samples_folded_in_groups_or_one_by_one(geometry, batch, side):
    layer = snack.SparseConv2d(32, 32, sparsity=0.1, dtype=torch.float64, **geometry)
    x = torch.randn(batch, 32, side, side, dtype=torch.float64)
    _check_against_dense(layer, x, "direct")
    layer.values.requires_grad_(False)  # the bias gradient alone reads dy as it comes, unfolded
    y = _run(layer, x, "direct")
    dy = torch.randn_like(y)
    (dbias,) = torch.autograd.grad(y, layer.bias, dy)
    torch.testing.assert_close(dbias, dy.sum((0, 2, 3)))


@pytest.mark.parametrize("frozen", ["values", "bias", "input"])
@pytest.mark.parametrize("path", PATHS)
def test_gradients_of_whatever_requires_them(frozen, path):
    layer = snack.SparseConv2d(3, 4, 3, padding=1, sparsity=0.5, dtype=torch.float64)
    dense = _dense_twin(layer)
    if frozen != "input":
        getattr(layer, frozen).requires_grad_(False)
    x = torch.randn(2, 3, 6, 7, dtype=torch.float64, requires_grad=frozen != "input")
    x_dense = x.detach().clone().requires_grad_(frozen != "input")
    dy = torch.randn(2, 4, 6, 7, dtype=torch.float64)
    _run(layer, x, path).backward(dy)
    dense(x_dense).backward(dy)
    if frozen != "values":
        flat = dense.weight.grad.reshape(4, -1)[layer.row.long(), layer.col.long()]
        torch.testing.assert_close(layer.values.grad, flat)
    else:
        assert layer.values.grad is None
    if frozen != "bias":
        torch.testing.assert_close(layer.bias.grad, dense.bias.grad)
    else:
        assert layer.bias.grad is None
    if frozen != "input":
        torch.testing.assert_close(x.grad, x_dense.grad)


def test_sample_blocks_of_the_values_gradient():
    # 8x8 images: the values gradient sums blocks of 7 samples at once; 11 samples end in a partial one
    layer = snack.SparseConv2d(6, 10, 3, padding=1, sparsity=0.7, dtype=torch.float64)
    _check_against_dense(layer, torch.randn(11, 6, 8, 8, dtype=torch.float64), "direct")


def _check_results_do_not_depend_on_the_thread_count(layer, x: torch.Tensor) -> None:
    """``layer``'s output and its gradients in ``x``, ``values`` and ``bias``: bit-identical with 1
    and 3 threads."""
    x = x.detach().requires_grad_()
    results = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            y = layer(x)
            dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(0))
            results.append((y, *torch.autograd.grad(y, (x, layer.values, layer.bias), dy)))
    finally:
        torch.set_num_threads(threads)
    for one, other in zip(*results):
        assert torch.equal(one, other)


def test_results_do_not_depend_on_the_thread_count():
    layer = snack.SparseConv2d(8, 12, 3, padding=1, sparsity=0.8)
    _check_results_do_not_depend_on_the_thread_count(layer, torch.randn(9, 8, 10, 10))


@pytest.mark.parametrize("path", PATHS)
def test_empty_batch(path):
    layer = snack.SparseConv2d(2, 3, 3, padding=1)
    x = torch.randn(0, 2, 5, 5, requires_grad=True)
    y = _run(layer, x, path)
    assert y.shape == (0, 3, 5, 5)
    y.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(layer.values.grad, torch.zeros_like(layer.values))


@pytest.mark.parametrize("geometry", [dict(kernel_size=3, padding=1), dict(kernel_size=2, stride=2, dilation=1),
                                      dict(kernel_size=3, dilation=2, padding_mode="reflect", padding=2)], ids=str)
@pytest.mark.parametrize("path", PATHS)
def test_gradcheck_and_gradgradcheck(geometry, path):
    layer = snack.SparseConv2d(2, 3, sparsity=0.5, dtype=torch.float64, **geometry)
    _gradcheck_and_gradgradcheck(layer, torch.randn(2, 2, 6, 5, dtype=torch.float64), path)


def _gradcheck_and_gradgradcheck(layer: snack.SparseConv2d, x: torch.Tensor, path: str) -> None:
    """First and second derivatives of ``layer`` in ``x``, ``values`` and ``bias`` (float64)."""

    def conv(x, values, bias):
        with snack.use_backend(path) if path == "reference" else contextlib.nullcontext():
            return torch.func.functional_call(layer, {"values": values, "bias": bias}, (x,))

    inputs = [t.detach().clone().requires_grad_() for t in (x, layer.values, layer.bias)]
    assert torch.autograd.gradcheck(conv, inputs)
    assert torch.autograd.gradgradcheck(conv, inputs)


def _direct_calls(monkeypatch) -> list[int]:
    """A list that gains a 1 at each call of the direct kernels (``direct_conv2d``)."""
    calls = []
    original = snack.backends.cpu.conv.direct_conv2d

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(snack.backends.cpu.conv, "direct_conv2d", spy)
    return calls


def test_native_kernels_run_and_are_skipped_where_they_should(monkeypatch):
    calls = _direct_calls(monkeypatch)
    layer = snack.SparseConv2d(3, 4, 3, sparsity=0.5)
    x = torch.randn(2, 3, 6, 6)
    layer(x)
    assert calls == [1]
    with snack.use_backend("reference"):
        layer(x)
    full = snack.SparseConv2d(3, 4, 3, sparsity=0.0)
    assert full.nnz == 4 * 27
    torch.testing.assert_close(full(x), _dense_twin(full)(x))  # F.conv2d on the values
    assert calls == [1]


def test_rows_or_direct_kernels_by_connections_per_row_element(monkeypatch):
    # rows_are_faster: im2col rows where q = nnz / (N · H_out · W_out · C · kh · kw) is at least
    # 0.25 for inference and 0.5 for training (benchmarks/conv_paths.txt); a forced backend's
    # kernels run as they are
    calls = _direct_calls(monkeypatch)
    layer = snack.SparseConv2d(32, 64, 3, stride=2, padding=1, sparsity=0.9, dtype=torch.float64)
    q_of = {side: layer.nnz / ((side // 2) ** 2 * 32 * 9) for side in (4, 8, 16)}  # batch 1
    assert q_of[4] >= 0.5 > q_of[8] >= 0.25 > q_of[16]
    for side, direct_in_inference, direct_in_training in ((4, False, False), (8, False, True), (16, True, True)):
        x = torch.randn(1, 32, side, side, dtype=torch.float64)
        calls.clear()
        with torch.no_grad():
            torch.testing.assert_close(layer(x), _dense_twin(layer)(x))
        assert calls == [1] * direct_in_inference
        calls.clear()
        _check_against_dense(layer, x, "native")
        assert calls == [1] * direct_in_training
        calls.clear()
        _check_against_dense(layer, x, "direct")
        assert calls == [1]


def test_full_layer_matches_dense_gradients():
    layer = snack.SparseConv2d(3, 4, 3, padding=1, sparsity=0.0, dtype=torch.float64)
    _check_against_dense(layer, torch.randn(2, 3, 7, 6, dtype=torch.float64), "native")


def test_matches_sparse_linear_on_im2col_rows_in_float32():
    layer = snack.SparseConv2d(8, 16, 3, padding=1, sparsity=0.9)
    x = torch.randn(4, 8, 12, 12)
    with snack.use_backend("cpu"):
        y = layer(x)
    torch.testing.assert_close(y, _dense_twin(layer)(x), atol=1e-5, rtol=1e-5)


def test_from_dense_keeps_the_largest_weights_and_geometry():
    conv = nn.Conv2d(4, 6, (3, 2), stride=2, padding=(1, 0), dilation=(2, 1), padding_mode="replicate")
    layer = snack.SparseConv2d.from_dense(conv, sparsity=0.75)
    assert (layer.kernel_size, layer.stride, layer.padding, layer.dilation, layer.padding_mode) == (
        (3, 2), (2, 2), (1, 0), (2, 1), "replicate")
    assert layer.nnz == round(0.25 * conv.weight.numel())
    kept = layer.to_dense() != 0
    assert conv.weight.abs()[kept].min() >= conv.weight.abs()[~kept].max()
    full = snack.SparseConv2d.from_dense(conv)
    x = torch.randn(2, 4, 9, 8)
    torch.testing.assert_close(full(x), conv(x), atol=1e-6, rtol=1e-5)
    weight = snack.SparseConv2d.from_dense(conv.weight.detach(), stride=2, padding=(1, 0), dilation=(2, 1),
                                           padding_mode="replicate", bias=conv.bias.detach())  # fmt: skip
    torch.testing.assert_close(weight(x), conv(x), atol=1e-6, rtol=1e-5)


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match=r"groups must divide in_channels and out_channels, got groups=3 with "
                                         "in_channels=4 and out_channels=6"):  # fmt: skip
        snack.SparseConv2d(4, 6, 3, groups=3)
    with pytest.raises(ValueError, match="groups must be a positive int, got 0"):
        snack.SparseConv2d(4, 4, 3, groups=0)
    with pytest.raises(ValueError, match="padding='same' needs stride 1"):
        snack.SparseConv2d(4, 4, 3, stride=2, padding="same")
    with pytest.raises(ValueError, match="padding_mode must be one of"):
        snack.SparseConv2d(4, 4, 3, padding_mode="mirror")
    with pytest.raises(ValueError, match="kernel_size must be a positive int"):
        snack.SparseConv2d(4, 4, 0)
    with pytest.raises(ValueError, match="padding must be a non-negative"):
        snack.SparseConv2d(4, 4, 3, padding=-1)
    with pytest.raises(ValueError, match="in_channels and out_channels must be positive"):
        snack.SparseConv2d(0, 4, 3)
    with pytest.raises(ValueError, match="must not be given with an nn.Conv2d"):
        snack.SparseConv2d.from_dense(nn.Conv2d(4, 4, 3), groups=2)
    with pytest.raises(ValueError, match=r"must be \(out_channels, in_channels / groups, kh, kw\)"):
        snack.SparseConv2d.from_dense(torch.randn(4, 12))
    with pytest.raises(ValueError, match="groups must divide in_channels and out_channels, got groups=4 with "
                                         "in_channels=8 and out_channels=6"):  # fmt: skip
        snack.SparseConv2d.from_dense(torch.randn(6, 2, 3, 3), groups=4)
    layer = snack.SparseConv2d(3, 4, 3)
    with pytest.raises(ValueError, match=r"input must have shape \(N, 3, H, W\) or \(3, H, W\), got \(2, 4, 8, 8\)"):
        layer(torch.randn(2, 4, 8, 8))
    with pytest.raises(ValueError, match="input must have shape"):
        layer(torch.randn(2, 27))
    with pytest.raises(ValueError, match="smaller than the dilated kernel"):
        layer(torch.randn(1, 3, 2, 8))
    with pytest.raises(TypeError, match="input dtype torch.float64 does not match the layer's torch.float32"):
        layer(torch.randn(1, 3, 5, 5, dtype=torch.float64))
    with pytest.raises(AttributeError, match=r"builds the \(out_channels, in_channels / groups, kh, kw\)"):
        layer.weight


@pytest.mark.parametrize("path", [*PATHS, "autocast"])
def test_backward_after_values_changed_in_place_raises(path):
    layer = snack.SparseConv2d(2, 3, 3, sparsity=0.5)
    x = torch.randn(1, 2, 5, 5, requires_grad=True)
    if path == "autocast":  # the node keeps the cast of values, and values itself for this check
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
    else:
        y = _run(layer, x, path)
    with torch.no_grad():
        layer.values.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_training_under_autocast_matches_a_dense_convolution():
    # im2col in bfloat16, as one node keeping the cast input; gradients reach the float32 parameters
    layer = snack.SparseConv2d(3, 4, 3, stride=2, padding=1, sparsity=0.5)
    dense = _dense_twin(layer)
    x = torch.randn(2, 3, 9, 8, requires_grad=True)
    x_dense = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_dense = layer(x), dense(x_dense)
    assert y.dtype == y_dense.dtype == torch.bfloat16
    y.float().square().sum().backward()
    y_dense.float().square().sum().backward()
    torch.testing.assert_close(y, y_dense, atol=0.05, rtol=0.02)
    assert x.grad.dtype == layer.values.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, x_dense.grad, atol=0.1, rtol=0.05)
    flat = dense.weight.grad.reshape(4, -1)[layer.row.long(), layer.col.long()]
    torch.testing.assert_close(layer.values.grad, flat, atol=0.2, rtol=0.05)
    torch.testing.assert_close(layer.bias.grad, dense.bias.grad, atol=0.2, rtol=0.05)


def test_state_dict_pickle_and_deepcopy_round_trip():
    layer = snack.SparseConv2d(3, 4, 3, stride=2, padding=1, sparsity=0.8)
    other = snack.SparseConv2d(3, 4, 3, stride=2, padding=1, sparsity=0.5)
    other.load_state_dict(layer.state_dict())
    x = torch.randn(2, 3, 7, 7)
    assert other.nnz == layer.nnz and torch.equal(other(x), layer(x))
    for copied in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert torch.equal(copied(x), layer(x)) and copied.stride == (2, 2)


def test_sparsify_and_densify_convert_convolutions():
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, groups=2),
                        nn.Conv2d(8, 16, 3, stride=2), nn.Flatten(), nn.Linear(16 * 16, 10))  # fmt: skip
    x = torch.randn(2, 3, 12, 12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = snack.sparsify(net, 0.7, distribution="erk")
    assert [type(m).__name__ for m in model] == ["SparseConv2d", "ReLU", "SparseConv2d", "SparseConv2d", "Flatten",
                                                 "SparseLinear"]  # fmt: skip
    assert model[2].groups == 2 and model[2].in_features == 4 * 9
    sparse = [m for m in model if isinstance(m, snack.SparseLinear)]
    total = 8 * 27 + 8 * 36 + 16 * 72 + 10 * 256
    assert abs(sum(m.nnz for m in sparse) - 0.3 * total) <= len(sparse)
    y = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dense = snack.densify(model)
    assert [type(m).__name__ for m in dense] == ["Conv2d", "ReLU", "Conv2d", "Conv2d", "Flatten", "Linear"]
    assert dense[3].stride == (2, 2) and dense[2].groups == 2
    torch.testing.assert_close(dense(x), y, atol=1e-5, rtol=1e-5)


def test_sparsify_warns_about_convolutions_it_leaves_dense():
    class Conv2dSubclass(nn.Conv2d):
        pass

    net = nn.Sequential(nn.Conv1d(3, 4, 3), nn.Unflatten(1, (1, 4)), nn.Conv2d(1, 4, 3, padding=1),
                        Conv2dSubclass(4, 4, 1), nn.ConvTranspose2d(4, 2, 2), nn.Unflatten(1, (1, 2)),
                        nn.ConvTranspose3d(1, 2, 1), nn.Conv3d(2, 2, 1))  # fmt: skip
    with pytest.warns(UserWarning) as caught:
        model = snack.sparsify(net, 0.5)
    [message] = [str(w.message) for w in caught if "convolution(s) dense" in str(w.message)]
    assert message.startswith(
        "sparsify left 1 convolution(s) dense: 3 (Conv2dSubclass). snack converts nn.Conv1d, nn.Conv2d, nn.Conv3d, "
        "nn.ConvTranspose1d, nn.ConvTranspose2d and nn.ConvTranspose3d themselves, not their subclasses"
    )
    assert isinstance(model[4], snack.SparseConvTranspose2d) and isinstance(model[7], snack.SparseConv3d)
    assert isinstance(model[6], snack.SparseConvTranspose3d)
    assert isinstance(model[2], snack.SparseConv2d) and isinstance(model[0], snack.SparseConv1d)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        snack.sparsify(nn.Sequential(Conv2dSubclass(3, 4, 3), nn.Conv2d(3, 4, 3)), 0.5, exclude="0")  # quiet


def test_erk_is_kernel_aware():
    shapes = {"conv": (64, 3, 7, 7), "linear": (10, 512)}
    densities = snack.distributions.erk_densities(shapes, 0.2)
    sizes = {"conv": 64 * 3 * 49, "linear": 5120}
    assert abs(sum(densities[n] * sizes[n] for n in shapes) - 0.2 * sum(sizes.values())) < 1e-6
    ratio = densities["conv"] / densities["linear"]
    assert ratio == pytest.approx(((64 + 3 + 7 + 7) / sizes["conv"]) / ((10 + 512) / sizes["linear"]))


@pytest.mark.parametrize("geometry", [dict(stride=2, padding=1), dict(dilation=(2, 1), padding=(2, 1),
                                                                     padding_mode="reflect")], ids=str)
@pytest.mark.parametrize("path", PATHS)
def test_rigl_records_give_the_dense_weight_gradient(path, geometry):
    layer = snack.SparseConv2d(3, 4, 3, sparsity=0.6, dtype=torch.float64, **geometry)
    capture = GradientCapture([layer])
    capture.arm()
    x = torch.randn(3, 3, 9, 8, dtype=torch.float64)
    _run(layer, x, path).square().sum().backward()
    x_kept, dy_rows = capture.batch(0)
    torch.testing.assert_close(x_kept, layer._padded(x))  # the padded input, not its im2col rows
    dense = _dense_twin(layer)
    dense(x).square().sum().backward()
    gradient = dense.weight.grad.reshape(4, -1)
    torch.testing.assert_close(dy_rows.T @ layer._rows_of_record(x_kept), gradient)
    capture.disarm()
    # growth scored from the padded input: the largest |∂L/∂W| among inactive positions, in one
    # block or one row a block (which also samples a bar from strided rows)
    inactive = gradient.abs().flatten()
    inactive[linear_index(layer.topology)] = -1
    expected = inactive.topk(12).indices.sort().values
    for block_elements in (BLOCK_ELEMENTS, layer.in_features):
        grown = gradient_grow(x_kept, dy_rows, layer.topology, 12, block_elements=block_elements, convolution=layer)
        assert torch.equal(grown, expected)


def test_rigl_records_calls_on_two_image_sizes_as_rows():
    layer = snack.SparseConv2d(2, 3, 3, padding=1, sparsity=0.5, dtype=torch.float64)
    dense = _dense_twin(layer)
    capture = GradientCapture([layer])
    capture.arm()
    for size in (5, 7):  # padded inputs of two sizes cannot be concatenated: their rows can
        x = torch.randn(2, 2, size, size, dtype=torch.float64)
        layer(x).square().sum().backward()
        dense(x).square().sum().backward()
    x_rows, dy_rows = capture.batch(0)
    capture.disarm()
    assert x_rows.shape == (2 * 25 + 2 * 49, layer.in_features)
    assert layer._rows_of_record(x_rows) is x_rows  # what recorded_batch and a gather on several ranks call
    torch.testing.assert_close(dy_rows.T @ x_rows, dense.weight.grad.reshape(3, -1))
    grown = gradient_grow(x_rows, dy_rows, layer.topology, 3)  # rows: scored as a linear layer's
    inactive = dense.weight.grad.reshape(3, -1).abs().flatten()
    inactive[linear_index(layer.topology)] = -1
    assert torch.equal(grown, inactive.topk(3).indices.sort().values)


def test_rigl_updates_a_convolution_run_on_two_image_sizes_in_one_step():
    layer = snack.SparseConv2d(2, 3, 3, padding=1, sparsity=0.5)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    dst = snack.dst.RigL(layer, optimizer, drop_fraction=0.5, update_every=1, total_steps=10, schedule="constant")
    row, col = layer.row.clone(), layer.col.clone()
    loss = layer(torch.randn(2, 2, 5, 5)).square().sum() + layer(torch.randn(2, 2, 7, 7)).square().sum()
    loss.backward()
    optimizer.step()
    assert dst.step()
    assert layer.nnz == row.numel() and not (torch.equal(row, layer.row) and torch.equal(col, layer.col))


def test_gradient_grow_refuses_a_padded_input_without_its_convolution():
    layer = snack.SparseConv2d(2, 3, 3, sparsity=0.5)
    x, dy = torch.randn(1, 2, 5, 5), torch.randn(9, 3)
    with pytest.raises(ValueError, match=r"x must be \(B, 18\) rows, or a convolution's padded input"):
        gradient_grow(x, dy, layer.topology, 2)
    with pytest.raises(ValueError, match=r"x must be \(B, 18\) rows.* got x of shape \(9, 12\)"):
        gradient_grow(torch.randn(9, 12), dy, layer.topology, 2, convolution=layer)
    with pytest.raises(ValueError, match="x must have 2 channels, got"):
        gradient_grow(torch.randn(1, 3, 5, 5), dy, layer.topology, 2, convolution=layer)


def test_rigl_trains_a_small_cnn():
    model = nn.Sequential(snack.SparseConv2d(1, 8, 3, padding=1, sparsity=0.8), nn.ReLU(inplace=True),
                          snack.SparseConv2d(8, 8, 3, stride=2, sparsity=0.8), nn.Flatten(),
                          snack.SparseLinear(8 * 9, 3, sparsity=0.5))  # fmt: skip
    _check_rigl_rewires_the_convolutions(model, torch.randn(16, 1, 8, 8), "native")


def _check_rigl_rewires_the_convolutions(model: nn.Sequential, x: torch.Tensor, path: str) -> None:
    """Six RigL steps of ``model`` (two sparse convolutions at 0 and 2, then a classifier of 3) on
    ``x``: the convolutions keep their nnz, change their connections and still match dense math."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    dst = snack.dst.RigL(model, opt, drop_fraction=0.3, update_every=2, total_steps=12, schedule="constant")
    target = torch.randint(0, 3, (x.shape[0],))
    convolutions = (model[0], model[2])
    before = [(m.row.clone(), m.col.clone()) for m in convolutions]
    nnz = [m.nnz for m in convolutions]
    for _ in range(6):
        loss = F.cross_entropy(model(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        dst.step()
    assert [m.nnz for m in convolutions] == nnz
    for (row, col), layer in zip(before, convolutions):
        assert not (torch.equal(row, layer.row) and torch.equal(col, layer.col))
        _check_against_dense(layer.double(), torch.randn(2, layer.in_channels, *x.shape[2:], dtype=torch.float64), path)


@pytest.mark.parametrize("path", ["native", "direct"])  # (native: im2col rows here, see test_rows_or_direct...)
def test_no_out_by_in_tensor_in_a_training_step(path):
    with LargestTensorMode() as mode:
        layer = snack.SparseConv2d(64, 512, 3, padding=1, sparsity=0.95)
        x = torch.randn(1, 64, 6, 6, requires_grad=True)
        _run(layer, x, path).square().sum().backward()
        torch.optim.Adam(layer.parameters()).step()
    assert layer.values.grad is not None and x.grad is not None
    out_by_in = 512 * 64 * 9
    assert mode.largest < out_by_in // 4, f"{mode.largest_op} produced {mode.largest} elements"


@pytest.mark.parametrize("path", [*PATHS, "full"])
@pytest.mark.parametrize("padding", [1, "same", (2, 0)], ids=str)
def test_the_backward_keeps_the_input_not_a_padded_copy_or_its_rows(path, padding):
    # a padded copy saved by every convolution made a sparse ResNet-18 keep 1.6x the activations
    # of the dense one for its backward; the im2col rows (9x the input here) were kept on a GPU
    layer = snack.SparseConv2d(4, 6, 3, padding=padding, sparsity=0.0 if path == "full" else 0.8)
    x = torch.randn(2, 4, 7, 5)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        _run(layer, x, path).sum().backward()
    activations = [t for t in saved if t.numel() >= x.numel()]
    assert activations, "the backward must keep the input for the values gradient"
    assert all(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for t in activations)
    assert layer.values.grad is not None


def test_tracing_compiling_and_autocast_follow_the_im2col_path():
    model = nn.Sequential(snack.SparseConv2d(3, 4, 3, padding=1, sparsity=0.5), nn.ReLU())
    x = torch.randn(2, 3, 6, 6)
    expected = model(x)
    torch.testing.assert_close(torch.fx.symbolic_trace(model)(x), expected)
    torch.testing.assert_close(torch.fx.symbolic_trace(model[0])(x), model[0](x))
    torch.testing.assert_close(torch.jit.trace(model, x)(x), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(torch.compile(model, fullgraph=True, backend="eager")(x), expected,
                               atol=1e-6, rtol=1e-5)  # fmt: skip
    batch = torch.export.Dim("batch")
    exported = torch.export.export(model, (x,), dynamic_shapes=({0: batch},)).module()
    torch.testing.assert_close(exported(x), expected, atol=1e-6, rtol=1e-5)
    other = torch.randn(5, 3, 6, 6)
    torch.testing.assert_close(exported(other), model(other), atol=1e-6, rtol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(x)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), expected, atol=0.1, rtol=0.05)


def test_a_compiled_model_follows_the_image_size():
    """A second image size makes Dynamo recompile with the sizes symbolic: Inductor failed
    (ValueRangeError) to lay out a channels-last view of the rows' product as the graph's output."""
    torch.manual_seed(0)
    model = snack.sparsify(nn.Sequential(nn.Conv2d(4, 6, 3), nn.ReLU(), nn.Conv2d(6, 6, 3, groups=2)),
                           sparsity=0.6, init="random")  # fmt: skip
    torch._dynamo.reset()
    compiled = torch.compile(model)
    for size in (8, 10, 7):
        x = torch.randn(2, 4, size, size)
        y = compiled(x)
        y.square().sum().backward()
        torch.testing.assert_close(y, model(x), atol=1e-5, rtol=1e-5)
        assert y.shape == (2, 6, size - 4, size - 4)


def test_per_sample_gradients_by_torch_func():
    layer = snack.SparseConv2d(2, 3, 3, sparsity=0.5, dtype=torch.float64)
    params = {"values": layer.values.detach(), "bias": layer.bias.detach()}
    x = torch.randn(4, 2, 5, 5, dtype=torch.float64)

    def loss(params, sample):
        return torch.func.functional_call(layer, params, (sample,)).square().sum()

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    for i in range(4):
        torch.testing.assert_close(per_sample["values"][i], torch.func.grad(loss)(params, x[i])["values"])


@pytest.mark.parametrize("layout", ["channels_last", "sliced", "transposed"])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("path", PATHS)
def test_inputs_of_any_memory_layout(layout, groups, path):
    # channels_last models, and views of other tensors: the kernels take a contiguous copy
    layer = snack.SparseConv2d(4, 6, 3, padding=1, groups=groups, sparsity=0.5, dtype=torch.float64)
    if layout == "channels_last":
        x = torch.randn(2, 4, 7, 9, dtype=torch.float64).to(memory_format=torch.channels_last)
    elif layout == "sliced":
        x = torch.randn(2, 8, 7, 9, dtype=torch.float64)[:, ::2]
    else:
        x = torch.randn(2, 4, 9, 7, dtype=torch.float64).transpose(2, 3)
    assert not x.is_contiguous()
    _check_against_dense(layer, x, path)
