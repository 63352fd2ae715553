"""SparseLinear (snack.nn.layer) against dense math on its masked weight; compile, serialisation,
errors, threads. sparsify/densify: test_convert.py; traced programs: test_tracing.py."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from torch import nn

import snack
from snack.nn import SparseLinear

from conftest import dense_forward_and_grads, make_layer, same_size_other

SHAPES = [(1, 1), (5, 3), (3, 5), (17, 31), (64, 40)]


def _check_against_dense(layer: SparseLinear, x: torch.Tensor, atol=1e-10):
    x = x.detach().requires_grad_()
    y = layer(x)
    grad_out = torch.randn_like(y)
    dx, dvalues, dbias = torch.autograd.grad(y, (x, layer.values, layer.bias), grad_out)
    y_ref, dx_ref, dvalues_ref, dbias_ref = dense_forward_and_grads(layer, x, grad_out)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=atol)
    torch.testing.assert_close(dx, dx_ref, rtol=0, atol=atol)
    torch.testing.assert_close(dvalues, dvalues_ref, rtol=0, atol=atol)
    torch.testing.assert_close(dbias, dbias_ref, rtol=0, atol=atol)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("batch", [1, 7])
def test_forward_and_gradients_match_dense(shape, sparsity, batch):
    layer = make_layer(*shape, sparsity)
    _check_against_dense(layer, torch.randn(batch, shape[1], dtype=torch.float64))


@pytest.mark.parametrize("frozen", ["bias", "no-bias", "values", "values-and-bias"])
@pytest.mark.parametrize("batch", [1, 7])
def test_each_gradient_the_step_needs_matches_dense(frozen, batch):
    """The eager backward takes another path for every set of gradients it must return (the
    fused one with the bias, without it, one op alone): each against dense math."""
    layer = make_layer(13, 17, 0.6, bias=frozen != "no-bias")
    if frozen in ("bias", "values-and-bias"):
        layer.bias.requires_grad_(False)
    if frozen in ("values", "values-and-bias"):
        layer.values.requires_grad_(False)
    x = torch.randn(batch, 17, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    grad_out = torch.randn_like(y)
    y_ref, dx_ref, dvalues_ref, dbias_ref = dense_forward_and_grads(layer, x, grad_out)
    parameters = ((layer.values, dvalues_ref), (layer.bias, dbias_ref))
    trained = [(p, g) for p, g in parameters if p is not None and p.requires_grad]
    inputs = [x] + [p for p, _ in trained]
    got = torch.autograd.grad(y, inputs, grad_out)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-10)
    for g, e in zip(got, [dx_ref] + [g for _, g in trained], strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-10)
    assert torch.autograd.gradcheck(lambda *_: layer(x), inputs)


def test_empty_rows_and_columns():
    layer = make_layer(12, 10, 0.3, empty_rows=(0, 5, 11), empty_cols=(2, 9))
    assert layer.topology.rowptr[1] == 0  # row 0 really is empty
    _check_against_dense(layer, torch.randn(4, 10, dtype=torch.float64))


@pytest.mark.parametrize("batch", [1, 3])  # batch 1 runs the 16-bit-column forward
@pytest.mark.parametrize("case", ["empty-rows-and-columns", "no-connections", "odd-shape"])
def test_gradcheck_through_the_layer_at_the_edges(case, batch):
    empty = torch.empty(0, dtype=torch.int32)
    layer = {
        "empty-rows-and-columns": lambda: make_layer(7, 6, 0.3, empty_rows=(0, 3, 6), empty_cols=(1, 5)),
        "no-connections": lambda: SparseLinear.from_coo(
            empty, empty, torch.empty(0, dtype=torch.float64), (5, 4), bias=torch.randn(5, dtype=torch.float64)
        ),
        "odd-shape": lambda: make_layer(1, 13, 0.5),
    }[case]()
    x = torch.randn(batch, layer.in_features, dtype=torch.float64, requires_grad=True)
    inputs = (x, layer.values, layer.bias)
    assert torch.autograd.gradcheck(lambda *_: layer(x), inputs)
    assert torch.autograd.gradgradcheck(lambda *_: layer(x), inputs)


def test_no_connections_at_all():
    empty = torch.empty(0, dtype=torch.int32)
    layer = SparseLinear.from_coo(empty, empty, torch.empty(0, dtype=torch.float64), (6, 4), bias=torch.randn(6, dtype=torch.float64))
    assert layer.nnz == 0 and layer.sparsity == 1.0
    _check_against_dense(layer, torch.randn(3, 4, dtype=torch.float64))


@pytest.mark.parametrize("leading", [(), (2, 3), (1, 1, 4)])
def test_any_leading_dimensions(leading):
    layer = make_layer(9, 6, 0.5)
    x = torch.randn(*leading, 6, dtype=torch.float64)
    y = layer(x)
    assert y.shape == (*leading, 9)
    torch.testing.assert_close(y, nn.functional.linear(x, layer.to_dense(), layer.bias), rtol=0, atol=1e-12)


def test_non_contiguous_input():
    layer = make_layer(9, 6, 0.5)
    x = torch.randn(6, 5, dtype=torch.float64).t()  # (5, 6), not contiguous
    assert not x.is_contiguous()
    _check_against_dense(layer, x)


def test_without_bias():
    layer = make_layer(9, 6, 0.5, bias=False)
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(layer(x), x @ layer.to_dense().T)
    assert "bias=False" in repr(layer)


def test_gradcheck_through_layer():
    layer = make_layer(7, 5, 0.5)
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)

    def fn(x, values, bias):
        return snack.ops.sparse_linear(x, values, layer.topology, bias)

    assert torch.autograd.gradcheck(fn, (x, layer.values, layer.bias))


@pytest.mark.parametrize("compiled_first", [False, True], ids=["eager-first", "compiled-first"])
def test_torch_compile_fullgraph_matches_eager(compiled_first):
    """Compiled first (after a move, which drops the index data: they are derived while
    tracing), or after an eager call."""
    layer = make_layer(12, 10, 0.7, dtype=torch.float64).float()
    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(5, 10)
    results = {}
    for name in ("compiled", "eager") if compiled_first else ("eager", "compiled"):
        y = (compiled if name == "compiled" else layer)(x)
        results[name] = (y, *torch.autograd.grad(y.square().sum(), layer.values))
    for got, expected in zip(results["compiled"], results["eager"]):
        torch.testing.assert_close(got, expected)


def test_a_model_compiled_before_its_first_call_makes_one_graph_without_breaks():
    """Its first call derives the layers' index data in the graph (static shapes), then
    recompiles once with them: before, a data-dependent count (bincount) broke the graph at every
    sparse layer, and the model kept running as one graph per layer (a 256-wide MLP's inference
    took 3x the eager time)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(10, 12), nn.ReLU(), nn.Unflatten(1, (3, 2, 2)), nn.Conv2d(3, 4, 2, padding=1))
    model = snack.sparsify(dense, sparsity=0.6, init="random")
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model)
    x = torch.randn(5, 10)
    for _ in range(3):
        y = compiled(x)
        y.square().sum().backward()
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 2  # the first call's, and the one with the index data
    torch.testing.assert_close(y, model(x))


@pytest.mark.parametrize("kind", ["mlp", "grouped conv"])
def test_a_model_compiled_and_first_called_in_inference_mode_then_trains(kind):
    """(A sanity validation run before training, as Lightning does under inference_mode.) The
    first compiled call derives the index data (and a grouped convolution's unfolded columns) in
    its graph, whose outputs are inference tensors there: the compiled training step, saving them
    for its backward, failed."""
    torch.manual_seed(0)
    if kind == "mlp":
        dense, x = nn.Sequential(nn.Linear(10, 12), nn.ReLU(), nn.Linear(12, 3)), torch.randn(5, 10)
    else:
        dense = nn.Sequential(nn.Conv2d(4, 6, 3, groups=2), nn.ReLU(), nn.Conv2d(6, 6, 3, groups=6))
        x = torch.randn(2, 4, 8, 8)
    model = snack.sparsify(dense, sparsity=0.6, init="random")
    compiled = torch.compile(model)
    with torch.inference_mode():
        expected = compiled(x)
    y = compiled(x)
    y.sum().backward()
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(y, model(x))
    assert all(p.grad is not None for p in model.parameters())


def test_compiled_code_finds_the_index_data_of_every_rewire():
    """Built with each rewire, not in compiled code: deriving them there broke the graph at every
    layer, and after each DST update the layers' recompiles soon hit Dynamo's recompile limit
    (the rest then ran eagerly). A move that moves nothing keeps them."""
    model = nn.Sequential(*[make_layer(out, in_, 0.5, dtype=torch.float32) for out, in_ in ((12, 10), (6, 12))])
    x = torch.randn(5, 10)
    model(x)  # the first call builds the index data (compiled first, it is compiled twice: README)
    model.to("cpu").float()
    assert compiled_graphs_through_set_updates(model, x) == 1


def compiled_graphs_through_set_updates(model: nn.Module, x: torch.Tensor) -> int:
    """How many graphs ``torch.compile`` made of ``model`` through three SET updates, each
    rewiring every sparse layer; checks there was no graph break and the last output."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dst = snack.dst.SET(model, opt, update_every=1, total_steps=100, stop_fraction=1.0, schedule="constant")
    for _ in range(3):
        loss = compiled(x).square().sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert dst.step()
    assert not counters["graph_break"]
    torch.testing.assert_close(compiled(x), model(x))
    return counters["stats"]["unique_graphs"]


def test_compiled_code_sees_coordinates_copied_in_place_before_its_first_call():
    # what DDP(model) does to every rank's buffers (rank 0's topology): index data built when the
    # layer was made would pair the new row/col with the old pointers (max error 1.7)
    torch.manual_seed(0)
    layer, source = SparseLinear(16, 8, sparsity=0.5), SparseLinear(16, 8, sparsity=0.5)
    assert layer.nnz == source.nnz and not torch.equal(layer.col, source.col)
    with torch.no_grad():
        for name in ("row", "col", "values", "bias"):
            getattr(layer, name).copy_(getattr(source, name))
    x = torch.randn(4, 16)
    torch.testing.assert_close(torch.compile(layer, fullgraph=True)(x), x @ source.to_dense().T + source.bias)


def test_torch_compile_follows_buffers_passed_by_functional_call():
    layer = make_layer(12, 10, 0.7, dtype=torch.float32)
    other = make_layer(12, 10, 0.5, dtype=torch.float32, seed=1)  # another nnz too
    x = torch.randn(5, 10)
    layer(x)  # caches the layer's own topology
    state = {name: tensor.detach() for name, tensor in [*other.named_parameters(), *other.named_buffers()]}
    compiled = torch.compile(lambda x: torch.func.functional_call(layer, state, (x,)), fullgraph=True)
    torch.testing.assert_close(compiled(x), dense_forward_and_grads(other, x, torch.ones(5, 12))[0])
    torch.testing.assert_close(layer(x), dense_forward_and_grads(layer, x, torch.ones(5, 12))[0])


def test_attributes():
    layer = SparseLinear(40, 30, sparsity=0.75)
    assert layer.nnz == 300 and layer.values.shape == (300,)
    assert layer.sparsity == pytest.approx(0.75)
    idx = layer.indices()
    assert idx.shape == (2, 300) and idx.dtype == torch.int64
    dense = layer.to_dense()
    assert dense.shape == (30, 40) and int((dense != 0).sum()) <= 300
    assert "nnz=300" in repr(layer) and "sparsity=0.7500" in repr(layer)


def test_init_preserves_dense_output_variance():
    torch.manual_seed(0)
    x = torch.randn(2048, 1000)
    dense_var = (x @ nn.Linear(1000, 500).weight.detach().T).var().item()
    for sparsity in (0.5, 0.9, 0.99):
        layer = SparseLinear(1000, 500, sparsity=sparsity)
        with torch.no_grad():
            sparse_var = (layer(x) - layer.bias).var().item()
        assert sparse_var == pytest.approx(dense_var, rel=0.15), sparsity
    assert dense_var == pytest.approx(1 / 3, rel=0.1)


def test_from_dense_linear_and_sparsity():
    linear = nn.Linear(20, 10)
    layer = SparseLinear.from_dense(linear)
    torch.testing.assert_close(layer.to_dense(), linear.weight)
    torch.testing.assert_close(layer.bias, linear.bias)
    half = SparseLinear.from_dense(linear, sparsity=0.5)
    assert half.nnz == 100
    kept_min = half.values.abs().min()
    dropped = linear.weight.detach().abs() * (half.to_dense() == 0)
    assert dropped.max() <= kept_min


def test_from_coo_sorts_and_validates():
    layer = SparseLinear.from_coo(torch.tensor([1, 0]), torch.tensor([0, 2]), torch.tensor([5.0, 7.0]), (2, 3))
    assert layer.row.tolist() == [0, 1] and layer.col.tolist() == [2, 0]
    assert layer.values.tolist() == [7.0, 5.0]
    with pytest.raises(ValueError, match="duplicate"):
        SparseLinear.from_coo(torch.tensor([1, 1]), torch.tensor([0, 0]), torch.tensor([5.0, 7.0]), (2, 3))
    with pytest.raises(ValueError, match="col index 3 is out of range"):
        SparseLinear.from_coo(torch.tensor([0]), torch.tensor([3]), torch.tensor([5.0]), (2, 3))
    with pytest.raises(ValueError, match="same length"):
        SparseLinear.from_coo(torch.tensor([0, 1]), torch.tensor([0]), torch.tensor([5.0]), (2, 3))
    with pytest.raises(ValueError, match=r"values must have shape \(2,\)"):
        SparseLinear.from_coo(torch.tensor([0, 1]), torch.tensor([0, 1]), torch.tensor([5.0]), (2, 3))


# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(in_features=0, out_features=3), ValueError, "in_features must be in"),
        (dict(in_features=3, out_features=-1), ValueError, "out_features must be in"),
        (dict(in_features=3.0, out_features=3), TypeError, "in_features must be an int"),
        (dict(in_features=3, out_features=3, sparsity=1.0), ValueError, r"sparsity must be in \[0, 1\)"),
        (dict(in_features=3, out_features=3, sparsity=-0.5), ValueError, r"sparsity must be in \[0, 1\)"),
        (dict(in_features=3, out_features=3, sparsity="high"), TypeError, "sparsity must be a float"),
        # SparseLinear(3, 3, 0.5): a sparsity given by position was taken as bias=0.5, sparsity 0.9
        (dict(in_features=3, out_features=3, bias=0.5), TypeError, r"bias must be a bool.*sparsity=\.\.\."),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        SparseLinear(**kwargs)


def test_forward_rejects_bad_input():
    layer = SparseLinear(8, 4)
    with pytest.raises(ValueError, match=r"input must have shape \(\*, 8\), got \(2, 7\)"):
        layer(torch.randn(2, 7))
    with pytest.raises(TypeError, match=r"input dtype torch.float64 does not match the layer's torch.float32; cast the "
                       r"input \(x.to\(torch.float32\)\) or the layer \(layer.to\(torch.float64\)\)$"):  # fmt: skip
        layer(torch.randn(2, 8, dtype=torch.float64))
    # the layer cannot hold integers: only the input's cast is suggested
    only_the_input = r"input dtype torch.int64 does not match .* cast the input \(x.to\(torch.float32\)\)$"
    with pytest.raises(TypeError, match=only_the_input):
        layer(torch.ones(2, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"got \(\)"):
        layer(torch.tensor(1.0))
    with pytest.raises(TypeError, match="expects a Tensor"):
        layer([1.0] * 8)


def test_set_topology_rejects_bad_input_and_changes_nothing():
    layer = make_layer(6, 5, 0.5)
    before = {k: v.clone() for k, v in layer.state_dict().items() if isinstance(v, torch.Tensor)}
    values_param = layer.values
    bad_calls = [
        (torch.tensor([0, 0]), torch.tensor([1, 1]), None),  # duplicate
        (torch.tensor([0, 9]), torch.tensor([1, 1]), None),  # out of range
        (torch.tensor([0, 1]), torch.tensor([1, 1]), torch.zeros(3, dtype=torch.float64)),  # wrong length
        (torch.tensor([0, 1]), torch.tensor([1, 1]), torch.zeros(2, dtype=torch.float32)),  # wrong dtype
    ]
    for row, col, values in bad_calls:
        with pytest.raises((ValueError, TypeError)):
            layer.set_topology(row, col, values)
    assert layer.values is values_param
    for key, value in layer.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, before[key]), key


def test_set_topology_keeps_parameter_and_refreshes_cache():
    layer = make_layer(6, 5, 0.5)
    param, old_rowptr = layer.values, layer.topology.rowptr
    layer.set_topology(torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([4, 0, 2], dtype=torch.int32))
    assert layer.values is param and layer.nnz == 3 and torch.equal(layer.values, torch.zeros(3, dtype=torch.float64))
    assert layer.topology.rowptr.tolist() == [0, 1, 1, 1, 2, 2, 3]
    assert layer.topology.rowptr is not old_rowptr


def test_changing_nnz_while_an_old_graph_is_alive():
    layer = make_layer(6, 5, 0.5)
    x = torch.randn(3, 5, dtype=torch.float64)
    old_loss = layer(x).sum()
    old_loss.backward()  # the old graph (and autograd's accumulator for values) is still referenced
    layer.set_topology(torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([4, 0, 2], dtype=torch.int32))
    layer(x).sum().backward()
    assert layer.values.grad.shape == (3,)
    source = make_layer(6, 5, 0.2, seed=3)
    layer.load_state_dict(source.state_dict())
    layer(x).sum().backward()
    assert layer.values.grad.shape == (source.nnz,)
    assert old_loss.grad_fn is not None


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("change", ["set_topology", "load_state_dict"])
def test_backward_through_a_graph_from_before_the_connections_changed_raises(change, autocast):
    # the input needs no gradient, so only dvalues is computed: without the saved values' version
    # check it would silently land on the new connections (same nnz, other positions). Under
    # autocast the graph holds a bfloat16 cast of values, which a rewire leaves alone: it ran.
    torch.manual_seed(0)
    dtype = torch.float32 if autocast else torch.float64
    layer, other = (SparseLinear(5, 6, sparsity=0.5, dtype=dtype) for _ in range(2))
    assert layer.nnz == other.nnz and not torch.equal(layer.col, other.col)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = layer(torch.randn(3, 5, dtype=dtype)).float().sum()
    if change == "set_topology":
        layer.set_topology(other.row, other.col)
    else:
        layer.load_state_dict(other.state_dict())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    assert layer.values.grad is None


def test_sparse_grad_outputs_give_the_dense_gradients():
    # the kernels take strided tensors: a sparse grad_outputs failed in .contiguous() (nn.Linear takes it)
    layer = make_layer(9, 13, 0.6, bias=False)
    x = torch.randn(4, 13, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(4, 9, dtype=torch.float64)
    expected = dense_forward_and_grads(layer, x, grad_out)[1:3]
    got = torch.autograd.grad(layer(x), (x, layer.values), grad_outputs=grad_out.to_sparse())
    for got_grad, expected_grad in zip(got, expected):
        torch.testing.assert_close(got_grad, expected_grad)


# ---------------------------------------------------------------------- serialisation and moves


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("other_nnz", [False, True])
def test_a_layer_built_under_inference_mode_loads_there_like_nn_linear(bias, other_nnz):
    # its inference tensors take in-place copies only in inference mode: a load outside it raised
    # half-way (row/col already replaced), and one inside it always raised
    source = make_layer(7, 9, 0.2 if other_nnz else 0.5, bias=bias, seed=1)
    with torch.inference_mode():
        layer = make_layer(7, 9, 0.5, bias=bias, seed=0)
    before = {name: tensor.clone() for name, tensor in layer.state_dict().items()}
    with pytest.raises(RuntimeError, match="inference tensors .* can only be loaded under torch.inference_mode"):
        layer.load_state_dict(source.state_dict())
    assert all(torch.equal(before[name], tensor) for name, tensor in layer.state_dict().items())
    with torch.inference_mode():
        layer.load_state_dict(source.state_dict())
        x = torch.randn(3, 9, dtype=torch.float64)
        torch.testing.assert_close(layer(x), source(x))
    assert layer.nnz == source.nnz


def test_state_dict_round_trip_with_different_nnz():
    source, target = make_layer(10, 8, 0.3, seed=1), make_layer(10, 8, 0.9, seed=2)
    assert source.nnz != target.nnz
    param = target.values
    target.load_state_dict(source.state_dict())
    assert target.values is param  # optimizers holding it stay valid
    assert torch.equal(target.row, source.row) and torch.equal(target.col, source.col)
    x = torch.randn(3, 8, dtype=torch.float64)
    torch.testing.assert_close(target(x), source(x), rtol=0, atol=0)


@pytest.mark.parametrize("corrupt", ["shape", "duplicate", "values_length", "out_of_range"])
def test_bad_state_dict_is_rejected_and_changes_nothing(corrupt):
    layer = make_layer(10, 8, 0.5)
    before = copy.deepcopy(layer.state_dict())
    if corrupt == "shape":
        state = make_layer(8, 10, 0.5).state_dict()
    else:
        state = copy.deepcopy(before)
        if corrupt == "duplicate":
            state["col"][1], state["row"][1] = state["col"][0], state["row"][0]
        elif corrupt == "values_length":
            state["values"] = state["values"][:-1]
        else:
            state["row"][-1] = 10
    with pytest.raises(RuntimeError, match="While loading SparseLinear"):
        layer.load_state_dict(state)
    for key, value in layer.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, before[key]), key


def test_state_dict_missing_keys_reported():
    layer = make_layer(4, 4, 0.5)
    state = layer.state_dict()
    del state["col"]
    with pytest.raises(RuntimeError, match="Missing key"):
        layer.load_state_dict(state)


def test_to_dtype_deepcopy_and_pickle():
    layer = make_layer(9, 7, 0.5)
    x = torch.randn(2, 7, dtype=torch.float64)
    _ = layer.topology.csc_perm  # populate the cache; copies must not share stale data
    as_float = copy.deepcopy(layer).to(torch.float32)
    assert as_float.values.dtype == torch.float32 and as_float.row.dtype == torch.int32
    torch.testing.assert_close(as_float(x.float()), layer(x).float())
    for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        torch.testing.assert_close(clone(x), layer(x), rtol=0, atol=0)
        assert clone.values is not layer.values


# ---------------------------------------------------------------------- sparsify / densify


def _mixed_model(dtype=torch.float32) -> nn.Module:
    """nn.Linear → ReLU → SparseLinear, the way a partly sparsified model mixes them."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(10, 12), nn.ReLU(), SparseLinear(12, 7, sparsity=0.6)).to(dtype)


def test_autocast_runs_the_layer_in_the_regions_dtype_like_nn_linear():
    """Inside ``torch.autocast`` the layer computes in bfloat16 as ``nn.Linear`` does (its input
    comes from one in bfloat16); the gradients reach the float32 parameters. Checked against the
    same model with a dense masked weight in place of the sparse layer, under the same autocast."""
    model = _mixed_model()
    sparse = model[2]
    dense = nn.Sequential(model[0], model[1], nn.Linear(12, 7))
    with torch.no_grad():
        dense[2].weight.copy_(sparse.to_dense())
        dense[2].bias.copy_(sparse.bias)
    x = torch.randn(5, 10)
    outputs = []
    for net in (model, dense):
        net.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outputs.append(net(x))
        outputs[-1].float().square().sum().backward()
    y, y_dense = outputs
    dvalues, dbias = sparse.values.grad, sparse.bias.grad
    dvalues_dense = dense[2].weight.grad[sparse.row.long(), sparse.col.long()]
    dbias_dense = dense[2].bias.grad
    assert y.dtype == torch.bfloat16 and sparse.values.dtype == dvalues.dtype == torch.float32
    tol = dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(y.float(), y_dense.float(), **tol)
    torch.testing.assert_close(dvalues, dvalues_dense, **tol)
    torch.testing.assert_close(dbias, dbias_dense, **tol)


def test_autocast_leaves_float64_alone_and_mismatches_still_fail():
    layer = make_layer(7, 12, 0.6)  # float64, as autocast leaves nn.Linear's float64
    x = torch.randn(3, 12, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
        functional = snack.ops.sparse_linear(x, layer.values, layer.topology, layer.bias)
    assert y.dtype == functional.dtype == torch.float64
    torch.testing.assert_close(y, layer(x), rtol=0, atol=0)
    with pytest.raises(TypeError, match="does not match the layer's torch.bfloat16 under autocast"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _mixed_model()[2](x)  # a float64 input stays float64; the float32 layer goes to bfloat16
    with pytest.raises(TypeError, match=r"does not match the layer's torch.float32; cast the input \(x.to\(torch.float32"):
        _mixed_model()[2](x)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gradient_checkpointing_gives_the_plain_gradients(use_reentrant):
    from torch.utils.checkpoint import checkpoint

    layer = make_layer(30, 20, 0.8)
    x = torch.randn(4, 20, dtype=torch.float64)
    grads = []
    for checkpointed in (False, True):
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        y = checkpoint(layer, xi, use_reentrant=use_reentrant) if checkpointed else layer(xi)
        y.square().sum().backward()
        grads.append((xi.grad, layer.values.grad.clone(), layer.bias.grad.clone()))
    for got, expected in zip(*grads):
        torch.testing.assert_close(got, expected)


# ---------------------------------------------------------------------- buffers changed behind the layer's back


def test_the_layer_computes_with_its_buffers_after_they_are_copied_in_place():
    """What DDP's buffer broadcast or AveragedModel(use_buffers=False) do: copy another layer's
    coordinates into this one's tensors, after the cache was built."""
    torch.manual_seed(0)
    a, b = (SparseLinear(16, 8, sparsity=0.5, dtype=torch.float64) for _ in range(2))
    x = torch.randn(3, 16, dtype=torch.float64)
    a(x)  # builds the cache
    with torch.no_grad():
        for name in ("row", "col", "values", "bias"):
            getattr(a, name).copy_(getattr(b, name))
    _check_against_dense(a, x)
    torch.testing.assert_close(a(x), b(x))


def test_functional_call_with_other_buffers_leaves_the_layer_its_own():
    layer, other = make_layer(8, 16, 0.5, seed=0), make_layer(8, 16, 0.7, seed=1)
    x = torch.randn(3, 16, dtype=torch.float64)
    swapped = {name: getattr(other, name) for name in ("row", "col", "values", "bias")}
    torch.testing.assert_close(torch.func.functional_call(layer, swapped, (x,)), other(x))
    _check_against_dense(layer, x)


def test_corrupted_buffers_fail_loudly_rather_than_compute():
    layer = make_layer(8, 16, 0.5)
    x = torch.randn(3, 16, dtype=torch.float64)
    layer(x)
    with torch.no_grad():
        layer.row.copy_(layer.row.flip(0))  # e.g. int buffers averaged by AveragedModel(use_buffers=True)
    with pytest.raises(ValueError, match="sorted by"):
        layer(x)


def test_a_first_forward_under_inference_mode_does_not_poison_training():
    layer = make_layer(5, 8, 0.5)
    x = torch.randn(3, 8, dtype=torch.float64)
    with torch.inference_mode():
        layer(x)  # e.g. a validation pass before training
    assert not any(t.is_inference() for t in layer.topology.tensors())
    x.requires_grad_()
    y = snack.ops.sparse_linear(x, layer.values, layer.topology, layer.bias)
    (grad_x,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)  # saves the index tensors
    grad_x.sum().backward()
    assert layer.values.grad is not None


# ---------------------------------------------------------------------- sparsify / densify keep module state


def test_reading_weight_says_what_a_sparse_layer_has_instead():
    layer = make_layer(3, 4, 0.5)
    assert not hasattr(layer, "weight") and getattr(layer, "weight", None) is None
    with pytest.raises(AttributeError, match=r"no dense weight: it holds `values` at \(`row`, `col`\); `to_dense\(\)`"):
        layer.weight
    with pytest.raises(AttributeError, match="'SparseLinear' object has no attribute 'wieght'"):
        layer.wieght


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_module_type_casts_the_values_but_keeps_int32_coordinates(dtype):
    layer = SparseLinear(3000, 4, sparsity=0.9)  # columns above 2048, which float16 would round
    row, col = layer.row.clone(), layer.col.clone()
    model = nn.Sequential(layer).type(dtype)
    assert layer.values.dtype == dtype and layer.row.dtype == layer.col.dtype == torch.int32
    assert torch.equal(layer.row, row) and torch.equal(layer.col, col)
    if dtype == torch.float64:
        x = torch.randn(2, 3000, dtype=dtype)
        torch.testing.assert_close(model(x), x @ layer.to_dense().T + layer.bias)


def test_the_state_dict_holds_only_tensors_and_round_trips_through_safetensors(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")  # a dev dependency
    model = snack.sparsify(nn.Sequential(nn.Linear(12, 10), nn.ReLU(), nn.Linear(10, 3)), 0.6)
    state = model.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    safetensors_torch.save_file(state, tmp_path / "model.safetensors")
    other = snack.sparsify(nn.Sequential(nn.Linear(12, 10), nn.ReLU(), nn.Linear(10, 3)), 0.9)
    other.load_state_dict(safetensors_torch.load_file(tmp_path / "model.safetensors"))
    x = torch.randn(4, 12)
    torch.testing.assert_close(other(x), model(x))


def test_a_state_dict_of_the_first_format_still_loads_and_is_shape_checked():
    layer, other = make_layer(7, 9, 0.5, seed=0), make_layer(7, 9, 0.2, seed=1)
    state = other.state_dict()
    state["_extra_state"] = {"version": 1, "shape": (7, 9)}
    layer.load_state_dict(state)
    assert torch.equal(layer.indices(), other.indices())
    state["_extra_state"] = {"version": 1, "shape": (7, 10)}
    with pytest.raises(RuntimeError, match=r"the state_dict is of a \(7, 10\) layer, this layer is \(7, 9\)"):
        layer.load_state_dict(state)


@pytest.mark.parametrize("strict", [True, False])
def test_a_state_dict_without_the_shape_check_loads(strict):
    layer, other = make_layer(7, 9, 0.5, seed=0), make_layer(7, 9, 0.2, seed=1)
    state = other.state_dict()
    del state["_extra_state"]
    assert layer.load_state_dict(state, strict=strict) == ([], [])
    assert torch.equal(layer.indices(), other.indices())


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("dropped", ["values", "col"])
def test_part_of_a_topology_is_missing_and_leaves_the_layer_untouched(strict, dropped):
    layer, other = make_layer(7, 9, 0.5, seed=0), make_layer(7, 9, 0.2, seed=1)
    before = copy.deepcopy(layer.state_dict())
    state = other.state_dict()
    del state[dropped]
    # an error also with strict=False: a loader feeding one shard at a time must not pass silently
    with pytest.raises(RuntimeError, match=f"holds .* but not {dropped}; a layer's row, col and values load together"):
        layer.load_state_dict(state, strict=strict)
    after = layer.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_load_state_dict_with_assign_keeps_int32_coordinates():
    layer, other = make_layer(7, 9, 0.5, seed=0), make_layer(7, 9, 0.2, seed=1)
    state = {k: v.long() if k in ("row", "col") else v for k, v in other.state_dict().items()}
    layer.load_state_dict(state, assign=True)
    assert layer.row.dtype == layer.col.dtype == torch.int32
    torch.testing.assert_close(layer(torch.randn(2, 9, dtype=torch.float64)).shape, torch.Size([2, 7]))


@pytest.mark.parametrize("nnz_changes", [False, True])
def test_a_load_whose_values_cannot_be_copied_leaves_the_layer_untouched(nnz_changes):
    layer = make_layer(7, 9, 0.5, seed=0)
    other = make_layer(7, 9, 0.2, seed=1) if nnz_changes else same_size_other(layer)
    before = copy.deepcopy(layer.state_dict())
    state = other.state_dict()
    state["values"] = state["values"].to("meta")  # its copy fails
    with pytest.raises(RuntimeError, match="values cannot be copied into the layer"):
        layer.load_state_dict(state)
    after = layer.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("bias", [None, [0.0] * 7])
def test_a_bias_entry_that_is_not_a_tensor_is_a_clear_error(bias):
    layer = make_layer(7, 9, 0.5)
    state = {**make_layer(7, 9, 0.2, seed=1).state_dict(), "bias": bias}
    with pytest.raises(RuntimeError, match=r"bias must be a tensor of shape \(7,\), got (NoneType|list)"):
        layer.load_state_dict(state)


def test_a_state_dict_of_an_unknown_format_version_is_refused():
    layer = make_layer(7, 9, 0.5)
    state = make_layer(7, 9, 0.2, seed=1).state_dict()
    state["_extra_state"] = torch.tensor([99, 7, 9])
    with pytest.raises(RuntimeError, match="_extra_state is of format version 99"):
        layer.load_state_dict(state)


def test_set_topology_and_load_state_dict_under_inference_mode_leave_a_trainable_layer():
    layer, other = make_layer(7, 9, 0.5, seed=0), make_layer(7, 9, 0.2, seed=1)
    with torch.inference_mode():
        layer.load_state_dict(other.state_dict())  # another nnz: new tensors
    with torch.inference_mode():
        half = layer.nnz // 2
        layer.set_topology(layer.row[:half].clone(), layer.col[:half].clone())
    assert not any(t.is_inference() for t in (layer.values, layer.row, layer.col))
    x = torch.randn(3, 9, dtype=torch.float64)
    layer(x).sum().backward()
    torch.testing.assert_close(layer.values.grad, dense_forward_and_grads(layer, x, torch.ones(3, 7))[2])


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
def test_a_load_of_the_same_nnz_copies_row_and_col_in_place():
    """As nn.Module copies every buffer: whatever holds the layer's tensors follows the load (a
    traced module here). Replacing row/col while values were copied in place gave it the new
    values on the old coordinates, silently."""
    layer = make_layer(7, 9, 0.5, seed=0)
    source = same_size_other(layer)
    x = torch.randn(3, 9, dtype=torch.float64)
    traced = torch.jit.trace(layer, x)
    row, col, values = layer.row, layer.col, layer.values
    layer.load_state_dict(source.state_dict())
    assert layer.row is row and layer.col is col and layer.values is values
    assert torch.equal(row, source.row) and torch.equal(col, source.col)
    torch.testing.assert_close(layer(x), source(x))
    torch.testing.assert_close(traced(x), source(x))


def test_a_failed_allocation_in_set_topology_leaves_the_layer_whole(monkeypatch):
    """The tensors a new topology needs are made before any is installed: an allocation that
    fails (out of memory) once left row/col of the new nnz with values of the old."""
    layer = make_layer(7, 9, 0.5)
    before = copy.deepcopy(layer.state_dict())

    def failing(*args):
        raise torch.OutOfMemoryError("simulated")

    monkeypatch.setattr(snack.nn.layer, "_data_swap", failing)
    with pytest.raises(torch.OutOfMemoryError):
        layer.set_topology(layer.row[:3].clone(), layer.col[:3].clone())
    after = layer.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    x = torch.randn(2, 9, dtype=torch.float64)
    torch.testing.assert_close(layer(x), dense_forward_and_grads(layer, x, torch.ones(2, 7))[0])


def test_parameters_of_the_wrong_shape_are_a_clear_error_not_a_kernel_one():
    # put in by assignment or functional_call; the kernels trust shapes (the reference backend broadcast them)
    layer = make_layer(7, 9, 0.5)
    x = torch.randn(2, 9, dtype=torch.float64)
    wrong = {"values": layer.values.detach()[:1], "bias": layer.bias.detach()}
    for backend in ("cpu", "reference"):
        with snack.use_backend(backend), pytest.raises(ValueError, match=rf"values must have shape \({layer.nnz},\)"):
            torch.func.functional_call(layer, wrong, (x,))
    with pytest.raises(ValueError, match=r"bias \(7,\), got .* and \(6,\)"):
        torch.func.functional_call(layer, {"bias": layer.bias.detach()[:6]}, (x,))
    layer.values = nn.Parameter(layer.values.detach()[:, None])
    with pytest.raises(ValueError, match=r"got \(\d+, 1\)"):
        layer(x.requires_grad_())


def test_invalid_coordinate_buffers_are_an_error_naming_the_layer():
    layer = make_layer(7, 9, 0.5)
    layer.to_empty(device="cpu")  # uninitialised memory: what it holds is arbitrary
    layer.row.fill_(100)
    with pytest.raises(ValueError, match=r"SparseLinear\(9, 7\): its row/col buffers are not a valid topology"):
        layer(torch.randn(2, 9, dtype=torch.float64))


def test_set_topology_copies_the_coordinates_it_is_given():
    layer = make_layer(7, 9, 0.5)
    row, col = layer.row[:3].clone(), layer.col[:3].clone()
    expected = col.tolist()
    layer.set_topology(row, col)
    col.fill_(0)  # the caller's tensor, changed afterwards
    assert layer.col.tolist() == expected


# ---------------------------------------------------------------------- construction arguments


def test_numpy_sizes_and_sparsity_are_accepted():
    np = pytest.importorskip("numpy")
    layer = SparseLinear(np.int64(6), np.int32(4), sparsity=np.float32(0.5))
    assert (layer.in_features, layer.out_features, layer.nnz) == (6, 4, 12)
    assert type(layer.in_features) is int


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(dtype=torch.complex64), TypeError, "dtype must be a floating dtype, got torch.complex64"),
        (dict(dtype=torch.int32), TypeError, "dtype must be a floating dtype"),
    ],
)
def test_unsupported_dtypes_and_devices_fail_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        SparseLinear(8, 4, **kwargs)


def test_a_layer_too_large_for_int32_indices_fails_before_drawing_its_topology():
    with pytest.raises(ValueError, match=r"would have 2250000000 connections; snack's int32 indices hold at most"):
        SparseLinear(50_000, 50_000, sparsity=0.1)


def test_meta_tensors_are_refused_where_their_values_would_be_kept():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    with pytest.raises(NotImplementedError, match=r"sparsify: layers '0', '2' are on the meta device.*init='random'"):
        snack.sparsify(model, 0.5)
    assert all(type(model[i]) is nn.Linear for i in (0, 2))  # nothing was replaced
    meta = "from_dense/from_coo cannot take meta tensors"
    with pytest.raises(NotImplementedError, match=meta):
        SparseLinear.from_dense(model[0], sparsity=0.5)
    with pytest.raises(NotImplementedError, match=meta):
        snack.SparseConv2d.from_dense(torch.empty(4, 2, 3, 3, device="meta"), sparsity=0.5)
    row = torch.tensor([0, 1], dtype=torch.int32, device="meta")
    with pytest.raises(NotImplementedError, match=meta):
        SparseLinear.from_coo(row, row, torch.ones(2, device="meta"), (2, 2))


_UNDRAWN = "was built on the meta device and has no topology yet"


@pytest.mark.parametrize(
    "make",
    [lambda: SparseLinear(16, 8, sparsity=0.5), lambda: snack.SparseConv2d(3, 4, 3, padding=1, sparsity=0.6)],
    ids=["linear", "conv2d"],
)
def test_a_layer_built_on_meta_draws_at_reset_the_topology_it_would_have_drawn_when_built(make):
    """meta → to_empty → reset_parameters draws what the constructor draws on a real device, from
    the same random numbers; until then the layer refuses to compute."""
    with torch.device("meta"):
        layer = make()
    torch.manual_seed(0)
    built = make()
    assert layer.row.device.type == "meta" and layer.nnz == built.nnz and layer.values.shape == built.values.shape
    x = torch.randn(2, 16) if type(built) is SparseLinear else torch.randn(2, 3, 5, 5)
    with pytest.raises(RuntimeError, match=_UNDRAWN + r" \(on the meta device\)"):
        layer(x.to("meta"))
    layer.to_empty(device="cpu")
    with pytest.raises(RuntimeError, match=_UNDRAWN + r" \(materialised by to_empty\(\)\).*reset_parameters\(\)"):
        layer(x)
    torch.manual_seed(0)
    layer.reset_parameters()
    assert all(torch.equal(value, built.state_dict()[key]) for key, value in layer.state_dict().items())
    torch.testing.assert_close(layer(x), built(x))
    row = layer.row.clone()
    layer.reset_parameters()  # drawn: a reset now keeps the topology, as for any layer
    assert torch.equal(layer.row, row)


def test_sparsify_of_a_meta_model_then_to_empty_and_reset_trains_a_sparse_model():
    with torch.device("meta"):
        model = nn.Sequential(nn.Conv2d(2, 6, 3, padding=1), nn.ReLU(), nn.ConvTranspose2d(6, 4, 2, stride=2),
                              nn.Flatten(), nn.Linear(4 * 8 * 8, 10))  # fmt: skip
    snack.sparsify(model, 0.8, distribution="erk", init="random")
    layers = [m for m in model.modules() if isinstance(m, SparseLinear)]
    assert len(layers) == 3 and all(m.row.device.type == "meta" for m in layers)
    with torch.device("meta"):
        reference = nn.Sequential(nn.Conv2d(2, 6, 3, padding=1), nn.ReLU(), nn.ConvTranspose2d(6, 4, 2, stride=2),
                                  nn.Flatten(), nn.Linear(4 * 8 * 8, 10)).to_empty(device="cpu")  # fmt: skip
    real = [m for m in snack.sparsify(reference, 0.8, distribution="erk", init="random").modules()
            if isinstance(m, SparseLinear)]  # fmt: skip
    assert [m.nnz for m in layers] == [m.nnz for m in real]  # the same ERK counts
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 2, 4, 4)
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    assert model(x).square().mean() < loss
    for layer in layers:
        dense = layer.to_dense()
        assert int((dense != 0).sum()) <= layer.nnz and layer.values.abs().max() > 0


@pytest.mark.parametrize("assign", [False, True], ids=["copy", "assign"])
@pytest.mark.parametrize("sparsity", [0.5, 0.7], ids=["same-nnz", "other-nnz"])
def test_a_meta_layer_loads_a_saved_state(assign, sparsity):
    """The usual ways to fill a meta model from a checkpoint: to_empty then load_state_dict, or
    load_state_dict(assign=True) straight into the meta layer."""
    source = make_layer(8, 16, sparsity)
    with torch.device("meta"):
        layer = SparseLinear(16, 8, sparsity=0.5, dtype=torch.float64)
    if not assign:
        layer.to_empty(device="cpu")
    layer.load_state_dict(source.state_dict(), assign=assign)
    assert layer.row.device.type == layer.values.device.type == "cpu" and layer.nnz == source.nnz
    x = torch.randn(3, 16, dtype=torch.float64)
    torch.testing.assert_close(layer(x), source(x), rtol=0, atol=0)
    row = layer.row.clone()
    layer.reset_parameters()  # loaded: a reset keeps that topology
    assert torch.equal(layer.row, row)


# ---------------------------------------------------------------------- threads


def _serve_while(rewire, layer: nn.Module, x: torch.Tensor, expected: list[torch.Tensor] | None, forwards: int = 3000):
    """Run ``forwards`` no-grad forwards of ``layer`` on ``x`` while another thread calls
    ``rewire(i)`` for i = 0, 1, ...; return how many outputs were none of ``expected`` (unless
    ``None``: any output passes) or raised."""
    stop, bad = threading.Event(), []

    def writer():
        i = 0
        while not stop.is_set():
            rewire(i)
            i += 1

    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    thread = threading.Thread(target=writer)
    try:
        thread.start()
        for _ in range(forwards):
            try:
                with torch.no_grad():
                    y = layer(x)
            except (RuntimeError, ValueError) as error:
                bad.append(error)
                continue
            if expected is not None and not any(torch.equal(y, e) for e in expected):
                bad.append(y)
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(switch_interval)
    return len(bad)


def test_a_forward_in_another_thread_sees_one_whole_state_while_the_layer_is_rewired():
    # a serving thread next to a training thread whose DST steps rewire the layer (same nnz, as
    # SET and RigL do): it used to see new values at old positions, and spurious "not sorted" errors
    torch.manual_seed(0)
    layer = SparseLinear(64, 64, sparsity=0.9)
    states = [(*snack.topology.random_coo(64, 64, 0.9), torch.randn(layer.nnz)) for _ in range(3)]
    x, expected = torch.randn(4, 64), []
    for state in states:
        layer.set_topology(*state)
        with torch.no_grad():
            expected.append(layer(x))
    assert _serve_while(lambda i: layer.set_topology(*states[i % 3]), layer, x, expected) == 0


def test_a_forward_in_another_thread_sees_one_whole_state_while_state_dicts_of_other_nnz_load():
    # hot-reloading checkpoints (a load of the same nnz copies in place, as nn.Module does)
    torch.manual_seed(0)
    layer = SparseLinear(64, 64, sparsity=0.5)
    states = [SparseLinear(64, 64, sparsity=s).state_dict() for s in (0.9, 0.8, 0.7)]
    for state in states:
        del state["bias"]  # copied in place: not part of what is checked here
    x, expected = torch.randn(4, 64), []
    for state in states:
        layer.load_state_dict(state, strict=False)
        with torch.no_grad():
            expected.append(layer(x))
    assert _serve_while(lambda i: layer.load_state_dict(states[i % 3], strict=False), layer, x, expected) == 0


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
@pytest.mark.parametrize("trace", ["jit", "fx"])
def test_a_traced_module_in_another_thread_never_validates_half_copied_coordinates(trace):
    """A same-nnz load copies into the row/col a traced program holds; the program's index data
    are validated under the lock the copy holds (it raised "not sorted" 30 times a second).
    Outputs may mix the states meanwhile (documented), errors may not."""
    torch.manual_seed(0)
    layer = SparseLinear(64, 64, sparsity=0.5)
    states = [same_size_other(layer).state_dict() for _ in range(3)]
    x = torch.randn(4, 64)
    program = torch.jit.trace(layer, x) if trace == "jit" else torch.fx.symbolic_trace(layer)
    assert _serve_while(lambda i: layer.load_state_dict(states[i % 3]), program, x, None, forwards=2000) == 0


def test_a_load_with_assign_or_into_shared_buffers_replaces_them():
    """The in-place copy of a same-nnz load stands aside where it cannot serve: with assign=True
    (nn.Module then installs new values, which the old coordinates must not meet in whatever
    holds them) and when row and col are one tensor (a diagonal loaded with assign=True)."""
    layer = make_layer(6, 6, 0.5)
    source = same_size_other(layer)
    old_row = layer.row.clone()
    holder = layer.row  # e.g. a traced module's reference
    layer.load_state_dict(source.state_dict(), assign=True)
    assert torch.equal(holder, old_row) and torch.equal(layer.row, source.row)
    diagonal = torch.arange(6, dtype=torch.int32)
    square = SparseLinear.from_coo(diagonal, diagonal, torch.ones(6, dtype=torch.float64), (6, 6))
    square.load_state_dict({**square.state_dict(), "row": diagonal, "col": diagonal}, assign=True)
    assert square.row is square.col
    other = SparseLinear.from_coo(diagonal, diagonal.flip(0), torch.ones(6, dtype=torch.float64), (6, 6))
    square.load_state_dict(other.state_dict())
    assert torch.equal(square.row, other.row) and torch.equal(square.col, other.col)
    x = torch.randn(2, 6, dtype=torch.float64)
    torch.testing.assert_close(square(x), other(x))


def test_a_layer_built_under_inference_mode_can_be_rewired():
    # its values have no version counter to bump: that once failed after the swap, half-way
    with torch.inference_mode():
        layer = make_layer(5, 4, 0.5)
    layer.set_topology(layer.row[:3].clone(), layer.col[:3].clone())
    assert layer.nnz == 3 and layer.values.shape == (3,)
    with torch.inference_mode():
        torch.testing.assert_close(layer(torch.ones(1, 4, dtype=torch.float64)), layer.bias[None])


def test_a_child_forked_while_another_thread_changes_a_layer_can_use_it():
    # the locks a thread held at the fork are replaced in the child, which would wait for them forever
    script = textwrap.dedent("""
        import os, sys, threading, torch, snack
        layer = snack.SparseLinear(5, 6, sparsity=0.5)
        held, release = threading.Event(), threading.Event()
        def hold():
            with snack.nn.locking.STATE_LOCK, snack.backends.derived._LOCK:
                held.set()
                release.wait()
        threading.Thread(target=hold, daemon=True).start()
        held.wait()
        pid = os.fork()
        if pid == 0:
            with torch.no_grad():
                layer(torch.randn(1, 5))
            os._exit(0)
        release.set()
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
    """)
    result = subprocess.run([sys.executable, "-c", script], timeout=120, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_meta_state_dict_is_refused_with_a_clear_error():
    layer = make_layer(5, 4, 0.5)
    before = copy.deepcopy(layer.state_dict())
    meta_state = {k: v.to("meta") for k, v in layer.state_dict().items()}
    for assign in (False, True):
        with pytest.raises(RuntimeError, match="While loading SparseLinear.*meta device"):
            layer.load_state_dict(meta_state, assign=assign)
    assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())


def test_a_state_dict_without_the_bias_leaves_the_bias_as_it_was():
    layer, other = make_layer(7, 9, 0.5, seed=0), make_layer(7, 9, 0.2, seed=1)
    bias = layer.bias.detach().clone()
    state = other.state_dict()
    del state["bias"]
    assert layer.load_state_dict(state, strict=False).missing_keys == ["bias"]
    assert torch.equal(layer.bias, bias) and torch.equal(layer.indices(), other.indices())
