"""The depthwise kernels (``snack/backends/cpu/depthwise_kernels.cpp``), which depthwise layers
(``groups == in_channels > 1``) run on the CPU: against nn.Conv2d / nn.Conv1d on the densified
weight (forward and every gradient), gradcheck, edge cases, the dispatch, determinism and the ops'
errors. Grouped layers in general: ``tests/test_conv_groups.py``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import snack
from snack.backends.cpu import conv as direct
from tests.test_conv import (
    _check_against_dense, _check_results_do_not_depend_on_the_thread_count, _gradcheck_and_gradgradcheck, _run,
)

CHANNELS = 16

# (channel multiplier, geometry); every one a depthwise layer of CHANNELS input channels
GEOMETRIES = [
    (1, dict(kernel_size=3, padding=1)),
    (1, dict(kernel_size=3)),  # no padding: the input is its own source plane
    (1, dict(kernel_size=3, stride=2, padding=1)),
    (2, dict(kernel_size=3, stride=2, padding=1)),
    (3, dict(kernel_size=(3, 2), stride=(2, 1), dilation=(1, 2), padding=(1, 2))),
    (1, dict(kernel_size=5, padding=4, dilation=2)),
    (1, dict(kernel_size=(1, 7), stride=(1, 3), padding=(0, 3))),
    (1, dict(kernel_size=1, stride=2)),
    (1, dict(kernel_size=4, padding="same")),  # an odd total: the extra row and column last
    (2, dict(kernel_size=3, padding=2, padding_mode="reflect")),  # padded by the layer first
]


def _depthwise(multiplier: int, geometry: dict, sparsity: float = 0.5, channels: int = CHANNELS):
    return snack.SparseConv2d(channels, multiplier * channels, groups=channels, sparsity=sparsity,
                              dtype=torch.float64, **geometry)  # fmt: skip


def _depthwise_calls(monkeypatch) -> list[bool]:
    """A list that gains the ``depthwise`` argument of each call of the direct kernels."""
    calls = []
    original = direct.direct_conv2d

    def spy(*args, **kwargs):
        calls.append(kwargs.get("depthwise", False))
        return original(*args, **kwargs)

    monkeypatch.setattr(direct, "direct_conv2d", spy)
    return calls


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")  # the dense twin's
@pytest.mark.parametrize("batch, size", [(3, (9, 7)), (1, (6, 11))])
@pytest.mark.parametrize("case", GEOMETRIES, ids=str)
def test_matches_dense_depthwise_conv_forward_and_gradients(case, batch, size, monkeypatch):
    calls = _depthwise_calls(monkeypatch)
    layer = _depthwise(*case)
    _check_against_dense(layer, torch.randn(batch, CHANNELS, *size, dtype=torch.float64), "direct")
    assert calls == [True]


@settings(max_examples=30, deadline=None)
@given(
    channels=st.integers(2, 20),
    multiplier=st.integers(1, 3),
    kernel=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    stride=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    dilation=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    padding=st.tuples(st.integers(0, 3), st.integers(0, 3)),
    sparsity=st.sampled_from([0.0, 0.3, 0.8, 0.99]),
    batch=st.integers(1, 4),
    size=st.tuples(st.integers(1, 12), st.integers(1, 12)),
    seed=st.integers(0, 2**16),
)
def test_random_depthwise_geometries(channels, multiplier, kernel, stride, dilation, padding, sparsity, batch, size,
                                     seed):  # fmt: skip
    torch.manual_seed(seed)
    (kh, kw), (dh, dw) = kernel, dilation
    height = max(size[0], dh * (kh - 1) + 1 - 2 * padding[0])  # the padded input holds the dilated kernel
    width = max(size[1], dw * (kw - 1) + 1 - 2 * padding[1])
    layer = snack.SparseConv2d(channels, multiplier * channels, kernel, stride, padding, dilation, groups=channels,
                               sparsity=sparsity, dtype=torch.float64)  # fmt: skip
    _check_against_dense(layer, torch.randn(batch, channels, height, width, dtype=torch.float64), "direct")


@pytest.mark.parametrize("batch", [16, 17, 35])
def test_samples_in_chunks_of_partial_sums(batch):
    # the backward sums dvalues and dbias per chunk of ceil(batch / 16) samples (kMaxChunks in
    # depthwise_kernels.cpp): 16 chunks of one, 9 of two (the last one short), 12 of three (the last two)
    layer = _depthwise(1, dict(kernel_size=3, stride=2, padding=1), channels=2 * CHANNELS + 1)  # two channel blocks
    _check_against_dense(layer, torch.randn(batch, 2 * CHANNELS + 1, 5, 6, dtype=torch.float64), "direct")


def test_gradcheck_and_gradgradcheck():
    layer = _depthwise(2, dict(kernel_size=3, stride=2, padding=1))
    _gradcheck_and_gradgradcheck(layer, torch.randn(2, CHANNELS, 5, 4, dtype=torch.float64), "native")


def test_no_connections_channels_without_any_and_an_empty_batch():
    # channels 0 and 2 have connections (one output of each of their two); the others none: bias only
    row, col = torch.tensor([0, 0, 5]), torch.tensor([0, 4, 8])
    layer = snack.SparseConv2d.from_coo(row, col, torch.randn(3, dtype=torch.float64), (2 * CHANNELS, 1, 3, 3),
                                        groups=CHANNELS, padding=1, bias=torch.randn(2 * CHANNELS,
                                        dtype=torch.float64))  # fmt: skip
    _check_against_dense(layer, torch.randn(2, CHANNELS, 5, 6, dtype=torch.float64), "direct")
    nothing = torch.empty(0, dtype=torch.long)
    empty = snack.SparseConv2d.from_coo(nothing, nothing, torch.empty(0, dtype=torch.float64), (CHANNELS, 1, 3, 3),
                                        groups=CHANNELS, padding=1, bias=torch.randn(CHANNELS, dtype=torch.float64))
    _check_against_dense(empty, torch.randn(2, CHANNELS, 5, 6, dtype=torch.float64), "direct")
    x = torch.randn(0, CHANNELS, 5, 6, dtype=torch.float64, requires_grad=True)
    layer = _depthwise(1, dict(kernel_size=3, padding=1))
    y = _run(layer, x, "direct")
    assert y.shape == (0, CHANNELS, 5, 6)
    y.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(layer.bias.grad, torch.zeros(CHANNELS, dtype=torch.float64))


@pytest.mark.parametrize("needed", ["input", "values", "bias", "input and bias"])
def test_only_the_gradients_asked_for(needed):
    layer = _depthwise(1, dict(kernel_size=3, stride=2, padding=1))
    x = torch.randn(3, CHANNELS, 7, 7, dtype=torch.float64, requires_grad="input" in needed)
    layer.values.requires_grad_("values" in needed)
    layer.bias.requires_grad_("bias" in needed)
    y = _run(layer, x, "direct")
    dy = torch.randn_like(y)
    y.backward(dy)
    dense = torch.nn.functional.conv2d
    x_dense = x.detach().requires_grad_()
    weight = layer.to_dense().detach().requires_grad_()
    bias = layer.bias.detach().requires_grad_()
    dense(x_dense, weight, bias, 2, 1, 1, CHANNELS).backward(dy)
    assert (x.grad is not None, layer.values.grad is not None, layer.bias.grad is not None) == (
        "input" in needed, "values" in needed, "bias" in needed
    )
    if x.grad is not None:
        torch.testing.assert_close(x.grad, x_dense.grad)
    if layer.values.grad is not None:
        flat = weight.grad.reshape(CHANNELS, -1)[layer.row.long(), layer.col.long()]
        torch.testing.assert_close(layer.values.grad, flat)
    if layer.bias.grad is not None:
        torch.testing.assert_close(layer.bias.grad, bias.grad)


@pytest.mark.parametrize("batch", [5, 35])  # one sample a chunk, three (the last one two)
def test_results_do_not_depend_on_the_thread_count(batch):
    layer = snack.SparseConv2d(2 * CHANNELS + 1, 4 * CHANNELS + 2, 3, padding=1, groups=2 * CHANNELS + 1,
                               sparsity=0.4)  # fmt: skip
    _check_results_do_not_depend_on_the_thread_count(layer, torch.randn(batch, 2 * CHANNELS + 1, 10, 9))


def test_which_layers_run_the_depthwise_kernels(monkeypatch):
    calls = _depthwise_calls(monkeypatch)
    x = torch.randn(2, CHANNELS, 6, 6)
    snack.SparseConv2d(CHANNELS, CHANNELS, 3, groups=CHANNELS, sparsity=0.5)(x)
    snack.SparseConv2d(CHANNELS, 2 * CHANNELS, 3, groups=CHANNELS, sparsity=0.5)(x)
    snack.SparseConv2d(CHANNELS, CHANNELS, 3, groups=CHANNELS // 2, sparsity=0.5)(x)  # two channels a group
    snack.SparseConv2d(2, 2, 3, groups=2, sparsity=0.5)(torch.randn(2, 2, 6, 6))
    snack.SparseConv2d(1, 4, 3, sparsity=0.5)(torch.randn(2, 1, 6, 6))  # one input channel: an ordinary convolution
    snack.SparseConv1d(CHANNELS, CHANNELS, 3, groups=CHANNELS, sparsity=0.5)(torch.randn(2, CHANNELS, 9))
    assert calls == [True, True, False, True, False, True]


@pytest.mark.parametrize("geometry", [dict(kernel_size=3, padding=1), dict(kernel_size=5, stride=2, dilation=2)],
                         ids=str)  # fmt: skip
def test_depthwise_conv1d_matches_dense(geometry, monkeypatch):
    calls = _depthwise_calls(monkeypatch)
    layer = snack.SparseConv1d(CHANNELS, 2 * CHANNELS, groups=CHANNELS, sparsity=0.5, dtype=torch.float64, **geometry)
    _check_against_dense(layer, torch.randn(3, CHANNELS, 17, dtype=torch.float64), "direct")
    assert calls == [True]


def test_the_ops_refuse_bad_arguments():
    snack.backends.get_backend("cpu")  # loads the ops
    forward, backward = torch.ops.snack_cpu.depthwise_conv2d_forward, torch.ops.snack_cpu.depthwise_conv2d_backward
    x, values = torch.randn(2, 4, 5, 5), torch.randn(3)
    rowptr, col = torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32), torch.tensor([0, 4, 8], dtype=torch.int32)
    geometry = ([3, 3], [1, 1], [1, 1], [1, 1, 1, 1])
    assert forward(x, values, rowptr, col, None, *geometry).shape == (2, 4, 5, 5)
    with pytest.raises(RuntimeError, match=r"col must hold kernel taps, in \[0, kh·kw\)"):
        forward(x, values, rowptr, torch.tensor([0, 4, 9], dtype=torch.int32), None, *geometry)
    with pytest.raises(RuntimeError, match=r"out channels \(3\) must be a multiple of the input's \(4\)"):
        forward(x, values, rowptr[:4], col, None, *geometry)
    with pytest.raises(RuntimeError, match="bias must be"):
        forward(x, values, rowptr, col, torch.randn(3), *geometry)
    with pytest.raises(RuntimeError, match=r"dy must be \(N, out, Ho, Wo\)"):
        backward(torch.randn(2, 4, 4, 5), x, values, rowptr, col, *geometry, True, True, True)
    with pytest.raises(RuntimeError, match="x must have the values' dtype"):
        forward(x.double(), values, rowptr, col, None, *geometry)
