"""SparseConvTranspose2d against nn.ConvTranspose2d (and SparseConvTranspose1d against
nn.ConvTranspose1d): forward and every gradient on every path (direct kernels, im2col/fold, a full
layer), output sizes, constructors and conversion, RigL's growth by the weight gradient, tracing,
and the truly-sparse guarantee."""

from __future__ import annotations

import copy
import io
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
from tests.test_conv import _check_against_dense as _check_conv_against_dense
from tests.test_conv import _dense_twin, _on_path
from tests.test_nn import compiled_graphs_through_set_updates
from tests.test_truly_sparse import LargestTensorMode

# the direct kernels (a forced CPU backend runs them as they are), im2col columns folded (on the
# reference ops), and whatever the layer picks
PATHS = ["direct", "reference", "auto"]

# (in_channels, out_channels, geometry)
GEOMETRIES = [
    (4, 6, dict(kernel_size=3)),
    (4, 6, dict(kernel_size=3, stride=2, padding=1, output_padding=1)),  # a U-Net's 2x upsampling
    (3, 5, dict(kernel_size=4, stride=2, padding=1)),  # a DCGAN generator's
    (4, 6, dict(kernel_size=(3, 2), stride=(2, 3), padding=(1, 0), output_padding=(1, 2), groups=2)),
    (6, 4, dict(kernel_size=3, padding=1, output_padding=1, dilation=2, groups=2)),  # output_padding >= stride
    (6, 6, dict(kernel_size=3, stride=2, padding=1, groups=6)),  # depthwise
    (5, 3, dict(kernel_size=1)),
    (2, 3, dict(kernel_size=3, stride=(1, 3), dilation=(2, 1))),
]


def _layer(in_channels, out_channels, geometry, sparsity=0.5, dtype=torch.float64):
    return snack.SparseConvTranspose2d(in_channels, out_channels, sparsity=sparsity, dtype=dtype, **geometry)


def _check_against_dense(layer, x, path, output_size=None):
    _check_conv_against_dense(layer, x, path, forward=lambda module, inp: module(inp, output_size))


def _direct_calls(monkeypatch) -> list[int]:
    """A list that gains a 1 at each call of the direct kernels (``direct_conv_transpose2d``)."""
    calls = []
    original = snack.backends.cpu.conv.direct_conv_transpose2d

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(snack.backends.cpu.conv, "direct_conv_transpose2d", spy)
    return calls


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", GEOMETRIES, ids=str)
def test_matches_nn_conv_transpose2d_forward_and_gradients(case, path, monkeypatch):
    layer = _layer(*case)
    calls = _direct_calls(monkeypatch)
    _check_against_dense(layer, torch.randn(3, case[0], 5, 4, dtype=torch.float64), path)
    assert (calls == [1]) if path == "direct" else (path == "auto" or calls == [])


@settings(max_examples=30, deadline=None)
@given(
    per_group=st.tuples(st.integers(1, 3), st.integers(1, 3)),  # input and output channels of a group
    groups=st.integers(1, 3),
    kernel=st.tuples(st.integers(1, 4), st.integers(1, 3)),
    stride=st.tuples(st.integers(1, 3), st.integers(1, 2)),
    dilation=st.tuples(st.integers(1, 2), st.integers(1, 3)),
    padding=st.tuples(st.integers(0, 2), st.integers(0, 1)),
    extra=st.tuples(st.integers(0, 2), st.integers(0, 2)),  # output padding, cut to what is allowed
    sparsity=st.sampled_from([0.0, 0.3, 0.8, 0.99]),
    batch=st.integers(1, 18),  # past 16: sample groups of the kernels' folded layout
    size=st.tuples(st.integers(1, 6), st.integers(1, 5)),
    path=st.sampled_from(PATHS),
    seed=st.integers(0, 2**16),
)
def test_random_geometries(per_group, groups, kernel, stride, dilation, padding, extra, sparsity, batch, size, path,
                           seed):  # fmt: skip
    torch.manual_seed(seed)
    output_padding = tuple(min(e, max(s, d) - 1) for e, s, d in zip(extra, stride, dilation))
    smallest = [(n - 1) * s - 2 * p + d * (k - 1) + 1 for n, s, p, d, k in zip(size, stride, padding, dilation, kernel)]
    if min(smallest) < 1:
        return  # no output: the layer refuses it (test_bad_inputs_are_refused_with_clear_errors)
    ci, co = per_group
    layer = snack.SparseConvTranspose2d(ci * groups, co * groups, kernel, stride, padding, output_padding, groups,
                                        dilation=dilation, sparsity=sparsity, dtype=torch.float64)  # fmt: skip
    _check_against_dense(layer, torch.randn(batch, ci * groups, *size, dtype=torch.float64), path)


@pytest.mark.parametrize("path", PATHS)
def test_batch_one_unbatched_empty_channels_and_no_connections(path):
    # input channel 1 and output channel 2 have no connection (its output is the bias alone)
    row, col = torch.tensor([0, 0, 2, 3]), torch.tensor([0, 13, 4, 8])
    layer = snack.SparseConvTranspose2d.from_coo(row, col, torch.randn(4, dtype=torch.float64), (4, 3, 3, 3),
                                                 bias=torch.randn(3, dtype=torch.float64), stride=2)  # fmt: skip
    assert (layer.in_channels, layer.out_channels) == (4, 3)
    _check_against_dense(layer, torch.randn(1, 4, 3, 5, dtype=torch.float64), path)
    x = torch.randn(4, 3, 5, dtype=torch.float64)
    with _on_path(path):
        torch.testing.assert_close(layer(x), _dense_twin(layer)(x))
        empty = snack.SparseConvTranspose2d.from_coo(row[:0], col[:0], torch.zeros(0, dtype=torch.float64),
                                                     (4, 3, 3, 3), stride=2)  # fmt: skip
        assert empty.nnz == 0
        _check_against_dense(empty, torch.randn(2, 4, 3, 3, dtype=torch.float64), path)
        assert layer(torch.randn(0, 4, 3, 5, dtype=torch.float64)).shape == (0, 3, 7, 11)


@pytest.mark.parametrize("path", PATHS)
def test_output_size_picks_among_the_sizes_a_strided_layer_gives(path):
    layer = _layer(4, 2, dict(kernel_size=3, stride=3, padding=1))
    x = torch.randn(2, 4, 3, 4, dtype=torch.float64)
    for size in ([7, 10], [9, 12], torch.Size([2, 2, 8, 11])):
        _check_against_dense(layer, x, path, output_size=size)
    assert layer(x[0], [8, 11]).shape == (2, 8, 11)
    with pytest.raises(ValueError, match=r"output_size \(10, 10\) is not one this layer gives .* from \(7, 10\) to"):
        layer(x, [10, 10])
    with pytest.raises(ValueError, match=r"output_size must be \(H_out, W_out\)"):
        layer(x, [7])


def test_a_full_layer_runs_dense_math_and_a_forced_backend_does_not(monkeypatch):
    layer = _layer(3, 4, dict(kernel_size=3, stride=2, padding=1, output_padding=1), sparsity=0.0)
    assert layer.nnz == layer.in_features * layer.out_features
    dense_calls = []
    monkeypatch.setattr(F, "conv_transpose2d", lambda *a, **k: dense_calls.append(1) or torch.conv_transpose2d(*a))
    _check_against_dense(layer, torch.randn(2, 3, 4, 4, dtype=torch.float64), "auto")
    assert dense_calls == [1, 1]  # the layer's and its dense twin's
    _check_against_dense(layer, torch.randn(2, 3, 4, 4, dtype=torch.float64), "reference")
    assert dense_calls == [1, 1, 1]


def test_the_dispatch_takes_rows_where_they_are_faster(monkeypatch):
    calls = _direct_calls(monkeypatch)
    large_planes = _layer(8, 8, dict(kernel_size=3, stride=2), sparsity=0.9, dtype=torch.float32)
    large_planes(torch.randn(2, 8, 16, 16))
    assert calls == [1]
    # batch 1 on a 1x1 plane: 1 row of 8·3·3 columns holds fewer elements than the connections
    small_plane = _layer(8, 8, dict(kernel_size=3, stride=2), sparsity=0.5, dtype=torch.float32)
    small_plane(torch.randn(1, 8, 1, 1))
    assert calls == [1]


@pytest.mark.parametrize("path", ["direct", "reference"])
def test_gradcheck_and_gradgradcheck(path):
    layer = _layer(4, 4, dict(kernel_size=3, stride=2, padding=1, output_padding=1, groups=2))
    x = torch.randn(2, 4, 3, 2, dtype=torch.float64)

    def conv(x, values, bias):
        with _on_path(path):
            return torch.func.functional_call(layer, {"values": values, "bias": bias}, (x,))

    inputs = [t.detach().clone().requires_grad_() for t in (x, layer.values, layer.bias)]
    assert torch.autograd.gradcheck(conv, inputs)
    assert torch.autograd.gradgradcheck(conv, inputs)


def test_float32_and_training_under_autocast_match_the_dense_layer():
    layer = _layer(4, 6, dict(kernel_size=4, stride=2, padding=1), dtype=torch.float32)
    dense = _dense_twin(layer)
    x = torch.randn(2, 4, 5, 5)
    torch.testing.assert_close(layer(x), dense(x), atol=1e-5, rtol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_dense = layer(x), dense(x)
        assert y.dtype == y_dense.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), y_dense.float(), atol=0.05, rtol=0.05)
    y.float().square().sum().backward()
    assert layer.values.grad.dtype == torch.float32 and layer.values.grad.abs().sum() > 0
    with pytest.raises(TypeError, match=r"SparseConvTranspose2d: input dtype torch.float64 does not match"):
        layer(x.double())


@pytest.mark.parametrize("path", PATHS)
def test_channels_last_sliced_transposed_and_inference_mode_inputs(path):
    layer = _layer(4, 6, dict(kernel_size=3, stride=2, padding=1, output_padding=1, groups=2))
    dense = _dense_twin(layer)
    x = torch.randn(2, 4, 5, 10, dtype=torch.float64)
    inputs = [x.to(memory_format=torch.channels_last), x[..., ::2], x[..., :5].transpose(2, 3)]
    with _on_path(path):
        for inp in inputs:
            torch.testing.assert_close(layer(inp), dense(inp))
        with torch.inference_mode():
            torch.testing.assert_close(layer(inputs[0]), dense(inputs[0]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_layers_train(dtype):
    layer = _layer(4, 6, dict(kernel_size=4, stride=2, padding=1), dtype=dtype)
    dense = _dense_twin(copy.deepcopy(layer).float())
    x = torch.randn(2, 4, 5, 5)
    y = layer(x.to(dtype).requires_grad_())
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), dense(x.to(dtype).float()), atol=0.05, rtol=0.05)
    y.float().square().sum().backward()
    assert layer.values.grad.dtype == dtype and layer.values.grad.abs().sum() > 0


def test_constructors_conversion_and_round_trips():
    dense = nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2, dilation=1)
    layer = snack.SparseConvTranspose2d.from_dense(dense, sparsity=0.6)
    assert layer.to_dense().shape == dense.weight.shape == (4, 3, 3, 3)
    assert layer.nnz == round(0.4 * dense.weight.numel()) and layer.bias.shape == (6,)
    kept = dense.weight.detach().reshape(4, -1)[layer.row.long(), layer.col.long()]
    torch.testing.assert_close(layer.values.detach(), kept)
    of_tensor = snack.SparseConvTranspose2d.from_dense(dense.weight.detach(), sparsity=0.6, bias=dense.bias.detach(),
                                                       stride=2, padding=1, output_padding=1, groups=2)  # fmt: skip
    x = torch.randn(2, 4, 5, 5)
    torch.testing.assert_close(of_tensor(x), layer(x))
    order = torch.randperm(layer.nnz)  # in any order
    of_coo = snack.SparseConvTranspose2d.from_coo(layer.row[order], layer.col[order], layer.values.detach()[order],
                                                  (4, 3, 3, 3), bias=dense.bias, stride=2, padding=1, output_padding=1,
                                                  groups=2)  # fmt: skip
    torch.testing.assert_close(of_coo(x), layer(x))
    assert "4, 6, kernel_size=(3, 3), stride=(2, 2), padding=(1, 1), output_padding=(1, 1), groups=2" in repr(layer)
    for copied in (pickle.loads(pickle.dumps(layer)), copy.deepcopy(layer)):
        torch.testing.assert_close(copied(x), layer(x))
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    other = snack.SparseConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2, sparsity=0.9)
    other.load_state_dict(torch.load(io.BytesIO(buffer.getvalue())))
    assert other.nnz == layer.nnz
    torch.testing.assert_close(other(x), layer(x))
    with pytest.raises(AttributeError, match=r"builds the \(in_channels, out_channels / groups, kh, kw\) weight"):
        layer.weight


def test_bad_arguments_and_inputs_are_refused_with_clear_errors():
    cases = [
        (dict(padding_mode="reflect"), r"padding_mode must be 'zeros'"),
        (dict(padding="same"), r"padding must be an int or a pair"),
        (dict(stride=2, output_padding=2), r"output_padding must be smaller than the stride or the dilation"),
        (dict(groups=4), r"groups must divide in_channels and out_channels"),
        (dict(kernel_size=0), r"kernel_size must be a positive int"),
    ]
    for changes, message in cases:
        with pytest.raises(ValueError, match=message):
            snack.SparseConvTranspose2d(**{"in_channels": 4, "out_channels": 6, "kernel_size": 3, **changes})
    with pytest.raises(TypeError, match=r"SparseConvTranspose2d: bias must be a bool, got float 0.5"):
        snack.SparseConvTranspose2d(4, 6, 3, 1, 0, 0, 1, 0.5)
    layer = snack.SparseConvTranspose2d(4, 6, 3, padding=2)
    with pytest.raises(ValueError, match=r"input must have shape \(N, 4, H, W\) or \(4, H, W\), got \(2, 3, 5, 5\)"):
        layer(torch.randn(2, 3, 5, 5))
    with pytest.raises(ValueError, match=r"the output of an input of \(1, 1\) would be \(-1, -1\)"):
        layer(torch.randn(2, 4, 1, 1))
    with pytest.raises(ValueError, match=r"bias must be a tensor of shape \(6,\)"):
        snack.SparseConvTranspose2d.from_dense(torch.randn(4, 6, 3, 3), bias=torch.randn(4))
    with pytest.raises(ValueError, match=r"must not be given with an nn.ConvTranspose2d"):
        snack.SparseConvTranspose2d.from_dense(nn.ConvTranspose2d(4, 6, 3), stride=2)
    before = (layer.row.clone(), layer.values.detach().clone(), layer.bias.detach().clone())
    with pytest.raises(RuntimeError, match=r"bias must be a tensor of shape \(6,\), got \(4,\)"):
        layer.load_state_dict({**layer.state_dict(), "bias": torch.zeros(4)})
    assert all(torch.equal(a, b) for a, b in zip(before, (layer.row, layer.values, layer.bias)))


def test_sparsify_and_densify_convert_transposed_convolutions():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(),
                          nn.ConvTranspose2d(8, 4, 4, stride=2, padding=1), nn.ReLU())  # fmt: skip
    x = torch.randn(2, 3, 8, 8)
    snack.sparsify(model, 0.8, distribution="erk")
    assert isinstance(model[2], snack.SparseConvTranspose2d) and model[2].bias.shape == (4,)
    y = model(x)
    snack.densify(model)
    assert type(model[2]) is nn.ConvTranspose2d and model[2].weight.shape == (8, 4, 4, 4)
    torch.testing.assert_close(model(x), y, atol=1e-6, rtol=1e-5)
    randomly = snack.sparsify(nn.Sequential(nn.ConvTranspose2d(8, 4, 3, groups=2, bias=False)), 0.5, init="random")
    assert randomly[0].groups == 2 and randomly[0].bias is None and randomly[0].nnz == 8 * 2 * 9 // 2


@pytest.mark.parametrize("path", ["direct", "reference"])
def test_rigl_grows_by_the_weight_gradient(path):
    layer = _layer(6, 8, dict(kernel_size=3, stride=2, padding=1, output_padding=1, groups=2), sparsity=0.6)
    capture = GradientCapture([layer])
    capture.arm()
    x = torch.randn(3, 6, 4, 5, dtype=torch.float64)
    with _on_path(path):
        layer(x).square().sum().backward()
    x_kept, dy_rows = capture.batch(0)
    capture.disarm()
    assert x_kept.shape[1] == 8 and dy_rows.shape == (3 * 4 * 5, 6)  # the roles swapped
    dense = _dense_twin(layer)
    dense(x).square().sum().backward()
    scores = dense.weight.grad.abs().flatten()
    scores[linear_index(layer.topology)] = -1
    rows = layer._rows_of_record(x_kept)
    for k in (1, 9, layer.out_features * layer.in_features - layer.nnz):
        expected = scores.topk(k).indices.sort().values
        for block_elements in (1 << 20, layer.in_features):
            for recorded in (x_kept, rows):
                grown = gradient_grow(recorded, dy_rows, layer.topology, k, block_elements=block_elements,
                                      convolution=layer)  # fmt: skip
                assert torch.equal(grown, expected)


@pytest.mark.parametrize("sizes", [(4,), (3, 5)], ids=["padded gradient", "rows"])
def test_rigl_trains_a_small_decoder(sizes):
    model = nn.Sequential(snack.SparseConv2d(2, 8, 3, stride=2, padding=1, sparsity=0.5), nn.ReLU(),
                          snack.SparseConvTranspose2d(8, 8, 3, stride=2, padding=1, output_padding=1, sparsity=0.6),
                          nn.ReLU(),
                          snack.SparseConvTranspose2d(8, 2, 3, padding=1, groups=2, sparsity=0.5))  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dst = snack.dst.RigL(model, opt, drop_fraction=0.3, update_every=2, total_steps=12, schedule="constant")
    transposed = [model[2], model[4]]
    before = [(m.row.clone(), m.col.clone(), m.nnz) for m in transposed]
    for _ in range(6):
        images = [torch.randn(4, 2, 2 * s, 2 * s) for s in sizes]
        loss = sum(F.mse_loss(model(image), image) for image in images)
        opt.zero_grad()
        loss.backward()
        opt.step()
        dst.step()
    for (row, col, nnz), layer in zip(before, transposed):
        assert layer.nnz == nnz and not (torch.equal(row, layer.row) and torch.equal(col, layer.col))
        assert int(layer.col.max()) < layer.in_features
        _check_against_dense(layer.double(), torch.randn(2, layer.in_channels, 3, 3, dtype=torch.float64), "auto")


def test_tracing_compiling_exporting_and_torch_func():
    model = nn.Sequential(snack.SparseConvTranspose2d(4, 6, 3, stride=2, padding=1, groups=2, sparsity=0.5), nn.ReLU())
    x = torch.randn(2, 4, 5, 5)
    expected = model(x)
    torch.testing.assert_close(torch.fx.symbolic_trace(model)(x), expected)
    # the layer itself, as nn.ConvTranspose2d: with output_size fixed to None (the program then
    # computes the output's size from the input's)
    root = torch.fx.symbolic_trace(model[0], concrete_args={"output_size": None})
    for inp in (x, torch.randn(3, 4, 6, 3)):
        torch.testing.assert_close(root(inp), model[0](inp))
    assert "fx_sparse_linear_transposed" in root.code
    with pytest.raises(NotImplementedError, match=r"concrete_args=\{'output_size': None\}"):
        torch.fx.symbolic_trace(model[0])
    traced = torch.jit.trace(model, x)
    torch.testing.assert_close(traced(x), expected, atol=1e-6, rtol=1e-5)
    other_size = torch.randn(3, 4, 6, 7)  # the program computes the output size from the input's
    torch.testing.assert_close(traced(other_size), model(other_size), atol=1e-6, rtol=1e-5)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), expected, atol=1e-6, rtol=1e-5)
    exported = torch.export.export(model, (x,)).module()
    torch.testing.assert_close(exported(x), expected, atol=1e-6, rtol=1e-5)
    layer = model[0]
    other = snack.SparseConvTranspose2d(4, 6, 3, stride=2, padding=1, groups=2, sparsity=0.2)
    layer.set_topology(other.row, other.col, other.values.detach())  # compiled code follows a rewire
    rewired = F.relu(F.conv_transpose2d(x, layer.to_dense(), layer.bias, 2, 1, 0, 2))
    torch.testing.assert_close(compiled(x), rewired, atol=1e-6, rtol=1e-5)
    assert compiled_graphs_through_set_updates(model, x) == 1
    params = {"values": layer.values.detach(), "bias": layer.bias.detach()}

    def loss(params, sample):
        return torch.func.functional_call(layer, params, (sample,)).square().sum()

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    torch.testing.assert_close(per_sample["values"][1], torch.func.grad(loss)(params, x[1])["values"])


@pytest.mark.parametrize("path", PATHS)
def test_no_dense_weight_in_a_training_step(path):
    with LargestTensorMode() as mode, _on_path(path):
        layer = snack.SparseConvTranspose2d(512, 64, 3, stride=2, padding=1, sparsity=0.95)
        x = torch.randn(1, 512, 2, 2, requires_grad=True)
        layer(x).square().sum().backward()
        torch.optim.Adam(layer.parameters()).step()
    assert layer.values.grad is not None and x.grad is not None
    weight = 512 * 64 * 9
    assert mode.largest < weight // 4, f"{mode.largest_op} produced {mode.largest} elements"


# ---------------------------------------------------------------- SparseConvTranspose1d


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "geometry",
    [dict(kernel_size=3), dict(kernel_size=4, stride=2, padding=1), dict(kernel_size=16, stride=8, padding=4),
     dict(kernel_size=3, stride=2, padding=1, output_padding=1, groups=2), dict(kernel_size=3, dilation=3, padding=2,
     output_padding=2)],
    ids=str,
)  # fmt: skip
def test_conv_transpose1d_matches_nn_conv_transpose1d(geometry, path):
    layer = snack.SparseConvTranspose1d(4, 6, sparsity=0.5, dtype=torch.float64, **geometry)
    assert layer.to_dense().shape == (4, 6 // layer.groups, layer.kernel_size[0])
    x = torch.randn(3, 4, 7, dtype=torch.float64)
    _check_against_dense(layer, x, path)
    with _on_path(path):
        torch.testing.assert_close(layer(x[0]), _dense_twin(layer)(x[0]))  # unbatched


def test_fx_traces_transposed_layers_themselves_and_in_models():
    for layer in (snack.SparseConvTranspose2d(4, 6, 3, padding=1, output_padding=1, dilation=2, sparsity=0.5),
                  snack.SparseConvTranspose1d(4, 6, 4, stride=2, padding=1, groups=2, sparsity=0.5)):  # fmt: skip
        root = torch.fx.symbolic_trace(layer, concrete_args={"output_size": None})
        held = torch.fx.symbolic_trace(nn.Sequential(layer, nn.ReLU()))
        sizes = [(2, 4, 5, 6), (1, 4, 3, 9)] if layer._dims == 2 else [(2, 4, 5), (1, 4, 9)]
        for size in sizes:
            x = torch.randn(size)
            torch.testing.assert_close(root(x), layer(x))
            torch.testing.assert_close(held(x), F.relu(layer(x)))


def test_conv_transpose1d_output_size_errors_conversion_and_rigl():
    layer = snack.SparseConvTranspose1d(4, 2, 3, stride=3, padding=1, sparsity=0.5, dtype=torch.float64)
    x = torch.randn(2, 4, 5, dtype=torch.float64)
    assert layer(x, [14]).shape == layer(x, (2, 2, 14)).shape == (2, 2, 14)
    with pytest.raises(ValueError, match=r"output_size \(16,\) is not one this layer gives for an input of "
                                         r"\(5,\): sizes range from \(13,\) to \(15,\)"):  # fmt: skip
        layer(x, [16])
    with pytest.raises(ValueError, match=r"input must have shape \(N, 4, L\) or \(4, L\), got \(2, 4, 5, 5\)"):
        layer(torch.randn(2, 4, 5, 5, dtype=torch.float64))
    model = snack.sparsify(nn.Sequential(nn.ConvTranspose1d(4, 6, 4, stride=2, padding=1, groups=2)), 0.5)
    assert isinstance(model[0], snack.SparseConvTranspose1d) and model[0].groups == 2
    y = model(x.float())
    assert type(snack.densify(model)[0]) is nn.ConvTranspose1d
    torch.testing.assert_close(model(x.float()), y, atol=1e-6, rtol=1e-5)
    # RigL's growth: the 1-D layer's records are a 2-D one's of height 1
    capture = GradientCapture([layer])
    capture.arm()
    layer(x).square().sum().backward()
    x_kept, dy_rows = capture.batch(0)
    capture.disarm()
    dense = _dense_twin(layer)
    dense(x).square().sum().backward()
    scores = dense.weight.grad.abs().flatten()
    scores[linear_index(layer.topology)] = -1
    expected = scores.topk(5).indices.sort().values
    for recorded in (x_kept, layer._rows_of_record(x_kept)):
        assert torch.equal(gradient_grow(recorded, dy_rows, layer.topology, 5, convolution=layer), expected)
