"""snack.onnx_translations: models with sparse layers exported by torch.onnx.export and run by
ONNX Runtime give snack's own results, at another batch size than exported, from files that hold
no dense weight."""

from __future__ import annotations

import importlib
import sys

import numpy as np
import onnxruntime as ort  # the extra snack[onnx], in snack[dev]
import pytest
import torch
from torch import nn

import snack


def _export(model: nn.Module, example: torch.Tensor):
    """The ONNX model of ``model`` (eval mode), with the batch dimension dynamic."""
    batch = torch.export.Dim("batch", min=1, max=1024)
    dims = {0: batch} if example.dim() > 1 else None
    program = torch.onnx.export(
        model.eval(), (example,), dynamo=True, custom_translation_table=snack.onnx_translations(),
        dynamic_shapes=(dims,), verbose=False,
    )
    return program.model_proto


def _export_ids(model: nn.Module, example: torch.Tensor):
    """The ONNX model of ``model`` (eval mode) taking token ids ``(batch, length)``, both dynamic."""
    dims = {0: torch.export.Dim("batch", max=1024), 1: torch.export.Dim("length", max=1024)}
    program = torch.onnx.export(
        model.eval(), (example,), dynamo=True, custom_translation_table=snack.onnx_translations(),
        dynamic_shapes=(dims,), verbose=False,
    )
    return program.model_proto


def _run(proto, x: torch.Tensor) -> np.ndarray:
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]


def _without_connections(layer: snack.SparseLinear) -> snack.SparseLinear:
    empty = torch.zeros(0, dtype=torch.int64)
    layer.set_topology(empty, empty)
    return layer


def _with_empty_rows_and_columns(out_features: int, in_features: int) -> snack.SparseLinear:
    weight = torch.randn(out_features, in_features) * (torch.rand(out_features, in_features) < 0.3)
    weight[::3] = 0
    weight[:, 1::4] = 0
    return snack.SparseLinear.from_dense(weight, bias=torch.randn(out_features))


class _Outputs(nn.Module):
    """A recurrent layer's outputs alone (not its final state)."""

    def __init__(self, recurrent: nn.Module):
        super().__init__()
        self.recurrent = recurrent

    def forward(self, x):
        return self.recurrent(x)[0]


MODELS = {
    "mlp": lambda: (
        nn.Sequential(
            snack.SparseLinear(13, 31, sparsity=0.8), nn.ReLU(), _with_empty_rows_and_columns(17, 31), nn.Tanh(),
            _without_connections(snack.SparseLinear(17, 5)), nn.ReLU(), snack.SparseLinear(5, 7, sparsity=0.0),
            snack.SparseLinear(7, 3, bias=False, sparsity=0.5),
        ),
        (13,),
    ),
    "conv2d": lambda: (
        nn.Sequential(
            snack.SparseConv2d(3, 8, 3, padding=1, sparsity=0.7), nn.ReLU(),
            snack.SparseConv2d(8, 6, 3, stride=2, groups=2, bias=False, sparsity=0.6),
        ),
        (3, 9, 11),
    ),
    "conv1d": lambda: (snack.SparseConv1d(4, 6, 5, padding=2, dilation=2, sparsity=0.8), (4, 23)),
    "depthwise": lambda: (snack.SparseConv2d(4, 4, 3, padding=1, groups=4, sparsity=0.5), (4, 6, 5)),
    "conv3d": lambda: (snack.SparseConv3d(2, 4, 3, padding=1, sparsity=0.7), (2, 5, 4, 6)),
    "conv_transpose3d": lambda: (snack.SparseConvTranspose3d(2, 3, 2, stride=2, sparsity=0.5), (2, 3, 2, 4)),
    "conv_transpose2d": lambda: (snack.SparseConvTranspose2d(5, 3, 4, stride=2, padding=1, sparsity=0.7), (5, 6, 7)),
    "conv_transpose1d": lambda: (snack.SparseConvTranspose1d(4, 2, 3, stride=3, sparsity=0.5), (4, 9)),
    "transformer": lambda: (  # SparseMultiheadAttention: its projections, then scaled_dot_product_attention
        snack.sparsify(nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2,
                                             enable_nested_tensor=False), 0.7),
        (5, 16),
    ),  # fmt: skip
    "lstm": lambda: (_Outputs(snack.SparseLSTM(4, 6, 2, batch_first=True, bidirectional=True, proj_size=3)), (7, 4)),
    "gru": lambda: (_Outputs(snack.SparseGRU(4, 6, batch_first=True, sparsity=0.6)), (7, 4)),  # the steps unrolled
    "conv_transpose_without_connections": lambda: (
        nn.Sequential(_without_connections(snack.SparseConvTranspose2d(3, 2, 3, padding=1)), nn.ReLU()), (3, 5, 4),
    ),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_onnx_runtime_gives_snacks_results_at_any_batch(name):
    torch.manual_seed(0)
    model, sample_shape = MODELS[name]()
    proto = _export(model, torch.randn(3, *sample_shape))
    for batch in (1, 5):
        x = torch.randn(batch, *sample_shape)
        with torch.no_grad():
            expected = model(x)
        np.testing.assert_allclose(_run(proto, x), expected.numpy(), rtol=1e-5, atol=1e-5)


def test_a_sparse_embedding_exports_with_its_connections_at_any_batch_and_length():
    """Ids of rows with connections, without any (row 0 emptied) and repeated; the file holds
    the connections, not the (50, 12) table."""
    torch.manual_seed(0)
    table = torch.randn(50, 12) * (torch.rand(50, 12) < 0.3)
    table[0] = 0
    model = nn.Sequential(snack.SparseEmbedding.from_dense(table), snack.SparseLinear(12, 4, sparsity=0.5)).eval()
    example = torch.randint(0, 50, (2, 7))
    proto = _export_ids(model, example)
    for ids in (example, torch.tensor([[0, 0, 49, 3, 3]]), torch.randint(0, 50, (3, 11))):
        with torch.no_grad():
            np.testing.assert_allclose(_run(proto, ids), model(ids).numpy(), rtol=1e-6, atol=1e-6)
    sizes = [int(np.prod(t.dims)) for t in proto.graph.initializer]
    assert max(sizes) < 50 * 12 and model[0].nnz in sizes


class _Bags(nn.Module):
    """A bag layer on 1-D ids with offsets (both inputs of the program)."""

    def __init__(self, mode: str):
        super().__init__()
        self.bag = snack.SparseEmbeddingBag(50, 12, mode=mode, padding_idx=0, sparsity=0.7)

    def forward(self, ids, offsets):
        return self.bag(ids, offsets)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_a_sparse_embedding_bag_exports_with_its_connections_at_any_number_of_ids_and_bags(mode):
    """Bags of ids with offsets, both dynamic: empty bags, padding ids, one bag; the fused sum
    (sum, mean) and the rows reduced (max). The file holds the connections, not the table."""
    torch.manual_seed(0)
    model = _Bags(mode).eval()
    dims = ({0: torch.export.Dim("ids", max=4096)}, {0: torch.export.Dim("bags", max=1024)})
    example = (torch.randint(0, 50, (9,)), torch.tensor([0, 3, 3, 6]))
    proto = torch.onnx.export(
        model, example, dynamo=True, custom_translation_table=snack.onnx_translations(), dynamic_shapes=dims,
        verbose=False,
    ).model_proto
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    for ids, offsets in (example, (torch.tensor([0, 5, 5, 49, 0, 2, 7]), torch.tensor([0, 0, 4, 7])),
                         (torch.tensor([3]), torch.tensor([0]))):
        with torch.no_grad():
            expected = model(ids, offsets).numpy()
        got = session.run(None, {names[0]: ids.numpy(), names[1]: offsets.numpy()})[0]
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    sizes = [int(np.prod(t.dims)) for t in proto.graph.initializer]
    assert max(sizes) < 50 * 12 and model.bag.nnz in sizes


def test_a_tied_embedding_and_head_export_with_one_table_of_connections():
    torch.manual_seed(0)
    embedding = snack.SparseEmbedding(50, 12, sparsity=0.7)
    model = nn.Sequential(embedding, nn.Tanh(), snack.SparseTiedHead(embedding, bias=True)).eval()
    with torch.no_grad():
        model[2].bias.uniform_()
    example = torch.randint(0, 50, (2, 7))
    proto = _export_ids(model, example)
    for ids in (example, torch.randint(0, 50, (1, 3))):
        with torch.no_grad():
            np.testing.assert_allclose(_run(proto, ids), model(ids).numpy(), rtol=1e-5, atol=1e-5)
    sizes = [int(np.prod(t.dims)) for t in proto.graph.initializer]
    values = [list(t.dims) for t in proto.graph.initializer if t.name.endswith("values")]
    assert max(sizes) < 50 * 12 and values == [[embedding.nnz]]  # one table, for both uses


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float16, 2e-3)])
def test_other_dtypes_run_in_theirs(dtype, tolerance):
    """(bfloat16 exports too, but ONNX Runtime's CPU MatMul has no bfloat16 kernel, for a dense
    layer's export either.)"""
    torch.manual_seed(0)
    model = nn.Sequential(snack.SparseLinear(16, 24, sparsity=0.7), nn.ReLU(), snack.SparseLinear(24, 8)).to(dtype)
    proto = _export(model, torch.randn(3, 16, dtype=dtype))
    x = torch.randn(4, 16, dtype=dtype)
    out = _run(proto, x)
    assert out.dtype == x.numpy().dtype
    with torch.no_grad():
        np.testing.assert_allclose(out, model(x).numpy(), rtol=tolerance, atol=tolerance)


def test_the_file_holds_the_connections_not_a_dense_weight():
    torch.manual_seed(0)
    layer = snack.SparseLinear(300, 200, sparsity=0.95)
    proto = _export(nn.Sequential(layer), torch.randn(2, 300))
    largest = max(int(np.prod(tensor.dims)) for tensor in proto.graph.initializer)
    assert largest < 200 * 300 // 4, f"an initializer of {largest} elements"


def test_an_infinite_input_reaches_only_the_rows_connected_to_it():
    """The padded rows read an appended zero column, not a real one: inf · 0 would be NaN."""
    layer = snack.SparseLinear.from_coo(
        torch.tensor([0, 0, 1, 2]), torch.tensor([0, 2, 1, 1]), torch.tensor([1.0, 2.0, 3.0, 4.0]), shape=(3, 3)
    )
    proto = _export(nn.Sequential(layer), torch.randn(2, 3))
    x = torch.tensor([[float("inf"), 1.0, 1.0]])
    out = _run(proto, x)
    with torch.no_grad():
        expected = layer(x).numpy()
    assert np.isinf(out[0, 0]) and np.isfinite(out[0, 1:]).all()
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_a_layer_with_more_positions_than_int32_indexes_is_refused():
    layer = snack.SparseLinear(50_000, 50_000, sparsity=0.99999)  # 2.5e9 positions, 25,000 connections
    with pytest.raises(Exception, match="a 50000×50000 layer has more positions than int32 indexes"):
        _export(nn.Sequential(layer), torch.randn(2, 50_000))


def test_without_onnxscript_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # import onnxscript raises ImportError
    monkeypatch.delitem(sys.modules, "snack.onnx_export", raising=False)
    with pytest.raises(ImportError, match=r"pip install onnx onnxscript, or the extra snack\[onnx\]"):
        snack.onnx_translations()
    monkeypatch.undo()
    importlib.import_module("snack.onnx_export")  # importable again
