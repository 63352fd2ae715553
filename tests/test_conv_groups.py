"""Grouped and depthwise SparseConv2d / SparseConv1d against nn.Conv2d / nn.Conv1d with the same
groups: forward and every gradient on every path, constructors, conversion, rewiring, RigL's growth
within the groups, tracing, and the truly-sparse guarantee."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import snack
from snack.dst.capture import GradientCapture
from snack.dst.prune_grow import gradient_grow, linear_index
from tests.test_conv import (
    PATHS, _check_against_dense, _dense_twin, _direct_calls, _gradcheck_and_gradgradcheck, _run,
)
from tests.test_nn import _serve_while, compiled_graphs_through_set_updates
from tests.test_truly_sparse import LargestTensorMode

# (in_channels, out_channels, groups, geometry)
GROUPED = [
    (4, 6, 2, dict(kernel_size=3, padding=1)),
    (6, 6, 6, dict(kernel_size=3, padding=1)),  # depthwise
    (4, 8, 4, dict(kernel_size=3, stride=2, padding=1)),  # depthwise, two outputs per channel
    (6, 9, 3, dict(kernel_size=(3, 2), stride=(2, 1), dilation=(1, 2), padding=(1, 2))),
    (8, 4, 4, dict(kernel_size=1)),  # two inputs per output
    (6, 6, 3, dict(kernel_size=3, padding=2, dilation=2, padding_mode="reflect")),
    (4, 4, 2, dict(kernel_size=(2, 4), padding="same", padding_mode="circular")),
]


def _grouped(in_channels, out_channels, groups, geometry, sparsity=0.5):
    return snack.SparseConv2d(in_channels, out_channels, groups=groups, sparsity=sparsity, dtype=torch.float64,
                              **geometry)  # fmt: skip


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", GROUPED, ids=str)
def test_matches_grouped_dense_conv_forward_and_gradients(case, path):
    layer = _grouped(*case)
    assert layer.in_features == case[0] // case[2] * layer.kernel_size[0] * layer.kernel_size[1]
    _check_against_dense(layer, torch.randn(3, case[0], 9, 7, dtype=torch.float64), path)


@settings(max_examples=30, deadline=None)
@given(
    per_group=st.tuples(st.integers(1, 3), st.integers(1, 3)),  # input and output channels of a group
    groups=st.integers(1, 5),
    kernel=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    stride=st.tuples(st.integers(1, 3), st.integers(1, 2)),
    dilation=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    padding=st.tuples(st.integers(0, 2), st.integers(0, 2)),
    sparsity=st.sampled_from([0.0, 0.3, 0.8, 0.99]),
    batch=st.integers(1, 18),  # past 16: sample groups of the folded layout
    path=st.sampled_from(PATHS),
    seed=st.integers(0, 2**16),
)
def test_random_grouped_geometries(per_group, groups, kernel, stride, dilation, padding, sparsity, batch, path, seed):
    torch.manual_seed(seed)
    (ci, co), (kh, kw), (dh, dw) = per_group, kernel, dilation
    layer = snack.SparseConv2d(ci * groups, co * groups, kernel, stride, padding, dilation, groups, sparsity=sparsity,
                               dtype=torch.float64)  # fmt: skip
    height, width = max(dh * (kh - 1) + 1, 5), max(dw * (kw - 1) + 1, 4)
    _check_against_dense(layer, torch.randn(batch, ci * groups, height, width, dtype=torch.float64), path)


@pytest.mark.parametrize("path", PATHS)
def test_batch_one_unbatched_empty_groups_and_no_connections(path):
    # output channels 2..3 (group 1) have no connection: bias only
    row, col = torch.tensor([0, 1, 1, 4, 5]), torch.tensor([0, 3, 17, 9, 1])
    layer = snack.SparseConv2d.from_coo(row, col, torch.randn(5, dtype=torch.float64), (6, 2, 3, 3), groups=3,
                                        bias=torch.randn(6, dtype=torch.float64), padding=1)  # fmt: skip
    assert layer.in_channels == 6
    _check_against_dense(layer, torch.randn(1, 6, 5, 4, dtype=torch.float64), path)
    x = torch.randn(6, 5, 5, dtype=torch.float64)
    torch.testing.assert_close(_run(layer, x, path), _dense_twin(layer)(x))
    empty = snack.SparseConv2d.from_coo(
        torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.float64),
        (4, 1, 3, 3), groups=4, bias=torch.randn(4, dtype=torch.float64),
    )  # fmt: skip
    _check_against_dense(empty, torch.randn(2, 4, 5, 5, dtype=torch.float64), path)


def test_full_grouped_layer_runs_dense_math(monkeypatch):
    calls = _direct_calls(monkeypatch)
    full = _grouped(4, 6, 2, dict(kernel_size=3, padding=1), sparsity=0.0)
    assert full.nnz == 6 * 2 * 9
    _check_against_dense(full, torch.randn(2, 4, 6, 5, dtype=torch.float64), "native")
    assert calls == []  # F.conv2d with the groups
    _check_against_dense(_grouped(4, 6, 2, dict(kernel_size=3)), torch.randn(2, 4, 6, 5, dtype=torch.float64),
                         "native")  # fmt: skip
    assert calls == [1]


@pytest.mark.parametrize("path", PATHS)
def test_gradcheck_and_gradgradcheck(path):
    layer = _grouped(4, 6, 2, dict(kernel_size=3, stride=2, padding=1))
    _gradcheck_and_gradgradcheck(layer, torch.randn(2, 4, 6, 5, dtype=torch.float64), path)


def test_training_under_autocast_matches_a_grouped_dense_convolution():
    layer = snack.SparseConv2d(4, 6, 3, padding=1, groups=2, sparsity=0.5)
    dense = _dense_twin(layer)
    x = torch.randn(2, 4, 7, 6, requires_grad=True)
    x_dense = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_dense = layer(x), dense(x_dense)
    y.float().square().sum().backward()
    y_dense.float().square().sum().backward()
    torch.testing.assert_close(y, y_dense, atol=0.05, rtol=0.02)
    torch.testing.assert_close(x.grad, x_dense.grad, atol=0.1, rtol=0.05)
    flat = dense.weight.grad.reshape(6, -1)[layer.row.long(), layer.col.long()]
    torch.testing.assert_close(layer.values.grad, flat, atol=0.2, rtol=0.05)


def test_constructors_conversion_and_round_trips():
    conv = nn.Conv2d(6, 9, 3, stride=2, padding=1, groups=3)
    layer = snack.SparseConv2d.from_dense(conv, sparsity=0.6)
    assert (layer.groups, layer.in_channels, layer.in_features) == (3, 6, 18)
    assert layer.nnz == round(0.4 * conv.weight.numel()) and layer.to_dense().shape == conv.weight.shape
    kept = layer.to_dense() != 0
    assert conv.weight.abs()[kept].min() >= conv.weight.abs()[~kept].max()
    x = torch.randn(2, 6, 8, 7)
    torch.testing.assert_close(snack.SparseConv2d.from_dense(conv)(x), conv(x), atol=1e-6, rtol=1e-5)
    weight = snack.SparseConv2d.from_dense(conv.weight.detach(), groups=3, stride=2, padding=1,
                                           bias=conv.bias.detach())  # fmt: skip
    torch.testing.assert_close(weight(x), conv(x), atol=1e-6, rtol=1e-5)
    assert "groups=3" in repr(layer)
    dense = snack.densify(layer)
    assert type(dense) is nn.Conv2d and dense.groups == 3 and torch.equal(dense.weight, layer.to_dense())
    for copied in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert copied.groups == 3 and torch.equal(copied(x), layer(x))
    state = layer.__getstate__()
    del state["_unfolded_cache"]  # as pickled before groups were supported
    old_pickle = snack.SparseConv2d.__new__(snack.SparseConv2d)
    old_pickle.__setstate__(state)
    assert torch.equal(old_pickle(x), layer(x))
    other = snack.SparseConv2d(6, 9, 3, stride=2, padding=1, groups=3, sparsity=0.9)
    other.load_state_dict(layer.state_dict())
    assert torch.equal(other(x), layer(x))
    for module in (layer.train(), layer.eval()):  # the random constructor and the 1-D layer, too
        torch.testing.assert_close(module(x), F.conv2d(x, layer.to_dense(), layer.bias, 2, 1, 1, 3))


def test_sparsify_converts_grouped_and_depthwise_convolutions():
    # a MobileNet-style block: ERK gives the depthwise kernel (few weights, many sides) the highest density
    net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.Conv2d(32, 32, 3, padding=1, groups=32),
                        nn.Conv2d(32, 64, 1), nn.Conv2d(64, 64, 3, groups=4), nn.Flatten(), nn.LazyLinear(10))
    x = torch.randn(2, 3, 6, 6)
    net(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = snack.sparsify(copy.deepcopy(net), 0.9, distribution="erk")
    assert [m.groups for m in model[:4]] == [1, 32, 1, 4]
    assert model[1].sparsity < min(m.sparsity for m in model if m is not model[1] and isinstance(m, snack.SparseLinear))
    assert model[3].sparsity > 0.9
    y = model(x)
    torch.testing.assert_close(snack.densify(model)(x), y, atol=1e-5, rtol=1e-5)
    uniform = snack.sparsify(copy.deepcopy(net), 0.5, init="random")
    assert uniform[1].groups == 32 and uniform[1].nnz == round(0.5 * 32 * 9)


def test_rewiring_follows_into_the_kernels_topology():
    layer = _grouped(4, 6, 2, dict(kernel_size=3, padding=1), sparsity=0.7)
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
    layer(x)
    unfolded = layer._unfolded_cache[1]
    assert unfolded.col.numel() == layer.nnz
    assert unfolded.col.data_ptr() in {t.data_ptr() for t in layer.index_tensors()}  # counted in its memory
    other = _grouped(4, 6, 2, dict(kernel_size=3, padding=1), sparsity=0.3)
    layer.set_topology(other.row, other.col, other.values.detach())
    _check_against_dense(layer, x, "native")
    same_nnz = _grouped(4, 6, 2, dict(kernel_size=3, padding=1), sparsity=0.3)
    layer.load_state_dict(same_nnz.state_dict())  # copied into row/col in place
    torch.testing.assert_close(layer(x), _dense_twin(same_nnz)(x))


@pytest.mark.parametrize("path", PATHS)
def test_rigl_grows_by_the_grouped_weight_gradient(path):
    layer = _grouped(8, 12, 4, dict(kernel_size=3, stride=2, padding=1), sparsity=0.6)
    capture = GradientCapture([layer])
    capture.arm()
    x = torch.randn(3, 8, 9, 7, dtype=torch.float64)
    _run(layer, x, path).square().sum().backward()
    x_kept, dy_rows = capture.batch(0)
    capture.disarm()
    dense = _dense_twin(layer)
    dense(x).square().sum().backward()
    scores = dense.weight.grad.abs().flatten()  # (out, in / groups · kh · kw): only positions inside the groups
    scores[linear_index(layer.topology)] = -1
    rows = layer._rows_of_record(x_kept)
    assert rows.shape[1] == 8 * 9
    for k in (1, 7, layer.out_features * layer.in_features - layer.nnz):
        expected = scores.topk(k).indices.sort().values
        # in one block, and a row per block (which also samples a bar from strided rows)
        for block_elements in (1 << 20, layer.in_features):
            for recorded in (x_kept, rows):
                grown = gradient_grow(recorded, dy_rows, layer.topology, k, block_elements=block_elements,
                                      convolution=layer)  # fmt: skip
                assert torch.equal(grown, expected)
    with pytest.raises(ValueError, match=r"a convolution's rows need convolution= the layer"):
        gradient_grow(rows, dy_rows, layer.topology, 3)


@pytest.mark.parametrize("sizes", [(6,), (5, 7)], ids=["padded input", "rows"])
def test_rigl_trains_a_grouped_cnn(sizes):
    model = nn.Sequential(snack.SparseConv2d(2, 8, 3, padding=1, sparsity=0.5), nn.ReLU(),
                          snack.SparseConv2d(8, 8, 3, padding=1, groups=8, sparsity=0.5), nn.ReLU(),
                          snack.SparseConv2d(8, 8, 1, groups=2, sparsity=0.7), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          snack.SparseLinear(8, 3, sparsity=0.3))  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dst = snack.dst.RigL(model, opt, drop_fraction=0.3, update_every=2, total_steps=12, schedule="constant")
    grouped = [model[2], model[4]]
    before = [(m.row.clone(), m.col.clone(), m.nnz) for m in grouped]
    for _ in range(6):
        loss = sum(F.cross_entropy(model(torch.randn(4, 2, s, s)), torch.randint(0, 3, (4,))) for s in sizes)
        opt.zero_grad()
        loss.backward()
        opt.step()
        dst.step()
    for (row, col, nnz), layer in zip(before, grouped):
        assert layer.nnz == nnz and not (torch.equal(row, layer.row) and torch.equal(col, layer.col))
        assert int(layer.col.max()) < layer.in_features  # within the groups
        _check_against_dense(layer.double(), torch.randn(2, 8, 5, 5, dtype=torch.float64), "native")


def test_grouped_conv1d_matches_nn_conv1d():
    layer = snack.SparseConv1d(6, 4, 3, stride=2, padding=1, groups=2, sparsity=0.5, dtype=torch.float64)
    assert layer.to_dense().shape == (4, 3, 3)
    for path in PATHS:
        _check_against_dense(layer, torch.randn(3, 6, 11, dtype=torch.float64), path)
    conv = nn.Conv1d(6, 6, 5, padding="same", groups=6)
    converted = snack.sparsify(nn.Sequential(conv), 0.4)[0]
    assert isinstance(converted, snack.SparseConv1d) and converted.groups == 6
    densified = snack.densify(copy.deepcopy(converted))
    x = torch.randn(2, 6, 9)
    assert densified.groups == 6 and torch.allclose(densified(x), converted(x), atol=1e-6)


def test_tracing_compiling_exporting_and_torch_func():
    model = nn.Sequential(snack.SparseConv2d(4, 6, 3, padding=1, groups=2, sparsity=0.5), nn.ReLU())
    x = torch.randn(2, 4, 6, 6)
    expected = model(x)
    torch.testing.assert_close(torch.fx.symbolic_trace(model)(x), expected)
    torch.testing.assert_close(torch.fx.symbolic_trace(model[0])(x), model[0](x))
    torch.testing.assert_close(torch.jit.trace(model, x)(x), expected, atol=1e-6, rtol=1e-5)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), expected, atol=1e-6, rtol=1e-5)
    exported = torch.export.export(model, (x,)).module()
    torch.testing.assert_close(exported(x), expected, atol=1e-6, rtol=1e-5)
    layer = model[0]
    other = snack.SparseConv2d(4, 6, 3, padding=1, groups=2, sparsity=0.2)
    layer.set_topology(other.row, other.col, other.values.detach())  # compiled code follows a rewire
    rewired = F.relu(F.conv2d(x, layer.to_dense(), layer.bias, 1, 1, 1, 2))
    torch.testing.assert_close(compiled(x), rewired, atol=1e-6, rtol=1e-5)
    params = {"values": layer.values.detach(), "bias": layer.bias.detach()}

    def loss(params, sample):
        return torch.func.functional_call(layer, params, (sample,)).square().sum()

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    torch.testing.assert_close(per_sample["values"][1], torch.func.grad(loss)(params, x[1])["values"])


def test_no_dense_weight_in_a_training_step():
    with LargestTensorMode() as mode:
        layer = snack.SparseConv2d(64, 512, 3, padding=1, groups=4, sparsity=0.95)
        x = torch.randn(1, 64, 4, 4, requires_grad=True)
        layer(x).square().sum().backward()
        torch.optim.Adam(layer.parameters()).step()
    assert layer.values.grad is not None and x.grad is not None
    grouped_weight = 512 * 16 * 9
    assert mode.largest < grouped_weight // 4, f"{mode.largest_op} produced {mode.largest} elements"


def test_compiled_code_finds_the_kernels_topology_of_every_rewire():
    # as for SparseLinear (tests/test_nn.py): built with each rewire, not in compiled code, where
    # deriving index data broke the graph at every layer (18 graphs for these two)
    model = nn.Sequential(snack.SparseConv2d(4, 6, 3, padding=1, groups=2, sparsity=0.5), nn.ReLU(),
                          snack.SparseConv2d(6, 6, 3, groups=6, sparsity=0.5))  # fmt: skip
    x = torch.randn(2, 4, 6, 6)
    model(x)  # the first call builds the index data
    assert compiled_graphs_through_set_updates(model, x) == 1


@pytest.mark.parametrize("side", [6, 2], ids=["direct kernels", "im2col rows"])
def test_a_forward_in_another_thread_sees_one_whole_state_while_the_layer_is_rewired(side):
    # the kernels' topology (columns moved to their groups' blocks) is built from the snapshot a
    # forward takes, never from a rewire made meanwhile
    torch.manual_seed(0)
    layer = snack.SparseConv2d(8, 8, 3, padding=1, groups=2, sparsity=0.7)
    states = []
    for _ in range(3):
        other = snack.SparseConv2d(8, 8, 3, padding=1, groups=2, sparsity=0.7)
        states.append((other.row, other.col, torch.randn(layer.nnz)))
    x, expected = torch.randn(2 if side == 6 else 1, 8, side, side), []
    rows = x.shape[0] * side * side
    assert snack.backends.cpu.conv.rows_are_faster(layer.nnz, rows, 8 * 9, training=False) == (side == 2)
    for state in states:
        layer.set_topology(*state)
        with torch.no_grad():
            expected.append(layer(x))
    assert _serve_while(lambda i: layer.set_topology(*states[i % 3]), layer, x, expected, forwards=1500) == 0
