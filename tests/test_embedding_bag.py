"""SparseEmbeddingBag: against ``F.embedding_bag`` on the dense table, gradients included."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from conftest import check_topology_invariants
from test_truly_sparse import LargestTensorMode
from torch import nn

import snack
from snack.dst.prune_grow import random_grow
from snack.embedding_ops import embedding_bag, embedding_bag_values_grad
from snack.nn.bags import bag_of_each_id

MODES = ("sum", "mean", "max")


def _bag_layer(num_embeddings=40, embedding_dim=12, sparsity=0.6, *, mode="mean", padding_idx=None, empty_rows=()):
    table = torch.randn(num_embeddings, embedding_dim, dtype=torch.float64)
    table[list(empty_rows)] = 0
    if padding_idx is not None:
        table[padding_idx] = 0
    dense = nn.EmbeddingBag(num_embeddings, embedding_dim, mode=mode, padding_idx=padding_idx, dtype=torch.float64)
    with torch.no_grad():
        dense.weight.copy_(table * (torch.rand(table.shape) >= sparsity))
    return snack.SparseEmbeddingBag.from_dense(dense)


def _dense_bags(layer, input, offsets=None, per_sample_weights=None, grad_out=None):
    """``(y, dvalues, dweights)`` of ``F.embedding_bag`` on ``layer``'s dense table, the table's
    gradient read at the connections."""
    table = layer.to_dense().detach().requires_grad_()
    weights = None if per_sample_weights is None else per_sample_weights.detach().requires_grad_()
    y = F.embedding_bag(
        input, table, offsets, mode=layer.mode, per_sample_weights=weights, padding_idx=layer.padding_idx,
        include_last_offset=layer.include_last_offset,
    )
    if grad_out is None:
        return y.detach(), None, None
    inputs = (table,) if weights is None else (table, weights)
    grads = torch.autograd.grad(y, inputs, grad_out)
    return y.detach(), grads[0][layer.row.long(), layer.col.long()], (grads[1] if weights is not None else None)


# 1-D ids with offsets: bag 1 and the last are empty; ids 5 (no connections) and 0 (padding) looked up
IDS = torch.tensor([5, 0, 3, 3, 0, 7, 1, 39, 5])
OFFSETS = torch.tensor([0, 3, 3, 6, 9])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("padding_idx", [None, 0])
@pytest.mark.parametrize("form", ["offsets", "last_offset", "2d", "one_bag"])
def test_bags_and_gradients_match_dense_math(mode, padding_idx, form):
    torch.manual_seed(0)
    layer = _bag_layer(mode=mode, padding_idx=padding_idx, empty_rows=(5,))
    input, offsets = IDS, OFFSETS
    if form == "last_offset":
        layer.include_last_offset, offsets = True, torch.cat([OFFSETS, torch.tensor([IDS.numel()])])
    elif form == "2d":
        input, offsets = IDS.view(3, 3), None
    elif form == "one_bag":  # batch 1
        offsets = torch.tensor([0])
    y = layer(input, offsets)
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    expected_y, expected_grad, _ = _dense_bags(layer, input, offsets, grad_out=grad_out)
    assert y.shape == expected_y.shape and y.dtype == torch.float64
    torch.testing.assert_close(y, expected_y)
    torch.testing.assert_close(layer.values.grad, expected_grad)


def test_per_sample_weights_and_their_gradient_match_dense_math():
    layer = _bag_layer(mode="sum", padding_idx=0)
    weights = torch.randn(IDS.shape, dtype=torch.float64, requires_grad=True)
    y = layer(IDS, OFFSETS, weights)
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    expected_y, expected_grad, expected_weights_grad = _dense_bags(layer, IDS, OFFSETS, weights, grad_out)
    torch.testing.assert_close(y, expected_y)
    torch.testing.assert_close(layer.values.grad, expected_grad)
    torch.testing.assert_close(weights.grad, expected_weights_grad)
    # a 2-D input takes weights of its shape
    y2 = layer(IDS.view(3, 3), None, weights.detach().view(3, 3))
    torch.testing.assert_close(y2, _dense_bags(layer, IDS.view(3, 3), None, weights.detach().view(3, 3))[0])


@pytest.mark.parametrize("mode", MODES)
def test_gradcheck_float64(mode):
    torch.manual_seed(1)
    layer = _bag_layer(9, 5, 0.4, mode=mode, padding_idx=2)
    values = layer.values.detach().clone().requires_grad_()
    weights = torch.randn(IDS.shape, dtype=torch.float64, requires_grad=True) if mode == "sum" else None
    ids = IDS % 9

    def bags(v, *w):
        return torch.func.functional_call(layer, {"values": v}, (ids, OFFSETS, *w))

    assert torch.autograd.gradcheck(bags, (values,) if weights is None else (values, weights))


@pytest.mark.parametrize("mode", MODES)
def test_no_connections_no_ids_and_bags_of_no_ids(mode):
    empty = snack.SparseEmbeddingBag.from_dense(torch.zeros(6, 4), mode=mode)
    assert empty.nnz == 0
    y = empty(torch.tensor([1, 2, 3]), torch.tensor([0, 1]))
    assert torch.equal(y, torch.zeros(2, 4))
    y.sum().backward()
    assert empty.values.grad.shape == (0,)
    layer = _bag_layer(mode=mode)
    for input, offsets, bags in [
        (torch.empty(0, dtype=torch.int64), torch.tensor([0, 0]), 2),  # no ids, two empty bags
        (torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64), 0),  # no bags at all
        (torch.empty(3, 0, dtype=torch.int64), None, 3),  # three bags of length 0 (F.embedding_bag fails)
    ]:
        y = layer(input, offsets)
        assert torch.equal(y, torch.zeros(bags, layer.embedding_dim, dtype=torch.float64))
        if input.dim() == 1:
            torch.testing.assert_close(y, _dense_bags(layer, input, offsets)[0])


def test_int32_ids_and_offsets_and_16_bit_values():
    layer = snack.SparseEmbeddingBag(30, 8, mode="sum", dtype=torch.bfloat16)
    y = layer(IDS.int() % 30, OFFSETS.int())
    assert y.dtype == torch.bfloat16
    expected = F.embedding_bag(IDS % 30, layer.to_dense().float(), OFFSETS, mode="sum")
    torch.testing.assert_close(y.float(), expected, rtol=2e-2, atol=2e-2)


def test_output_under_autocast_keeps_the_tables_dtype_as_nn_embedding_bag_does():
    layer = snack.SparseEmbeddingBag(30, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(torch.tensor([[1, 2], [3, 4]]))
    assert y.dtype == torch.float32


@pytest.mark.parametrize("mode", MODES)
def test_sparse_gradients_hold_the_connections_of_the_ids_rows(mode):
    """``sparse=True`` on the fused sum's path and the rows' (max): the gradient of the looked-up
    rows' connections, as a sparse COO tensor."""
    layer = _bag_layer(mode=mode, padding_idx=0)
    dense_gradient = copy.deepcopy(layer)
    layer.sparse = True
    grad_out = torch.randn(5, 12, dtype=torch.float64)
    layer(IDS, OFFSETS).backward(grad_out)
    dense_gradient(IDS, OFFSETS).backward(grad_out)
    assert layer.values.grad.layout == torch.sparse_coo
    touched = torch.isin(layer.row, IDS).nonzero().view(-1)
    assert torch.equal(layer.values.grad.coalesce().indices()[0], touched)
    torch.testing.assert_close(layer.values.grad.to_dense(), dense_gradient.values.grad)


# --------------------------------------------------------------------- the fused sum


def _bag_operands(layer, ids, offsets, weights):
    """The operands of ``snack::embedding_bag`` for ``layer``'s table and these bags."""
    topology = layer.topology
    bag, bags = bag_of_each_id(ids, offsets, False)
    return (layer.values.detach(), topology.row, topology.col, topology.rowptr, ids, bag, weights, bags)


def _dense_weighted_bags(layer, ids, offsets, weights, grad):
    """``(Y, dvalues, dweights)`` of the weighted bag sums in float64 dense math."""
    table = layer.to_dense().detach().double().requires_grad_()
    weights = weights.detach().double().requires_grad_()
    y = F.embedding_bag(ids, table, offsets, mode="sum", per_sample_weights=weights)
    dtable, dweights = torch.autograd.grad(y, (table, weights), grad.double())
    return y.detach(), dtable[layer.row.long(), layer.col.long()], dweights


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_native_bag_kernels_match_the_torch_calls_and_dense_math(dtype):
    """``embedding_bag_kernels``: the CPU's kernels against the torch calls that run elsewhere and
    float64 dense math, on repeated ids, empty rows and bags, odd sizes; with the weights' gradient."""
    torch.manual_seed(3)
    layer = _bag_layer(301, 33, 0.8, mode="sum", empty_rows=(0, 7)).to(dtype)
    ids = torch.cat([torch.randint(0, 301, (500,)), torch.tensor([7, 7, 7, 0, 300, 300])])
    offsets = torch.tensor([0, 0, 1, 100, 100, 333, 505])  # empty bags first, in the middle; one id last
    weights = torch.randn(ids.shape).to(dtype)
    operands = _bag_operands(layer, ids, offsets, weights)
    grad = torch.randn(7, 33).to(dtype)
    expected, expected_dvalues, expected_dweights = _dense_weighted_bags(layer, ids, offsets, weights, grad)
    tolerance = dict(rtol=0, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-2, atol=8e-2)
    for backend in ("cpu", "reference"):
        with snack.use_backend(backend):
            values = operands[0].clone().requires_grad_()
            bag_weights = weights.clone().requires_grad_()
            y = embedding_bag(values, *operands[1:6], bag_weights, operands[7], 33)
            y.backward(grad)
        torch.testing.assert_close(y.double(), expected, **tolerance)
        torch.testing.assert_close(values.grad.double(), expected_dvalues, **tolerance)
        torch.testing.assert_close(bag_weights.grad.double(), expected_dweights, **tolerance)


def test_the_bag_ops_pass_opcheck_and_gradcheck():
    layer = _bag_layer(9, 5, 0.5, mode="sum")
    ids, offsets = IDS % 9, OFFSETS
    weights = torch.randn(9, dtype=torch.float64, requires_grad=True)
    values, *rest = _bag_operands(layer, ids, offsets, weights)
    values = values.clone().requires_grad_()
    torch.library.opcheck(embedding_bag, (values, *rest[:5], weights, rest[6], 5))
    grad = torch.randn(5, 5, dtype=torch.float64)
    torch.library.opcheck(embedding_bag_values_grad, (grad, *rest[:5], weights.detach()))
    assert torch.autograd.gradcheck(lambda v, w: embedding_bag(v, *rest[:5], w, rest[6], 5), (values, weights))


def test_native_bag_kernels_refuse_bad_operands():
    layer = _bag_layer(10, 4, mode="sum")
    topology = layer.topology
    values, ones = layer.values.detach(), torch.ones(3, dtype=torch.float64)

    def native(ids, bag, weights=ones):
        return torch.ops.snack_cpu.embedding_bag(values, topology.rowptr, topology.col, ids, bag, weights, 2, 4)

    with pytest.raises(RuntimeError, match=r"ids must lie in \[0, 10\), got 1..10"):
        native(torch.tensor([1, 10, 2]), torch.tensor([0, 0, 1]))
    with pytest.raises(RuntimeError, match=r"bag must be non-decreasing, in \[0, 2\)"):
        native(torch.tensor([1, 2, 3]), torch.tensor([1, 0, 1]))
    with pytest.raises(RuntimeError, match=r"bag must be non-decreasing, in \[0, 2\)"):
        native(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="weights must have values' dtype"):
        native(torch.tensor([1, 2, 3]), torch.tensor([0, 0, 1]), ones.float())


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_the_fused_sum_the_looked_up_rows_and_the_reference_backend_agree(mode):
    """A sum or mean runs the fused op, except while RigL records (the rows looked up, then
    added): both, and the torch calls, give one result."""
    layer = _bag_layer(50, 16, 0.7, mode=mode, padding_idx=3)
    ids, offsets = torch.randint(0, 50, (60,)), torch.tensor([0, 4, 4, 30, 59])
    ids[:5] = 3
    fused = layer(ids, offsets)
    layer._lookup_hooks[0] = lambda *args: None  # as RigL arms it
    rows_added = layer(ids, offsets)
    layer._lookup_hooks.clear()
    with snack.use_backend("reference"):
        in_torch = layer(ids, offsets)
    torch.testing.assert_close(fused, rows_added, rtol=0, atol=1e-12)
    torch.testing.assert_close(fused, in_torch, rtol=0, atol=1e-12)
    torch.testing.assert_close(fused, _dense_bags(layer, ids, offsets)[0], rtol=0, atol=1e-12)


# --------------------------------------------------------------------- construction and errors


def test_construction_keeps_the_options_and_nn_embeddings_variance():
    layer = snack.SparseEmbeddingBag(2_000, 64, mode="sum", padding_idx=-1, include_last_offset=True, sparsity=0.9)
    assert (layer.mode, layer.padding_idx, layer.include_last_offset) == ("sum", 1_999, True)
    assert layer.nnz == round(0.1 * 1_999 * 64) and not (layer.row == 1_999).any()
    rows = layer(torch.arange(1_999), torch.arange(2_000))  # bags of one id each
    assert abs(rows.var().item() - 1.0) < 0.05  # as nn.EmbeddingBag's N(0, 1) rows
    assert "mode='sum', include_last_offset=True" in repr(layer)
    assert snack.SparseEmbeddingBag(5, 3).mode == "mean"  # nn.EmbeddingBag's default


def test_from_dense_carries_the_options_and_keeps_the_largest_entries():
    dense = nn.EmbeddingBag(20, 6, mode="max", padding_idx=4, include_last_offset=True, sparse=True)
    layer = snack.SparseEmbeddingBag.from_dense(dense, sparsity=0.5)
    assert (layer.mode, layer.padding_idx, layer.include_last_offset, layer.sparse) == ("max", 4, True, True)
    kept = layer.to_dense() != 0
    assert kept.sum() == 60 and torch.equal(layer.to_dense()[kept], dense.weight.detach()[kept])
    assert dense.weight.detach().abs()[~kept].max() <= dense.weight.detach().abs()[kept].min()
    from_table = snack.SparseEmbeddingBag.from_dense(dense.weight.detach(), mode="sum")
    assert (from_table.mode, from_table.padding_idx, from_table.nnz) == ("sum", None, 114)  # all but the padding row
    assert not from_table.sparse


@pytest.mark.parametrize(
    "arguments, error, match",
    [
        (dict(mode="median"), ValueError, "mode must be one of 'sum', 'mean', 'max', got 'median'"),
        (dict(include_last_offset=1), TypeError, "include_last_offset must be a bool, got int"),
        (dict(padding_idx=10), ValueError, "padding_idx must be in"),
    ],
)
def test_bad_options_raise(arguments, error, match):
    with pytest.raises(error, match=match):
        snack.SparseEmbeddingBag(10, 4, **arguments)


def test_from_dense_refuses_what_a_sparse_table_lacks_and_bad_arguments():
    with pytest.raises(ValueError, match="no counterpart of nn.EmbeddingBag's max_norm=1.0"):
        snack.SparseEmbeddingBag.from_dense(nn.EmbeddingBag(10, 4, max_norm=1.0))
    with pytest.raises(TypeError, match="must be an nn.EmbeddingBag or a Tensor, got Linear"):
        snack.SparseEmbeddingBag.from_dense(nn.Linear(4, 10))
    with pytest.raises(ValueError, match="mode must be one of"):
        snack.SparseEmbeddingBag.from_dense(torch.randn(10, 4), mode="min")
    with pytest.raises(ValueError, match=r"must be \(num_embeddings, embedding_dim\), got \(10,\)"):
        snack.SparseEmbeddingBag.from_dense(torch.randn(10))


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda e: e(IDS.view(3, 3), torch.tensor([0, 3])), ValueError, "offsets must be None for a 2-D input"),
        (lambda e: e(IDS), ValueError, "a 1-D input needs offsets"),
        (lambda e: e(IDS.view(1, 3, 3)), ValueError, r"1-D ids with offsets, or 2-D \(bags, ids\), got \(1, 3, 3\)"),
        (lambda e: e([1, 2], [0]), ValueError, "got list"),
        (lambda e: e(IDS, torch.tensor([1, 3])), ValueError, r"start at 0, got offsets\[0\] = 1 \(input holds 9"),
        (lambda e: e(IDS, torch.tensor([0, 5, 3])), ValueError, r"decrease, got offsets\[1\] = 5 > offsets\[2\] = 3"),
        (lambda e: e(IDS, torch.tensor([0, 10])), ValueError, r"not pass the number of ids, got offsets\[-1\] = 10"),
        (lambda e: e(IDS, torch.tensor([0.0, 3.0])), ValueError, "offsets must be a 1-D int64 or int32 tensor"),
        (lambda e: e(IDS, torch.tensor([[0, 3]])), ValueError, "offsets must be a 1-D int64 or int32 tensor"),
        (lambda e: e(IDS.float(), OFFSETS), TypeError, "input must hold integer ids"),
        (lambda e: e(IDS + 40, OFFSETS), IndexError, r"input holds id 79, outside \[0, 39\]"),
        (lambda e: e(IDS, OFFSETS, torch.ones(9)), ValueError, "per_sample_weights needs mode='sum'"),
    ],
)
def test_bad_arguments_raise_and_change_nothing(call, error, match):
    layer = _bag_layer(mode="mean")
    before = copy.deepcopy(layer.state_dict())
    with pytest.raises(error, match=match):
        call(layer)
    assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())
    assert layer.values.grad is None


@pytest.mark.parametrize(
    "weights, match",
    [
        (torch.ones(8, dtype=torch.float64), r"per_sample_weights must have input's shape \(9,\), got \(8,\)"),
        (torch.ones(9), "per_sample_weights must be torch.float64 on cpu as the layer, got torch.float32"),
    ],
)
def test_bad_per_sample_weights_raise(weights, match):
    with pytest.raises(ValueError, match=match):
        _bag_layer(mode="sum")(IDS, OFFSETS, weights)


def test_include_last_offset_needs_the_number_of_ids_last():
    layer = _bag_layer(mode="sum")
    layer.include_last_offset = True
    with pytest.raises(ValueError, match="with include_last_offset, offsets must end with the number of ids, got 6"):
        layer(IDS, torch.tensor([0, 3, 6]))
    with pytest.raises(ValueError, match="with include_last_offset, offsets must hold at least the last one"):
        layer(IDS[:0], IDS[:0])


def test_reading_weight_says_what_to_use():
    with pytest.raises(AttributeError, match="turns the layers back into nn.EmbeddingBag"):
        snack.SparseEmbeddingBag(5, 3).weight


def test_state_dict_deepcopy_and_pickle_keep_the_options():
    layer = _bag_layer(mode="max", padding_idx=3)
    layer.include_last_offset = True
    last_offsets = torch.cat([OFFSETS, torch.tensor([9])])
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    for copied in (copy.deepcopy(layer), torch.load(buffer, weights_only=False)):
        assert (copied.mode, copied.padding_idx, copied.include_last_offset) == ("max", 3, True)
        assert torch.equal(copied(IDS, last_offsets), layer(IDS, last_offsets))
    other = _bag_layer(mode="max", sparsity=0.2)
    other.load_state_dict(layer.state_dict())  # another nnz
    assert torch.equal(other.to_dense(), layer.to_dense())


# --------------------------------------------------------------------- sparsify, densify


def _recommender():
    """Two categorical features pooled by bags, then an MLP (a DLRM in miniature)."""
    model = nn.Module()
    model.users = nn.EmbeddingBag(60, 8, mode="sum")
    model.items = nn.EmbeddingBag(40, 8, mode="mean", padding_idx=0)
    model.top = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 1))
    return model


def _score(model, users, items):
    return model.top(torch.cat([model.users(users), model.items(items)], dim=1)).squeeze(1)


def test_sparsify_converts_bags_only_when_asked_and_densify_gives_them_back():
    model = snack.sparsify(_recommender(), 0.5)
    assert type(model.users) is nn.EmbeddingBag
    dense = _recommender()
    users, items = torch.randint(0, 60, (5, 3)), torch.randint(0, 40, (5, 4))
    model = snack.sparsify(copy.deepcopy(dense), 0.5, embeddings=True)
    assert isinstance(model.users, snack.SparseEmbeddingBag) and model.users.mode == "sum"
    assert (model.items.mode, model.items.padding_idx) == ("mean", 0)
    at_zero = snack.sparsify(copy.deepcopy(dense), 0.0, embeddings=True)
    torch.testing.assert_close(_score(at_zero, users, items), _score(dense, users, items))
    back = snack.densify(model)
    assert type(back.users) is nn.EmbeddingBag and (back.items.mode, back.items.padding_idx) == ("mean", 0)
    expected = snack.sparsify(copy.deepcopy(dense), 0.5, embeddings=True).users.to_dense()
    torch.testing.assert_close(back.users.weight, expected)


@pytest.mark.filterwarnings("ignore:sparsify converted no layer")
def test_sparsify_random_init_keeps_the_tables_scale_and_leaves_max_norm_bags_dense():
    dense = nn.EmbeddingBag(500, 16, include_last_offset=True)
    with torch.no_grad():
        dense.weight.mul_(0.05)
    layer = snack.sparsify(nn.Sequential(dense), 0.9, embeddings=True, init="random")[0]
    assert layer.include_last_offset
    assert layer.values.std().item() == pytest.approx(0.05 * (16 / 1.6) ** 0.5, rel=0.1)
    with pytest.warns(UserWarning, match=r"layer\(s\) dense: 0 \(max_norm=1.0\)"):
        snack.sparsify(nn.Sequential(nn.EmbeddingBag(50, 4, max_norm=1.0)), embeddings=True)


# --------------------------------------------------------------------- dynamic sparse training


@pytest.mark.parametrize("mode", MODES)
def test_rigl_grows_where_the_tables_gradient_is_largest(mode):
    torch.manual_seed(2)
    layer = snack.SparseEmbeddingBag(50, 16, mode=mode, sparsity=0.9)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.0)  # the step changes no value
    dst = snack.dst.RigL(layer, optimizer, update_every=1, total_steps=10, drop_fraction=0.25)
    ids, offsets = torch.randint(0, 50, (40,)), torch.tensor([0, 7, 7, 20, 31])
    target = torch.randn(5, 16)
    table = layer.to_dense().detach().requires_grad_()
    dense_loss = (F.embedding_bag(ids, table, offsets, mode=mode) - target).square().sum()
    (gradient,) = torch.autograd.grad(dense_loss, table)
    before = set((layer.row.long() * 16 + layer.col.long()).tolist())
    (layer(ids, offsets) - target).square().sum().backward()
    optimizer.step()
    assert dst.step()
    check_topology_invariants(layer, layer.nnz)
    grown = set((layer.row.long() * 16 + layer.col.long()).tolist()) - before
    assert len(grown) > 0
    scores = gradient.abs().view(-1)
    free_not_grown = [p for p in range(50 * 16) if p not in before and p not in grown]
    assert scores[list(grown)].min() >= scores[free_not_grown].max()


def test_recorded_batch_is_each_ids_gradient():
    seen = {}

    class Recording(snack.dst.DropGrow):
        needs_gradient = True

        def grow(self, layer, k):
            seen["batch"] = self.recorded_batch(layer)
            return random_grow(layer.topology, k, self.generator)

    layer = _bag_layer(mode="mean").float()
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    dst = Recording(layer, optimizer, update_every=1, total_steps=10)
    grad_out = torch.randn(5, 12)
    layer(IDS, OFFSETS).backward(grad_out)
    dst.step()
    recorded_ids, dy = seen["batch"]
    expected = grad_out[torch.tensor([0, 0, 0, 2, 2, 2, 3, 3, 3])] / 3  # bags 0, 2 and 3 hold three ids each
    assert torch.equal(recorded_ids, IDS)
    torch.testing.assert_close(dy, expected)


@pytest.mark.parametrize("algorithm", ["SET", "MEST"])
def test_dst_rewires_a_recommender(algorithm):
    model = snack.sparsify(_recommender(), 0.8, embeddings=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    dst = getattr(snack.dst, algorithm)(model, optimizer, update_every=1, total_steps=10, drop_fraction=0.3)
    users, items = torch.randint(0, 60, (6, 3)), torch.randint(0, 40, (6, 4))
    before = model.users.indices().clone()
    _score(model, users, items).square().mean().backward()
    optimizer.step()
    assert dst.step()
    check_topology_invariants(model.users, model.users.nnz)
    assert not torch.equal(model.users.indices(), before)
    _score(model, users, items).sum().backward()  # and it trains on
    assert model.users.values.grad.shape == (model.users.nnz,)


def test_no_table_sized_tensor_in_a_training_step_and_a_rigl_update():
    layer = snack.SparseEmbeddingBag(20_000, 256, mode="sum", sparsity=0.99)
    optimizer = torch.optim.Adam(layer.parameters())
    dst = snack.dst.RigL(layer, optimizer, update_every=1, total_steps=10)
    ids, offsets = torch.randint(0, 20_000, (512,)), torch.arange(0, 512, 8)
    with LargestTensorMode() as mode:
        layer(ids, offsets, torch.rand(512)).square().sum().backward()
        optimizer.step()
        assert dst.step()
    # the table has 5.1e6 entries; RigL scores blocks of at most 2**20, the lookup is (512, 256)
    assert 512 * 256 <= mode.largest <= 2**20, f"{mode.largest_op} produced {mode.largest} elements"


# --------------------------------------------------------------------- programs and transforms


@pytest.mark.parametrize("mode", MODES)
def test_compiled_model_matches_eager(mode):
    torch._dynamo.reset()
    layer = snack.SparseEmbeddingBag(30, 8, mode=mode, padding_idx=0, sparsity=0.6)
    twin = copy.deepcopy(layer)
    compiled = torch.compile(layer, fullgraph=True)
    ids = IDS % 30
    y, expected = compiled(ids, OFFSETS), twin(ids, OFFSETS)
    torch.testing.assert_close(y, expected)
    y.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(layer.values.grad, twin.values.grad)
    torch.testing.assert_close(compiled(ids.view(3, 3)), twin(ids.view(3, 3)))


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
def test_traced_exported_and_fx_programs_match_eager():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.bag = snack.SparseEmbeddingBag(30, 8, mode="sum", sparsity=0.5)

        def forward(self, ids, offsets, weights):
            return self.bag(ids, offsets, weights).tanh()

    program, ids, weights = Model(), IDS % 30, torch.rand(9)
    expected = program(ids, OFFSETS, weights)
    assert torch.equal(torch.fx.symbolic_trace(program)(ids, OFFSETS, weights), expected)
    root = torch.fx.symbolic_trace(program.bag)  # the layer as the root
    assert torch.equal(root(ids, OFFSETS, weights), program.bag(ids, OFFSETS, weights))
    assert torch.equal(torch.export.export(program, (ids, OFFSETS, weights)).module()(ids, OFFSETS, weights), expected)
    assert torch.equal(torch.jit.trace(program, (ids, OFFSETS, weights))(ids, OFFSETS, weights), expected)


def test_torch_func_grad_and_per_sample_gradients():
    layer = _bag_layer(30, 8, 0.5, mode="mean")
    bags = torch.randint(0, 30, (4, 5))
    params = {"values": layer.values.detach()}

    def loss(parameters, batch):
        return torch.func.functional_call(layer, parameters, (batch,)).square().sum()

    whole = torch.func.grad(loss)(params, bags)["values"]
    torch.testing.assert_close(whole, torch.autograd.grad(loss({"values": layer.values}, bags), layer.values)[0])
    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, bags.unsqueeze(1))["values"]
    for k in range(4):
        torch.testing.assert_close(per_sample[k], torch.func.grad(loss)(params, bags[k : k + 1])["values"])
