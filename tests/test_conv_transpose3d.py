"""SparseConvTranspose3d against nn.ConvTranspose3d on the same (densified) weight: forward and
every gradient on the 2-D direct kernels (the adjoint of SparseConv3d's plane layout), the
composite path (two folds) and a full layer; output sizes, constructors and conversion, RigL's
growth by the weight gradient, tracing, and the truly-sparse guarantee."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import snack
from snack.dst.capture import GradientCapture
from snack.dst.prune_grow import gradient_grow, linear_index
from tests.test_conv import _dense_twin, _on_path
from tests.test_conv_transpose import PATHS, _check_against_dense, _direct_calls
from tests.test_truly_sparse import LargestTensorMode

# (in_channels, out_channels, geometry)
GEOMETRIES = [
    (4, 6, dict(kernel_size=3)),
    (4, 6, dict(kernel_size=3, stride=2, padding=1, output_padding=1)),  # a 3-D U-Net's 2x upsampling
    (4, 6, dict(kernel_size=2, stride=2)),  # the other one: no overlap
    (4, 6, dict(kernel_size=(3, 2, 1), stride=(2, 1, 3), padding=(1, 0, 0), output_padding=(1, 0, 2), groups=2)),
    (6, 4, dict(kernel_size=3, padding=1, output_padding=1, dilation=2, groups=2)),  # output_padding >= stride
    (6, 6, dict(kernel_size=3, stride=2, padding=1, groups=6)),  # depthwise
    (5, 3, dict(kernel_size=1)),
    (2, 3, dict(kernel_size=(1, 3, 3), stride=(1, 2, 2), padding=(0, 1, 1), dilation=(3, 1, 2))),
]


def _layer(in_channels, out_channels, geometry, sparsity=0.5, dtype=torch.float64):
    return snack.SparseConvTranspose3d(in_channels, out_channels, sparsity=sparsity, dtype=dtype, **geometry)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", GEOMETRIES, ids=str)
def test_matches_nn_conv_transpose3d_forward_and_gradients(case, path, monkeypatch):
    torch.manual_seed(0)
    calls = _direct_calls(monkeypatch)
    in_channels, out_channels, geometry = case
    layer = _layer(in_channels, out_channels, geometry)
    _check_against_dense(layer, torch.randn(2, in_channels, 4, 5, 3, dtype=torch.float64), path)
    if path != "auto":  # (which the layer picks is test_the_dispatch_takes_rows_where_they_are_faster's)
        assert bool(calls) == (path == "direct")


@settings(max_examples=25, deadline=None)
@given(
    per_group=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    groups=st.integers(1, 2),
    kernel=st.tuples(*[st.integers(1, 3)] * 3),
    stride=st.tuples(*[st.integers(1, 3)] * 3),
    dilation=st.tuples(*[st.integers(1, 2)] * 3),
    padding=st.tuples(*[st.integers(0, 1)] * 3),
    extra=st.tuples(*[st.integers(0, 2)] * 3),
    sparsity=st.sampled_from([0.0, 0.5, 0.9]),
    size=st.tuples(*[st.integers(1, 4)] * 3),
    path=st.sampled_from(["direct", "reference"]),
)
def test_random_geometries(per_group, groups, kernel, stride, dilation, padding, extra, sparsity, size, path):
    output_padding = tuple(min(e, max(s, d) - 1) for e, s, d in zip(extra, stride, dilation))
    out_size = [(n - 1) * s - 2 * p + d * (k - 1) + o + 1
                for n, s, p, d, k, o in zip(size, stride, padding, dilation, kernel, output_padding)]  # fmt: skip
    if min(out_size) < 1:
        return  # the layer refuses it (test_bad_arguments_and_inputs_are_refused_with_clear_errors)
    geometry = dict(kernel_size=kernel, stride=stride, dilation=dilation, padding=padding,
                    output_padding=output_padding, groups=groups)  # fmt: skip
    layer = _layer(per_group[0] * groups, per_group[1] * groups, geometry, sparsity=sparsity)
    _check_against_dense(layer, torch.randn(2, layer.in_channels, *size, dtype=torch.float64), path)


@pytest.mark.parametrize("path", PATHS)
def test_batch_one_unbatched_empty_channels_and_no_connections(path):
    # input channel 1 and output channel 2 have no connection (its output is the bias alone)
    row, col = torch.tensor([0, 0, 2, 3]), torch.tensor([0, 40, 13, 30])
    layer = snack.SparseConvTranspose3d.from_coo(row, col, torch.randn(4, dtype=torch.float64), (4, 3, 3, 3, 3),
                                                 bias=torch.randn(3, dtype=torch.float64), stride=2)  # fmt: skip
    assert (layer.in_channels, layer.out_channels) == (4, 3)
    _check_against_dense(layer, torch.randn(1, 4, 2, 3, 5, dtype=torch.float64), path)
    x = torch.randn(4, 2, 3, 5, dtype=torch.float64)
    with _on_path(path):
        torch.testing.assert_close(layer(x), _dense_twin(layer)(x))
        empty = snack.SparseConvTranspose3d.from_coo(row[:0], col[:0], torch.zeros(0, dtype=torch.float64),
                                                     (4, 3, 3, 3, 3), stride=2)  # fmt: skip
        assert empty.nnz == 0
        _check_against_dense(empty, torch.randn(2, 4, 2, 3, 3, dtype=torch.float64), path)
        assert layer(torch.randn(0, 4, 2, 3, 5, dtype=torch.float64)).shape == (0, 3, 5, 7, 11)


@pytest.mark.parametrize("path", PATHS)
def test_output_size_picks_among_the_sizes_a_strided_layer_gives(path):
    layer = _layer(4, 2, dict(kernel_size=3, stride=(3, 2, 1), padding=1))
    x = torch.randn(2, 4, 3, 4, 2, dtype=torch.float64)
    for size in ([7, 7, 2], [9, 8, 2], torch.Size([2, 2, 8, 7, 2])):
        _check_against_dense(layer, x, path, output_size=size)
    assert layer(x[0], [8, 8, 2]).shape == (2, 8, 8, 2)
    with pytest.raises(ValueError, match=r"output_size \(10, 7, 2\) is not one this layer gives .* from \(7, 7, 2\)"):
        layer(x, [10, 7, 2])
    with pytest.raises(ValueError, match=r"output_size must be \(D_out, H_out, W_out\)"):
        layer(x, [7, 7])


def test_a_full_layer_runs_dense_math_and_a_forced_backend_does_not(monkeypatch):
    layer = _layer(3, 4, dict(kernel_size=3, stride=2, padding=1, output_padding=1), sparsity=0.0)
    dense_calls = []
    monkeypatch.setattr(F, "conv_transpose3d", lambda *a, **k: dense_calls.append(1) or torch.conv_transpose3d(*a))
    _check_against_dense(layer, torch.randn(2, 3, 3, 4, 2, dtype=torch.float64), "auto")
    assert dense_calls == [1, 1]  # the layer's and its dense twin's
    _check_against_dense(layer, torch.randn(2, 3, 3, 4, 2, dtype=torch.float64), "reference")
    assert dense_calls == [1, 1, 1]


def test_the_dispatch_takes_rows_where_they_are_faster(monkeypatch):
    calls = _direct_calls(monkeypatch)
    large_volume = _layer(8, 8, dict(kernel_size=3, stride=2, padding=1), sparsity=0.9, dtype=torch.float32)
    large_volume(torch.randn(2, 8, 8, 8, 8))
    assert calls == [1]
    # batch 1 on a 1x1x1 volume: 1 row of 8·27 columns holds fewer elements than the connections
    small_volume = _layer(8, 8, dict(kernel_size=3, stride=2), sparsity=0.5, dtype=torch.float32)
    small_volume(torch.randn(1, 8, 1, 1, 1))
    assert calls == [1]


def test_a_flattened_kernel_past_int32_takes_the_composite_path(monkeypatch):
    calls = _direct_calls(monkeypatch)
    monkeypatch.setattr(snack.nn.plane, "_INT32_MAX", 100)  # (as a huge output's kernel would)
    layer = _layer(4, 6, dict(kernel_size=3, stride=2, padding=1))
    _check_against_dense(layer, torch.randn(2, 4, 3, 4, 3, dtype=torch.float64), "direct")
    assert calls == [] and layer._flattened_cache is None


@pytest.mark.parametrize("path", ["direct", "reference"])
def test_gradcheck_and_gradgradcheck(path):
    layer = _layer(4, 4, dict(kernel_size=(3, 2, 3), stride=(2, 1, 2), padding=(1, 0, 1), output_padding=(1, 0, 0),
                              groups=2))  # fmt: skip
    x = torch.randn(2, 4, 2, 2, 3, dtype=torch.float64)

    def conv(x, values, bias):
        with _on_path(path):
            return torch.func.functional_call(layer, {"values": values, "bias": bias}, (x,))

    inputs = [t.detach().clone().requires_grad_() for t in (x, layer.values, layer.bias)]
    assert torch.autograd.gradcheck(conv, inputs)
    assert torch.autograd.gradgradcheck(conv, inputs)


def test_float32_half_precision_and_autocast():
    layer = _layer(4, 6, dict(kernel_size=4, stride=2, padding=1), dtype=torch.float32)
    x = torch.randn(2, 4, 3, 4, 3)
    torch.testing.assert_close(layer(x), _dense_twin(layer)(x), atol=1e-5, rtol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 6, 6, 8, 6)
    half = copy.deepcopy(layer).to(torch.bfloat16)
    half(x.bfloat16()).float().square().sum().backward()
    assert half.values.grad.dtype == torch.bfloat16 and half.values.grad.abs().sum() > 0


def test_constructors_conversion_and_round_trips():
    dense = nn.ConvTranspose3d(4, 6, (3, 2, 3), stride=2, padding=1, output_padding=1, groups=2).double()
    layer = snack.SparseConvTranspose3d.from_dense(dense, sparsity=0.7)
    assert (layer.in_features, layer.out_features) == (3 * 3 * 2 * 3, 4) and layer.bias.shape == (6,)
    assert layer.nnz == round(0.3 * dense.weight.numel())
    kept = layer.to_dense() != 0
    assert layer.to_dense().shape == dense.weight.shape
    torch.testing.assert_close(layer.to_dense()[kept], dense.weight[kept])
    from_weight = snack.SparseConvTranspose3d.from_dense(dense.weight * kept, bias=dense.bias, stride=2, padding=1,
                                                         output_padding=1, groups=2)  # fmt: skip
    x = torch.randn(2, 4, 3, 3, 2, dtype=torch.float64)
    torch.testing.assert_close(from_weight(x), layer(x))
    loaded = snack.SparseConvTranspose3d(4, 6, (3, 2, 3), stride=2, padding=1, output_padding=1, groups=2,
                                         dtype=torch.float64)  # fmt: skip
    loaded.load_state_dict(layer.state_dict())
    torch.testing.assert_close(loaded(x), layer(x))
    torch.testing.assert_close(pickle.loads(pickle.dumps(layer))(x), layer(x))
    torch.testing.assert_close(copy.deepcopy(layer)(x), layer(x))
    assert "SparseConvTranspose3d(4, 6, kernel_size=(3, 2, 3), stride=(2, 2, 2), padding=(1, 1, 1)" in repr(layer)
    back = snack.densify(layer)
    assert type(back) is nn.ConvTranspose3d and back.output_padding == (1, 1, 1) and back.groups == 2
    torch.testing.assert_close(back(x), layer(x))


def test_bad_arguments_and_inputs_are_refused_with_clear_errors():
    with pytest.raises(ValueError, match=r"kernel_size must be a positive int or a tuple of 3 of them, got \(3, 3\)"):
        snack.SparseConvTranspose3d(2, 2, (3, 3))
    with pytest.raises(ValueError, match=r"output_padding must be smaller than the stride or the dilation"):
        snack.SparseConvTranspose3d(2, 2, 3, stride=2, output_padding=2)
    with pytest.raises(ValueError, match=r"padding_mode must be 'zeros'"):
        snack.SparseConvTranspose3d(2, 2, 3, padding_mode="reflect")
    with pytest.raises(ValueError, match=r"groups must divide in_channels and out_channels"):
        snack.SparseConvTranspose3d(4, 3, 3, groups=2)
    with pytest.raises(ValueError, match=r"a weight must be \(in_channels, out_channels / groups, kd, kh, kw\)"):
        snack.SparseConvTranspose3d.from_dense(torch.randn(2, 2, 3, 3))
    with pytest.raises(TypeError, match=r"must be an nn.ConvTranspose3d or a Tensor, got Conv3d"):
        snack.SparseConvTranspose3d.from_dense(nn.Conv3d(2, 2, 3))
    layer = snack.SparseConvTranspose3d(2, 3, 3, padding=2)
    before = (layer.row.clone(), layer.col.clone(), layer.values.detach().clone())
    with pytest.raises(ValueError, match=r"must have shape \(N, 2, D, H, W\) or \(2, D, H, W\), got \(1, 2, 4, 4\)"):
        layer(torch.randn(1, 2, 4, 4))
    with pytest.raises(ValueError, match=r"the input is too small for the padding"):
        layer(torch.randn(1, 2, 1, 4, 4))
    assert all(torch.equal(a, b) for a, b in zip(before, (layer.row, layer.col, layer.values)))


def test_sparsify_and_densify_convert_3d_decoders():
    model = nn.Sequential(nn.Conv3d(2, 8, 3, stride=2, padding=1), nn.ReLU(),
                          nn.ConvTranspose3d(8, 4, 2, stride=2), nn.ReLU(), nn.Conv3d(4, 2, 1))  # fmt: skip
    x = torch.randn(2, 2, 4, 6, 4)
    snack.sparsify(model, 0.8, distribution="erk")
    assert isinstance(model[2], snack.SparseConvTranspose3d) and model(x).shape == (2, 2, 4, 6, 4)
    sparse_out = model(x)
    snack.densify(model)
    assert type(model[2]) is nn.ConvTranspose3d and model[2].stride == (2, 2, 2)
    torch.testing.assert_close(model(x), sparse_out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", ["direct", "reference"])
def test_rigl_grows_by_the_weight_gradient(path):
    layer = _layer(6, 8, dict(kernel_size=3, stride=2, padding=1, output_padding=1, groups=2), sparsity=0.6)
    capture = GradientCapture([layer])
    capture.arm()
    x = torch.randn(2, 6, 2, 3, 2, dtype=torch.float64)
    with _on_path(path):
        layer(x).square().sum().backward()
    x_kept, dy_rows = capture.batch(0)
    capture.disarm()
    assert x_kept.shape[1] == 8 and dy_rows.shape == (2 * 2 * 3 * 2, 6)  # the roles swapped
    dense = _dense_twin(layer)
    dense(x).square().sum().backward()
    scores = dense.weight.grad.abs().flatten()
    scores[linear_index(layer.topology)] = -1
    for k in (1, 9, layer.out_features * layer.in_features - layer.nnz):
        expected = scores.topk(k).indices.sort().values
        for recorded in (x_kept, layer._rows_of_record(x_kept)):
            grown = gradient_grow(recorded, dy_rows, layer.topology, k, block_elements=layer.in_features,
                                  convolution=layer)  # fmt: skip
            assert torch.equal(grown, expected)


def test_rigl_trains_a_small_3d_decoder():
    model = nn.Sequential(snack.SparseConv3d(2, 8, 3, stride=2, padding=1, sparsity=0.5), nn.ReLU(),
                          snack.SparseConvTranspose3d(8, 8, 3, stride=2, padding=1, output_padding=1, sparsity=0.6),
                          nn.ReLU(),
                          snack.SparseConvTranspose3d(8, 2, 3, padding=1, groups=2, sparsity=0.5))  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dst = snack.dst.RigL(model, opt, drop_fraction=0.3, update_every=2, total_steps=12, schedule="constant")
    transposed = [model[2], model[4]]
    before = [(m.row.clone(), m.col.clone(), m.nnz) for m in transposed]
    for _ in range(6):
        volume = torch.randn(2, 2, 4, 6, 4)
        loss = F.mse_loss(model(volume), volume)
        opt.zero_grad()
        loss.backward()
        opt.step()
        dst.step()
    for (row, col, nnz), layer in zip(before, transposed):
        assert layer.nnz == nnz and not (torch.equal(row, layer.row) and torch.equal(col, layer.col))
        _check_against_dense(layer.double(), torch.randn(2, layer.in_channels, 3, 2, 3, dtype=torch.float64), "auto")


def test_tracing_compiling_and_torch_func():
    layer = snack.SparseConvTranspose3d(4, 6, 3, stride=2, padding=1, groups=2, sparsity=0.5)
    model = nn.Sequential(layer, nn.ReLU())
    x = torch.randn(2, 4, 3, 4, 3)
    expected = model(x)
    torch.testing.assert_close(torch.fx.symbolic_trace(model)(x), expected, atol=1e-6, rtol=1e-5)
    root = torch.fx.symbolic_trace(model[0], concrete_args={"output_size": None})
    for inp in (x, torch.randn(1, 4, 2, 5, 3)):  # the program computes the output size from the input's
        torch.testing.assert_close(root(inp), model[0](inp), atol=1e-6, rtol=1e-5)
    traced = torch.jit.trace(model, x)
    torch.testing.assert_close(traced(x), expected, atol=1e-6, rtol=1e-5)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), expected, atol=1e-6, rtol=1e-5)
    params = {"values": layer.values.detach(), "bias": layer.bias.detach()}

    def loss(params, sample):
        return torch.func.functional_call(layer, params, (sample,)).square().sum()

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    torch.testing.assert_close(per_sample["values"][1], torch.func.grad(loss)(params, x[1])["values"])


@pytest.mark.parametrize("path", PATHS)
def test_no_dense_weight_in_a_training_step(path):
    with LargestTensorMode() as mode, _on_path(path):
        layer = snack.SparseConvTranspose3d(256, 64, 3, stride=2, padding=1, output_padding=1, sparsity=0.95)
        x = torch.randn(1, 256, 2, 2, 2, requires_grad=True)
        layer(x).square().sum().backward()
        torch.optim.Adam(layer.parameters()).step()
    assert layer.values.grad is not None and x.grad is not None
    weight = 256 * 64 * 27
    assert mode.largest < weight // 4, f"{mode.largest_op} produced {mode.largest} elements"
