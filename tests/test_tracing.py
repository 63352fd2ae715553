"""Programs made by tracing a SparseLinear (torch.fx.symbolic_trace, torch.jit.trace,
torch.export) against eager: snack.nn.tracing and the snack::topology_index_data op."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
from torch import nn

import snack
from snack.nn import tracing

from conftest import dense_forward_and_grads, make_layer, same_size_other


def test_torch_fx_symbolic_trace_records_one_call_per_layer_through_the_layer():
    """FX-based tools (feature extractors, graph rewriters) trace into custom modules; a layer
    records one call of its forward, reached through the layer itself (a get_attr node)."""
    layer = make_layer(12, 10, 0.7, empty_rows=(3,))
    model = nn.Sequential(layer, nn.ReLU(), make_layer(4, 12, 0.5, bias=False))
    traced = torch.fx.symbolic_trace(model)
    nodes = [(node.op, node.target) for node in traced.graph.nodes if node.op not in ("placeholder", "output")]
    forward = snack.nn.tracing.fx_layer_forward
    assert nodes == [
        ("get_attr", "0"), ("call_function", forward), ("call_module", "1"), ("get_attr", "2"), ("call_function", forward)
    ]  # fmt: skip
    for shape in ((5, 10), (1, 10), (2, 3, 10)):
        x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
        torch.testing.assert_close(traced(x), model(x))
    x = torch.randn(5, 10, dtype=torch.float64, requires_grad=True)
    y = model[0](x)
    grad_out = torch.randn_like(y)
    expected = dense_forward_and_grads(layer, x, grad_out)
    got = torch.autograd.grad(torch.fx.symbolic_trace(nn.Sequential(layer))(x), (x, layer.values, layer.bias), grad_out)
    for got_grad, expected_grad in zip(got, expected[1:]):
        torch.testing.assert_close(got_grad, expected_grad)


def test_an_fx_program_follows_rewires_and_applies_the_layers_hooks_once():
    # it held the old row/col with the same values Parameter: after a rewire, new values at the old
    # coordinates (silently wrong). The hooks present when tracing are in the graph, once.
    layer = make_layer(12, 10, 0.5)
    model = nn.Sequential(layer, nn.ReLU())
    layer.register_forward_pre_hook(lambda module, args: (args[0] + 1,))
    layer.register_forward_hook(lambda module, args, output: output * 2)
    traced = torch.fx.symbolic_trace(model)
    other = same_size_other(layer)
    layer.set_topology(other.row, other.col, other.values.detach())
    x = torch.randn(3, 10, dtype=torch.float64)
    torch.testing.assert_close(traced(x), torch.relu(2 * ((x + 1) @ layer.to_dense().T + layer.bias)))
    torch.testing.assert_close(traced(x), model(x))


def test_a_traced_root_layer_records_one_call_on_its_tensors():
    layer = make_layer(12, 10, 0.7)
    traced = torch.fx.symbolic_trace(layer)
    calls = [node for node in traced.graph.nodes if node.op.startswith("call")]
    assert len(calls) == 1 and "fx_sparse_linear" in str(calls[0].target)
    x = torch.randn(2, 3, 10, dtype=torch.float64)
    torch.testing.assert_close(traced(x), layer(x))


def test_fx_traces_a_layer_applied_to_a_buffer_or_a_tensor_made_in_forward():
    # not a Proxy input: the shape check branched on the proxied values and tracing failed
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = make_layer(8, 6, 0.5)
            self.register_buffer("query", torch.randn(2, 6, dtype=torch.float64))

        def forward(self, x):
            return x + self.fc(self.query).sum() + self.fc(torch.ones(1, 6, dtype=torch.float64)).sum()

    model = Model()
    traced = torch.fx.symbolic_trace(model)
    assert sum(node.target is snack.nn.tracing.fx_layer_forward for node in traced.graph.nodes) == 2
    x = torch.randn(3, dtype=torch.float64)
    torch.testing.assert_close(traced(x), model(x))


def test_fake_tensor_shape_propagation_runs_a_layer():
    # FakeTensorProp runs each module on fake tensors: the eager kernels cannot take them, the
    # custom ops' fake kernels can; the layer's cached index data must stay real
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    layer = make_layer(8, 6, 0.5)
    traced = torch.fx.symbolic_trace(nn.Sequential(layer, nn.ReLU()))
    FakeTensorProp(traced, FakeTensorMode(allow_non_fake_inputs=True)).propagate(torch.randn(4, 6, dtype=torch.float64))
    output = traced.graph.find_nodes(op="output")[0].args[0].meta["val"]
    assert isinstance(output, FakeTensor) and output.shape == (4, 8) and output.dtype == torch.float64
    assert not any(isinstance(t, FakeTensor) for t in layer.topology.tensors())
    x = torch.randn(3, 6, dtype=torch.float64)
    torch.testing.assert_close(layer(x), x @ layer.to_dense().T + layer.bias)


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
def test_torch_jit_trace_matches_eager_and_saves(tmp_path):
    """A traced model records the custom op and how the derived index data follow from row/col."""
    layer = make_layer(12, 10, 0.7, dtype=torch.float32, empty_rows=(3,))
    model = nn.Sequential(layer, nn.ReLU())
    x = torch.randn(5, 10, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", torch.jit.TracerWarning)  # the input check warned it is not traced
        traced = torch.jit.trace(model, x)
    graph = str(traced.inlined_graph)
    assert "snack::topology_index_data" in graph and "sort" not in graph  # derived once per topology, not per call
    torch.jit.save(traced, tmp_path / "model.pt")
    loaded = torch.jit.load(tmp_path / "model.pt")
    for batch in (5, 1, 7):
        x = torch.randn(batch, 10, requires_grad=True)
        pre_activation = dense_forward_and_grads(layer, x, torch.ones(batch, 12))[0]
        for module in (traced, loaded):
            torch.testing.assert_close(module(x), pre_activation.relu())
        y = traced(x)
        got = torch.autograd.grad(y, (x, layer.values, layer.bias), torch.ones_like(y))
        expected = dense_forward_and_grads(layer, x, (pre_activation > 0).to(x.dtype))[1:]
        for got_grad, expected_grad in zip(got, expected):
            torch.testing.assert_close(got_grad, expected_grad)


@pytest.mark.parametrize("warm", [False, True], ids=["exported-first", "eager-first"])
def test_torch_export_with_dynamic_batch_matches_eager(tmp_path, warm):
    """``torch.export`` records the custom op and how the derived index data follow from the
    buffers, warm cache or not: the program follows another layer's state loaded into it."""
    layer = make_layer(12, 10, 0.7, dtype=torch.float32, empty_rows=(3,))
    if warm:
        layer(torch.randn(2, 10))  # builds the cache, which the program must not hold as constants
    else:
        layer.topology  # a cache with nothing derived yet, which export must not fill with fake tensors
    batch = torch.export.Dim("batch")
    program = torch.export.export(layer, (torch.randn(5, 10),), dynamic_shapes=({0: batch},))
    assert not any(node.target is torch.ops.aten.sort.stable for node in program.graph.nodes)  # not per call
    x = torch.randn(3, 10)
    torch.testing.assert_close(layer(x), dense_forward_and_grads(layer, x, torch.ones(3, 12))[0])
    torch.export.save(program, tmp_path / "layer.pt2")
    loaded = torch.export.load(tmp_path / "layer.pt2").module()
    for rows in (5, 1, 7):
        x = torch.randn(rows, 10)
        torch.testing.assert_close(loaded(x), dense_forward_and_grads(layer, x, torch.ones(rows, 12))[0])
    other = same_size_other(layer)
    loaded.load_state_dict(other.state_dict(), strict=False)  # (the program holds no _extra_state)
    x = torch.randn(3, 10)
    torch.testing.assert_close(loaded(x), dense_forward_and_grads(other, x, torch.ones(3, 12))[0])
    with torch.no_grad():
        loaded.col[1] = loaded.col[0]  # coordinates the program is given are validated
        loaded.row[1] = loaded.row[0]
    with pytest.raises(ValueError, match="duplicate coordinate"):
        loaded(x)


def test_topology_index_data_op_passes_opcheck_and_matches_the_topology():
    layer = make_layer(12, 10, 0.7, empty_rows=(3,), empty_cols=(4,))
    got = torch.ops.snack.topology_index_data(layer.row, layer.col, 12, 10)
    topology = layer.topology
    for part, expected in zip(got[:2], (topology.rowptr, topology.colptr)):
        assert torch.equal(part, expected) and part.data_ptr() != expected.data_ptr()  # copies
    # no column order on the CPU (its kernels never read one; a traced program used to copy it
    # at every call), as Topology.tensors(); other devices get it whole
    assert got[2].shape == (0,) and got[2].dtype == torch.int32
    assert tracing._csc_perm_length(torch.empty(5, device="meta")) == 5
    torch.library.opcheck(torch.ops.snack.topology_index_data, (layer.row, layer.col, 12, 10))
    torch.library.opcheck(torch.ops.snack.topology_index_data, (layer.row.long(), layer.col.long(), 12, 10))
    # the same coordinates for another shape: derived (and validated) for that shape, not reused
    rowptr = torch.ops.snack.topology_index_data(layer.row, layer.col, 12, 20)[0]
    assert torch.equal(rowptr, topology.rowptr)
    colptr = torch.ops.snack.topology_index_data(layer.row, layer.col, 12, 20)[1]
    assert colptr.shape == (21,)
    with pytest.raises(ValueError, match="row index 11 is out of range for size 2"):
        torch.ops.snack.topology_index_data(layer.row, layer.col, 2, 20)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")  # Topology's validation, traced
@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
def test_a_traced_function_follows_the_coordinates_it_is_given():
    a = make_layer(12, 10, 0.7, dtype=torch.float32)
    b = same_size_other(a)

    def f(x, values, row, col):
        return snack.ops.sparse_linear(x, values, snack.Topology(row, col, (12, 10)))

    x = torch.randn(4, 10)
    traced = torch.jit.trace(f, (x, a.values.detach(), a.row, a.col))
    for layer in (a, b):
        expected = x @ layer.to_dense().detach().T
        torch.testing.assert_close(traced(x, layer.values.detach(), layer.row, layer.col), expected)


def test_traced_programs_pickle_and_pickles_made_before_nn_became_a_package_resolve():
    """Whole-model pickles name snack.nn.SparseLinear; a pickled GraphModule imports the function
    its graph calls from where nn.py kept it (snack.nn._fx_layer_forward)."""
    assert snack.nn.SparseLinear.__module__ == "snack.nn"
    assert snack.nn._fx_layer_forward is snack.nn.tracing.fx_layer_forward
    assert snack.nn._fx_sparse_linear is snack.nn.tracing.fx_sparse_linear
    x = torch.randn(3, 5, dtype=torch.float64)
    for model in (nn.Sequential(make_layer(6, 5, 0.5), nn.ReLU()), make_layer(6, 5, 0.5)):  # a layer as the root too
        traced = torch.fx.symbolic_trace(model)
        torch.testing.assert_close(pickle.loads(pickle.dumps(traced))(x), model(x))
