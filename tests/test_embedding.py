"""SparseEmbedding and its ops: against ``F.embedding`` on the dense table, gradients included."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import check_topology_invariants, tiny_gpt2
from hypothesis import given, settings
from hypothesis import strategies as st
from test_truly_sparse import LargestTensorMode
from torch import nn

import snack
from snack.dst.prune_grow import gradient_grow, random_grow
from snack.embedding_ops import embedding_lookup, embedding_lookup_for_transforms, embedding_values_grad


def _embedding(num_embeddings=40, embedding_dim=12, sparsity=0.7, *, empty_rows=(), dtype=torch.float64):
    table = torch.randn(num_embeddings, embedding_dim, dtype=dtype)
    table[list(empty_rows)] = 0
    return snack.SparseEmbedding.from_dense(table * (torch.rand(table.shape) >= sparsity))


def _dense_lookup_and_grad(layer: snack.SparseEmbedding, ids: torch.Tensor, grad_out: torch.Tensor):
    """``(y, dvalues)`` of ``F.embedding`` on the dense table, the gradient read at the connections."""
    table = layer.to_dense().detach().requires_grad_()
    y = F.embedding(ids, table)
    (grad,) = torch.autograd.grad(y, table, grad_out)
    return y.detach(), grad[layer.row.long(), layer.col.long()]


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (2, 3, 4), ()])
def test_lookup_and_gradient_match_dense_math(shape):
    layer = _embedding(empty_rows=(0, 5))
    ids = torch.randint(0, layer.num_embeddings, shape)
    ids.view(-1)[:1] = 5  # an empty row, looked up
    y = layer(ids)
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    expected_y, expected_grad = _dense_lookup_and_grad(layer, ids, grad_out)
    assert y.shape == (*shape, layer.embedding_dim)
    assert torch.equal(y, expected_y)
    torch.testing.assert_close(layer.values.grad, expected_grad)


def test_repeated_ids_add_their_gradients_and_ids_not_read_get_none():
    layer = _embedding(10, 6, 0.0)
    ids = torch.tensor([3, 3, 3, 7])
    layer(ids).sum().backward()
    by_row = layer.values.grad.view(10, 6)  # every entry is a connection at sparsity 0
    assert torch.equal(by_row[3], torch.full((6,), 3.0, dtype=torch.float64))
    assert torch.equal(by_row[7], torch.ones(6, dtype=torch.float64))
    assert by_row[[0, 1, 2, 4, 5, 6, 8, 9]].abs().sum() == 0


def test_gradcheck_float64():
    layer = _embedding(9, 5, 0.5, empty_rows=(2,))
    ids = torch.tensor([[2, 0, 8], [8, 8, 1]])
    topology = layer.topology
    operands = (topology.row, topology.col, topology.rowptr)
    values = layer.values.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda v: embedding_lookup(v, *operands, ids.view(-1), 5), (values,)
    )


def test_the_ops_pass_opcheck():
    layer = _embedding(9, 5, 0.5, dtype=torch.float32)
    topology, ids = layer.topology, torch.tensor([1, 4, 4, 0, 8])
    operands = (topology.row, topology.col, topology.rowptr)
    values = layer.values.detach().clone().requires_grad_()
    torch.library.opcheck(embedding_lookup, (values, *operands, ids, 5))
    torch.library.opcheck(embedding_values_grad, (torch.randn(5, 5), *operands, ids))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_native_kernels_match_the_torch_calls_and_dense_math(dtype):
    """The CPU's kernels (embedding_kernels.cpp) against the torch calls that run elsewhere, on
    repeated ids, empty rows and odd sizes; gradients against float64 dense math (the two sum in
    other orders, and the torch calls in the values' dtype)."""
    layer = _embedding(301, 33, 0.8, empty_rows=(0, 7)).to(dtype)
    ids = torch.cat([torch.randint(0, 301, (500,)), torch.tensor([7, 7, 7, 0, 300, 300])])
    topology, values = layer.topology, layer.values.detach()
    operands = (topology.row, topology.col, topology.rowptr)
    grad = torch.randn(ids.numel(), 33).to(dtype)
    native = embedding_lookup(values, *operands, ids, 33)
    native_grad = embedding_values_grad(grad, *operands, ids)
    assert torch.equal(native, torch.ops.snack_cpu.embedding_lookup(values, topology.rowptr, topology.col, ids, 33))
    with snack.use_backend("reference"):
        in_torch = embedding_lookup(values, *operands, ids, 33)
        torch_grad = embedding_values_grad(grad, *operands, ids)
    assert torch.equal(native, in_torch) and torch.equal(native, F.embedding(ids, layer.to_dense().detach()))
    table = layer.to_dense().detach().double().requires_grad_()
    (expected,) = torch.autograd.grad(F.embedding(ids, table), table, grad.double())
    expected = expected[layer.row.long(), layer.col.long()]
    tolerance = dict(rtol=0, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(native_grad.double(), expected, **tolerance)
    torch.testing.assert_close(torch_grad.double(), expected, **tolerance)


@settings(max_examples=40, deadline=None)
@given(
    num_embeddings=st.integers(1, 60),
    embedding_dim=st.integers(1, 40),
    sparsity=st.sampled_from([0.0, 0.5, 0.9, 0.99]),
    tokens=st.integers(0, 70),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_native_torch_transforms_and_dense_agree(num_embeddings, embedding_dim, sparsity, tokens, seed):
    """The three lookups (native kernels, torch calls, the transforms' form) and both gradients
    against float64 dense math, on random sizes, densities and ids (repeats, an empty batch)."""
    generator = torch.Generator().manual_seed(seed)
    table = torch.randn(num_embeddings, embedding_dim, generator=generator, dtype=torch.float64)
    table *= torch.rand(table.shape, generator=generator) >= sparsity
    layer = snack.SparseEmbedding.from_dense(table)
    operands = (layer.topology.row, layer.topology.col, layer.topology.rowptr)
    ids = torch.randint(0, num_embeddings, (tokens,), generator=generator)
    grad = torch.randn(tokens, embedding_dim, generator=generator, dtype=torch.float64)
    values = layer.values.detach()
    expected = F.embedding(ids, table)
    (table_grad,) = torch.autograd.grad(F.embedding(ids, table.requires_grad_()), table, grad)
    expected_grad = table_grad[layer.row.long(), layer.col.long()]
    for backend in ("cpu", "reference"):
        with snack.use_backend(backend):
            assert torch.equal(embedding_lookup(values, *operands, ids, embedding_dim), expected)
            torch.testing.assert_close(embedding_values_grad(grad, *operands, ids), expected_grad)
    assert torch.equal(embedding_lookup_for_transforms(values, *operands, ids, embedding_dim), expected)


def test_native_kernels_refuse_ids_out_of_range():
    layer = _embedding(10, 4)
    topology = layer.topology
    for ids in (torch.tensor([3, 10]), torch.tensor([-1])):
        with pytest.raises(RuntimeError, match="ids must lie in \\[0, 10\\)"):
            torch.ops.snack_cpu.embedding_lookup(layer.values.detach(), topology.rowptr, topology.col, ids, 4)
        with pytest.raises(RuntimeError, match="ids must lie in \\[0, 10\\)"):
            torch.ops.snack_cpu.embedding_values_grad(torch.randn(ids.numel(), 4), topology.rowptr, topology.col, ids)


def test_no_connections_and_no_ids():
    layer = snack.SparseEmbedding.from_dense(torch.zeros(6, 4))
    assert layer.nnz == 0
    y = layer(torch.tensor([1, 5]))
    assert torch.equal(y, torch.zeros(2, 4))
    y.sum().backward()
    assert layer.values.grad.shape == (0,)
    nothing = _embedding(6, 4, 0.5)(torch.empty(0, 3, dtype=torch.int64))
    assert nothing.shape == (0, 3, 4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_16_bit_values_and_int32_ids(dtype):
    layer = _embedding(dtype=torch.float32).to(dtype)
    ids = torch.randint(0, layer.num_embeddings, (4, 6), dtype=torch.int32)
    y = layer(ids)
    assert y.dtype == dtype
    assert torch.equal(y, F.embedding(ids.long(), layer.to_dense().detach()))


def test_output_under_autocast_keeps_the_tables_dtype_as_nn_embedding_does():
    layer = _embedding(dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(torch.tensor([1, 2]))
        dense = nn.Embedding(3, 4)(torch.tensor([1, 2]))
    assert y.dtype == dense.dtype == torch.float32


def test_construction_size_sparsity_and_initial_variance():
    layer = snack.SparseEmbedding(2000, 64, sparsity=0.9)
    check_topology_invariants(layer, round(0.1 * 2000 * 64))
    assert (layer.num_embeddings, layer.embedding_dim, layer.bias) == (2000, 64, None)
    assert layer.values.requires_grad and layer.row.dtype == torch.int32
    # nn.Embedding's output entries have variance 1; so have these, on average over the table
    output = layer(torch.arange(2000))
    assert 0.9 < output.var().item() < 1.1
    assert "num_embeddings=2000, embedding_dim=64" in repr(layer)


def test_built_on_meta_it_draws_its_topology_once_materialised():
    layer = snack.SparseEmbedding(300, 16, sparsity=0.75, device="meta")
    with pytest.raises(RuntimeError, match="SparseEmbedding\\(300, 16\\) was built on the meta device"):
        layer(torch.tensor([1], device="meta"))
    layer.to_empty(device="cpu")
    layer.reset_parameters()
    check_topology_invariants(layer, 1200)
    assert layer(torch.tensor([[3, 299]])).shape == (1, 2, 16)


def test_from_dense_keeps_the_largest_entries_and_to_dense_is_the_table():
    dense = nn.Embedding(30, 8)
    layer = snack.SparseEmbedding.from_dense(dense, sparsity=0.75)
    table = layer.to_dense()
    assert table.shape == (30, 8) and layer.nnz == 60
    kept = table != 0
    assert torch.equal(table[kept], dense.weight.detach()[kept])
    assert dense.weight.detach().abs()[kept].min() >= dense.weight.detach().abs()[~kept].max()


def test_state_dict_round_trip_across_nnz():
    source, target = _embedding(sparsity=0.5), _embedding(sparsity=0.9)
    target.load_state_dict(source.state_dict())
    ids = torch.randint(0, 40, (9,))
    assert torch.equal(target(ids), source(ids)) and target.nnz == source.nnz


@pytest.mark.parametrize(
    "ids, error, match",
    [
        (torch.tensor([0.0, 1.0]), TypeError, "integer ids"),
        (torch.tensor([True]), TypeError, "integer ids"),
        (torch.tensor([0, 40]), IndexError, "id 40, outside \\[0, 39\\]"),
        (torch.tensor([-1, 3]), IndexError, "id -1"),
        ([1, 2], TypeError, "Tensor of token ids"),
    ],
)
def test_bad_ids_raise_and_change_nothing(ids, error, match):
    layer = _embedding()
    before = copy.deepcopy(layer.state_dict())
    with pytest.raises(error, match=match):
        layer(ids)
    assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())


@pytest.mark.parametrize(
    "arguments, error, match",
    [
        ((0, 4), ValueError, "num_embeddings must be in"),
        ((4, 2.5), TypeError, "embedding_dim must be an int"),
        ((4, True), TypeError, "embedding_dim must be an int"),
    ],
)
def test_bad_sizes_raise(arguments, error, match):
    with pytest.raises(error, match=match):
        snack.SparseEmbedding(*arguments)


def test_values_of_another_length_are_refused():
    layer = _embedding()
    with pytest.raises(ValueError, match=f"values must have shape \\({layer.nnz},\\), got \\(3,\\)"):
        torch.func.functional_call(layer, {"values": torch.zeros(3, dtype=torch.float64)}, (torch.tensor([1]),))


def test_reading_weight_says_what_to_use():
    with pytest.raises(AttributeError, match="SparseEmbedding has no dense weight.*back into nn.Embedding"):
        _embedding().weight


def test_from_dense_refuses_what_a_sparse_table_lacks():
    for options in (dict(max_norm=1.0), dict(scale_grad_by_freq=True)):
        with pytest.raises(ValueError, match=f"no counterpart of nn.Embedding's {next(iter(options))}"):
            snack.SparseEmbedding.from_dense(nn.Embedding(5, 3, **options))
    with pytest.raises(ValueError, match="must be \\(num_embeddings, embedding_dim\\)"):
        snack.SparseEmbedding.from_dense(torch.randn(5, 3, 2))
    with pytest.raises(TypeError, match="nn.Embedding or a Tensor"):
        snack.SparseEmbedding.from_dense(nn.Linear(3, 5))


def test_no_table_sized_tensor_in_a_training_step_and_a_rigl_update():
    layer = snack.SparseEmbedding(20_000, 256, sparsity=0.99)
    optimizer = torch.optim.Adam(layer.parameters())
    dst = snack.dst.RigL(layer, optimizer, update_every=1, total_steps=10)
    with LargestTensorMode() as mode:
        layer(torch.randint(0, 20_000, (4, 64))).square().sum().backward()
        optimizer.step()
        assert dst.step()
    # the table has 5.1e6 entries; RigL scores blocks of at most 2**20 (4,096 rows), and the
    # largest other tensor is the (256 ids, 256) output
    assert 256 * 256 <= mode.largest <= 2**20, f"{mode.largest_op} produced {mode.largest} elements"


def test_compiled_model_matches_eager():
    torch._dynamo.reset()
    model = nn.Sequential(snack.SparseEmbedding(30, 8, sparsity=0.6), nn.Linear(8, 30))
    twin = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True)
    ids = torch.randint(0, 30, (3, 5))
    y, expected = compiled(ids), twin(ids)
    torch.testing.assert_close(y, expected)
    y.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(model[0].values.grad, twin[0].values.grad)


# --------------------------------------------------------------------- sparsify, densify


def _language_model():
    return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 50))


def test_sparsify_converts_embeddings_only_when_asked():
    model = snack.sparsify(_language_model(), 0.9)
    assert type(model[0]) is nn.Embedding and isinstance(model[1], snack.SparseLinear)
    dense = _language_model()
    table = dense[0].weight.detach().clone()
    model = snack.sparsify(dense, 0.9, embeddings=True)
    assert isinstance(model[0], snack.SparseEmbedding) and model[0].nnz == 80
    kept = model[0].to_dense() != 0
    assert torch.equal(model[0].to_dense()[kept], table[kept])
    with pytest.raises(TypeError, match="embeddings must be a bool"):
        snack.sparsify(_language_model(), embeddings="yes")


def test_sparsify_random_init_and_erk_weigh_the_table_by_its_shape():
    """ERK's density of a (200, 16) table, (200 + 16) / (200 · 16), is under half a (10, 16)
    head's, (10 + 16) / (10 · 16)."""
    model = nn.Sequential(nn.Embedding(200, 16), nn.Linear(16, 10))
    snack.sparsify(model, 0.8, embeddings=True, init="random", distribution="erk")
    embedding, head = model
    assert isinstance(embedding, snack.SparseEmbedding)
    assert embedding.nnz + head.nnz == round(0.2 * (200 * 16 + 16 * 10))
    assert 1 - embedding.sparsity < 0.5 * (1 - head.sparsity)


def test_sparsify_leaves_max_norm_embeddings_and_ties_it_cannot_keep_dense_with_a_warning():
    renormed = nn.Sequential(nn.Embedding(50, 16, max_norm=1.0), nn.Linear(16, 50))
    with pytest.warns(UserWarning, match="nn.EmbeddingBag layer\\(s\\) dense: 0 \\(max_norm=1.0\\)"):
        snack.sparsify(renormed, embeddings=True)
    assert type(renormed[0]) is nn.Embedding
    tied = _language_model()
    tied[1].weight = tied[0].weight
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        snack.sparsify(tied, embeddings=True, exclude="1")  # (and: converted no layer)
    assert any("tied to another module's: 0 (with 1)" in str(w.message) for w in caught)
    assert type(tied[0]) is nn.Embedding and type(tied[1]) is nn.Linear


def test_sparsify_converts_gpt2s_position_embedding_and_leaves_the_token_embedding_of_an_excluded_head_dense():
    model = tiny_gpt2().eval()
    tokens = torch.randint(0, 50, (2, 8))
    with torch.no_grad():
        expected = model(tokens).logits
    with pytest.warns(UserWarning, match=r"transformer.wte \(with lm_head\)"):  # (test_tied_head converts both)
        snack.sparsify(model, sparsity=0.0, embeddings=True, exclude="lm_head")  # every non-zero kept
    assert isinstance(model.transformer.wpe, snack.SparseEmbedding) and type(model.transformer.wte) is nn.Embedding
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, expected, rtol=1e-5, atol=1e-5)
    model.train()
    model(tokens, labels=tokens).loss.backward()
    assert model.transformer.wpe.values.grad.shape == (16 * 32,)


def test_densify_gives_back_an_equal_nn_embedding():
    model = snack.sparsify(_language_model(), 0.8, embeddings=True)
    model[0].values.requires_grad_(False)
    ids = torch.randint(0, 50, (4, 7))
    expected = model[0](ids)
    snack.densify(model)
    assert type(model[0]) is nn.Embedding and not model[0].weight.requires_grad
    assert torch.equal(model[0](ids), expected)


# --------------------------------------------------------------------- dynamic sparse training


def test_gradient_grow_from_ids_equals_the_one_hot_product():
    """The table's gradient from ids equals ``one_hot(ids)ᵀ · dY``, which gradient_grow scores as a
    linear layer's ``dYᵀ·X`` with X = dY and the one-hot rows as the output gradient; small blocks
    make it sample a bar from strided rows."""
    layer = _embedding(300, 7, 0.8)
    ids = torch.randint(0, 120, (64,))  # rows 120.. never looked up: zero gradient
    dy = torch.randn(64, 7, dtype=torch.float64)
    one_hot = F.one_hot(ids, 300).to(torch.float64)
    for block_elements in (7, 70, 2**20):
        grown = gradient_grow(ids, dy, layer.topology, 50, block_elements=block_elements)
        expected = gradient_grow(dy, one_hot, layer.topology, 50, block_elements=block_elements)
        assert torch.equal(grown, expected)
    gradient = (one_hot.t() @ dy).view(-1)
    gradient[(layer.row.long() * 7 + layer.col.long())] = -1
    assert set(grown.tolist()) == set(gradient.abs().topk(50).indices.tolist())


def test_gradient_grow_from_ids_refuses_mismatched_records():
    layer = _embedding(30, 7)
    with pytest.raises(ValueError, match="ids must be \\(N,\\) and dy \\(N, 7\\)"):
        gradient_grow(torch.tensor([1, 2]), torch.randn(3, 7), layer.topology, 2)
    with pytest.raises(ValueError, match="ids must be in \\[0, 29\\]"):
        gradient_grow(torch.tensor([30]), torch.randn(1, 7), layer.topology, 2)


@pytest.mark.parametrize("algorithm", ["RigL", "SET", "MEST"])
def test_dst_rewires_the_embedding(algorithm):
    model = snack.sparsify(_language_model(), 0.9, embeddings=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    dst = getattr(snack.dst, algorithm)(model, optimizer, update_every=1, total_steps=10, drop_fraction=0.3)
    ids = torch.randint(0, 50, (4, 9))
    before = model[0].indices().clone()
    loss = F.cross_entropy(model(ids).view(-1, 50), ids.view(-1))
    loss.backward()
    optimizer.step()
    assert dst.step()
    embedding = model[0]
    check_topology_invariants(embedding, embedding.nnz)
    assert not torch.equal(embedding.indices(), before)
    y = model(ids)  # and it trains on
    y.sum().backward()
    assert embedding.values.grad.shape == (embedding.nnz,)


def test_rigl_grows_where_the_embeddings_gradient_is_largest():
    model = snack.sparsify(_language_model(), 0.9, embeddings=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the step changes no value
    dst = snack.dst.RigL(model, optimizer, update_every=1, total_steps=10, drop_fraction=0.25, layers=["0"])
    embedding = model[0]
    ids = torch.randint(0, 50, (4, 9))
    table = embedding.to_dense().detach().requires_grad_()
    loss = F.cross_entropy(model[1](F.embedding(ids, table)).view(-1, 50), ids.view(-1))
    (gradient,) = torch.autograd.grad(loss, table)
    before = set((embedding.row.long() * 16 + embedding.col.long()).tolist())
    F.cross_entropy(model(ids).view(-1, 50), ids.view(-1)).backward()
    optimizer.step()
    dst.step()
    after = set((embedding.row.long() * 16 + embedding.col.long()).tolist())
    grown = after - before
    assert len(grown) == len(before - after) > 0
    scores = gradient.abs().view(-1)
    free_not_grown = [p for p in range(50 * 16) if p not in before and p not in grown]
    assert scores[list(grown)].min() >= scores[free_not_grown].max()


def test_recorded_batch_of_an_embedding_is_its_ids_and_output_gradient():
    seen = {}

    class Recording(snack.dst.DropGrow):
        needs_gradient = True

        def grow(self, layer, k):
            seen[type(layer).__name__] = self.recorded_batch(layer)
            return random_grow(layer.topology, k, self.generator)

    model = snack.sparsify(_language_model(), 0.9, embeddings=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dst = Recording(model, optimizer, update_every=1, total_steps=10)
    ids = torch.randint(0, 50, (3, 4))
    output = model[0](ids)
    model[1](output).sum().backward()
    dst.step()
    recorded_ids, dy = seen["SparseEmbedding"]
    assert torch.equal(recorded_ids, ids.view(-1)) and dy.shape == (12, 16)


def test_random_grow_init_draws_the_embeddings_own_distribution():
    layer = snack.SparseEmbedding(100, 20, sparsity=0.9)
    draws = layer._random_initial_values(200_000, torch.Generator().manual_seed(0))
    assert abs(draws.std().item() - layer._init_std) < 0.02 * layer._init_std
    assert layer._init_std == pytest.approx((20 / 2.0) ** 0.5)


def test_no_warnings_in_a_plain_training_step():
    layer = _embedding(dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer(torch.tensor([[1, 2], [3, 4]])).sum().backward()


# --------------------------------------------------------------------- sparse gradients


def test_sparse_gradient_holds_the_connections_of_the_rows_looked_up():
    layer = _embedding(40, 12, 0.7, empty_rows=(5,))
    dense_gradient = copy.deepcopy(layer)
    layer.sparse = True
    ids = torch.tensor([[3, 5, 3], [39, 0, 3]])
    grad_out = torch.randn(2, 3, 12, dtype=torch.float64)
    layer(ids).backward(grad_out)
    dense_gradient(ids).backward(grad_out)
    grad = layer.values.grad
    assert grad.layout == torch.sparse_coo
    touched = torch.isin(layer.row, torch.tensor([0, 3, 5, 39])).nonzero().view(-1)
    assert torch.equal(grad.coalesce().indices()[0], touched)
    torch.testing.assert_close(grad.to_dense(), dense_gradient.values.grad)


def test_sparse_gradients_are_eager_autograds_torch_func_and_no_grad_look_up_the_whole_table():
    layer = _embedding(20, 6, 0.5)
    layer.sparse = True
    ids = torch.tensor([2, 9, 9])
    grad = torch.func.grad(lambda v: torch.func.functional_call(layer, {"values": v}, (ids,)).sum())(
        layer.values.detach()
    )
    assert grad.layout == torch.strided and grad.shape == (layer.nnz,)
    with torch.no_grad():
        assert torch.equal(layer(ids), F.embedding(ids, layer.to_dense()))


def test_sparse_adam_steps_the_rows_looked_up_as_for_nn_embeddings_sparse_gradient():
    """SparseAdam on a ``sparse=True`` table equals SparseAdam on ``nn.Embedding(sparse=True)``
    holding the same table, at the connections; rows never looked up stay as they were."""
    torch.manual_seed(0)
    layer = snack.SparseEmbedding(30, 8, sparsity=0.6, sparse=True, dtype=torch.float64)
    dense = nn.Embedding(30, 8, sparse=True, dtype=torch.float64)
    with torch.no_grad():
        dense.weight.copy_(layer.to_dense())
    optimizers = {module: torch.optim.SparseAdam(module.parameters(), lr=0.1) for module in (layer, dense)}
    before = layer.values.detach().clone()
    for ids in (torch.tensor([1, 2, 2]), torch.tensor([2, 7]), torch.tensor([7, 1])):
        target = torch.randn(len(ids), 8, dtype=torch.float64)
        for module, optimizer in optimizers.items():
            optimizer.zero_grad()
            (module(ids) - target).square().sum().backward()
            optimizer.step()
    torch.testing.assert_close(layer.values.detach(), dense.weight.detach()[layer.row.long(), layer.col.long()])
    untouched = ~torch.isin(layer.row, torch.tensor([1, 2, 7]))
    assert untouched.any() and torch.equal(layer.values.detach()[untouched], before[untouched])


def test_sparse_is_carried_by_from_dense_sparsify_and_densify_and_checked():
    layer = snack.SparseEmbedding.from_dense(nn.Embedding(10, 4, sparse=True))
    assert layer.sparse and "sparse=True" in repr(layer)
    for init in ("magnitude", "random"):
        model = snack.sparsify(nn.Sequential(nn.Embedding(10, 4, sparse=True)), 0.5, embeddings=True, init=init)
        assert model[0].sparse
    assert snack.densify(model)[0].sparse
    with pytest.raises(TypeError, match="sparse must be a bool, got int 1"):
        snack.SparseEmbedding(10, 4, sparse=1)


def test_rigl_rewires_a_table_with_sparse_gradients_and_sparse_adams_state():
    torch.manual_seed(0)
    layer = snack.SparseEmbedding(50, 16, sparsity=0.9, sparse=True)
    optimizer = torch.optim.SparseAdam([layer.values], lr=0.01)
    dst = snack.dst.RigL(layer, optimizer, update_every=1, total_steps=10, drop_fraction=0.3)
    before = layer.indices().clone()
    for _ in range(2):  # the update step, then one more with the new connections
        optimizer.zero_grad()
        layer(torch.randint(0, 50, (4, 9))).square().sum().backward()
        assert layer.values.grad.layout == torch.sparse_coo
        optimizer.step()
        dst.step()
    assert not torch.equal(layer.indices(), before)
    state = optimizer.state[layer.values]
    assert state["exp_avg"].shape == state["exp_avg_sq"].shape == (layer.nnz,)


# --------------------------------------------------------------------- programs and transforms


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
def test_traced_exported_and_fx_programs_match_eager():
    model = nn.Sequential(snack.SparseEmbedding(30, 8, sparsity=0.5), nn.Linear(8, 3))
    ids = torch.randint(0, 30, (2, 5))
    expected = model(ids)
    assert torch.equal(torch.fx.symbolic_trace(model)(ids), expected)
    assert torch.equal(torch.fx.symbolic_trace(model[0])(ids), model[0](ids))  # the layer as the root
    assert torch.equal(torch.export.export(model, (ids,)).module()(ids), expected)
    assert torch.equal(torch.jit.trace(model, (ids,))(ids), expected)


def test_torch_func_grad_per_sample_vmap_and_jvp():
    layer = _embedding(30, 8, 0.5)
    ids = torch.randint(0, 30, (4, 5))
    params = {"values": layer.values.detach()}

    def loss(parameters, batch):
        return torch.func.functional_call(layer, parameters, (batch,)).square().sum()

    whole = torch.func.grad(loss)(params, ids)["values"]
    torch.testing.assert_close(whole, torch.autograd.grad(loss({"values": layer.values}, ids), layer.values)[0])
    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, ids)["values"]
    for k in range(4):
        torch.testing.assert_close(per_sample[k], torch.func.grad(loss)(params, ids[k : k + 1])["values"])
    assert torch.equal(torch.func.vmap(layer)(ids), layer(ids))
    tangent = torch.randn_like(layer.values)
    _, derivative = torch.func.jvp(
        lambda v: torch.func.functional_call(layer, {"values": v}, (ids,)), (params["values"],), (tangent,)
    )
    torch.testing.assert_close(derivative, torch.func.functional_call(layer, {"values": tangent}, (ids,)))


def test_averaged_model_follows_a_rewired_embedding():
    model = snack.sparsify(_language_model(), 0.9, embeddings=True)
    averaged = snack.AveragedModel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dst = snack.dst.SET(model, optimizer, update_every=1, total_steps=10)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    optimizer.step()
    dst.step()
    averaged.update_parameters(model)
    assert torch.equal(averaged.module[0].indices(), model[0].indices())


# --------------------------------------------------------------------- padding_idx


def test_padding_idx_behaves_as_nn_embeddings():
    """Built: no connection in the padding row (zeros). From a dense table whose padding row holds
    values (a loaded one): they are looked up, and get no gradient, as in nn.Embedding."""
    built = snack.SparseEmbedding(12, 5, padding_idx=-3, sparsity=0.5)
    assert built.padding_idx == 9 and not bool((built.row == 9).any()) and "padding_idx=9" in repr(built)
    assert built.nnz == round(0.5 * 11 * 5)  # the sparsity of the other rows
    dense = nn.Embedding(12, 5, padding_idx=9).double()
    with torch.no_grad():
        dense.weight[9] = torch.arange(5.0)
        dense.weight.mul_(torch.rand(12, 5) < 0.6)
    layer = snack.SparseEmbedding.from_dense(dense)
    assert layer.padding_idx == 9 and bool((layer.row == 9).any())
    ids = torch.tensor([[9, 1, 9], [4, 9, 11]])
    grad = torch.randn(2, 3, 5, dtype=torch.float64)
    output = layer(ids)
    output.backward(grad)
    expected = dense(ids)
    expected.backward(grad)
    assert torch.equal(output, expected.detach())
    torch.testing.assert_close(layer.values.grad, dense.weight.grad[layer.row.long(), layer.col.long()])
    assert layer.values.grad[layer.row == 9].abs().sum() == 0
    layer.reset_parameters()  # as nn.Embedding's: the padding row's entries become zeros
    assert layer.values[layer.row == 9].abs().sum() == 0


def _padded_with_values_in_its_padding_row() -> snack.SparseEmbedding:
    """A SparseEmbedding with padding_idx 2 whose padding row holds connections (a loaded table)."""
    dense = nn.Embedding(12, 5, padding_idx=2).double().requires_grad_(False)
    dense.weight[2] = torch.arange(1.0, 6.0)
    layer = snack.SparseEmbedding.from_dense(dense)
    assert int((layer.row == 2).sum()) == 5
    return layer


def test_padding_idx_holds_in_an_fx_trace_of_the_layer():
    layer = _padded_with_values_in_its_padding_row()
    traced = torch.fx.symbolic_trace(layer)
    ids = torch.tensor([[2, 3], [2, 7]])
    traced(ids).sum().backward()
    assert layer.values.grad[layer.row == 2].abs().sum() == 0
    assert torch.equal(layer.values.grad, torch.autograd.grad(layer(ids).sum(), layer.values)[0])


def test_padding_idx_holds_under_torch_func_and_compile():
    layer = _padded_with_values_in_its_padding_row()
    ids = torch.tensor([2, 3, 2, 7])
    (gradient,) = torch.func.grad(
        lambda v: torch.func.functional_call(layer, {"values": v}, (ids,)).sum(), argnums=(0,)
    )(layer.values.detach())
    expected = torch.autograd.grad(layer(ids).sum(), layer.values)[0]
    torch.testing.assert_close(gradient, expected)
    assert gradient[layer.row == 2].abs().sum() == 0 and gradient[layer.row == 3].abs().sum() > 0
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    output = compiled(ids)
    assert torch.equal(output, layer(ids))
    output.sum().backward()
    torch.testing.assert_close(layer.values.grad, expected)


@pytest.mark.parametrize("padding_idx, error, match", [
    (12, ValueError, "padding_idx must be in \\[-12, 11\\]"), (-13, ValueError, "got -13"),
    (1.0, TypeError, "padding_idx must be an int or None"),
])  # fmt: skip
def test_bad_padding_idx_raises(padding_idx, error, match):
    with pytest.raises(error, match=match):
        snack.SparseEmbedding(12, 5, padding_idx)


def test_growth_topology_holds_the_padding_row_as_full():
    layer = snack.SparseEmbedding.from_dense(torch.randn(7, 4) * (torch.rand(7, 4) < 0.5))
    assert layer.growth_topology is layer.topology  # no padding row: the topology itself
    layer.padding_idx = 3
    growth = layer.growth_topology
    check = snack.SparseEmbedding.from_coo(growth.row, growth.col, torch.ones(growth.nnz), (7, 4))
    positions = set((check.row.long() * 4 + check.col.long()).tolist())
    own = set((layer.row.long() * 4 + layer.col.long()).tolist())
    assert positions == own | {12, 13, 14, 15}
    assert layer._growable_count() == 7 * 4 - growth.nnz  # counted without building it


@pytest.mark.parametrize("algorithm", ["SET", "RigL", "MEST", "GraNet"])
def test_dst_never_grows_into_the_padding_row(algorithm):
    """A 6-row table whose padding row (2) is the id looked up most: RigL's scores are largest
    there, and random growth would soon reach it."""
    model = nn.Sequential(snack.SparseEmbedding(6, 4, padding_idx=2, sparsity=0.5), nn.Linear(4, 6))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    arguments = dict(update_every=1, total_steps=40)
    if algorithm == "GraNet":
        arguments.update(final_sparsity=0.6, start_step=0, end_step=20)
    else:
        arguments.update(drop_fraction=0.5)
    dst = getattr(snack.dst, algorithm)(model, optimizer, **arguments)
    ids = torch.tensor([[2, 2, 2, 0, 1, 5], [2, 3, 2, 4, 2, 2]])
    rewired = 0
    for _ in range(20):
        optimizer.zero_grad()
        F.cross_entropy(model(ids).view(-1, 6), ids.view(-1)).backward()
        optimizer.step()
        rewired += dst.step()
        assert not bool((model[0].row == 2).any())
        check_topology_invariants(model[0], model[0].nnz)
    assert rewired >= 10


def test_a_custom_algorithm_growing_into_the_padding_row_is_refused_and_changes_nothing():
    class IntoThePadding(snack.dst.DropGrow):
        def grow(self, layer, k):
            return torch.arange(2 * 4, 2 * 4 + k)  # row 2, the padding row

    layer = snack.SparseEmbedding(6, 4, padding_idx=2, sparsity=0.75)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    dst = IntoThePadding(layer, optimizer, update_every=1, total_steps=10, drop_fraction=0.5)
    before = layer.indices().clone()
    with pytest.raises(ValueError, match="returned position 8 of layer '', in row 2, where no connection may grow"):
        dst.step()
    assert torch.equal(layer.indices(), before)


def test_sparsify_and_densify_carry_padding_idx():
    model = nn.Sequential(nn.Embedding(50, 16, padding_idx=0), nn.Linear(16, 50))
    snack.sparsify(model, 0.8, embeddings=True)
    assert isinstance(model[0], snack.SparseEmbedding) and model[0].padding_idx == 0
    random = snack.sparsify(nn.Sequential(nn.Embedding(50, 16, padding_idx=7)), 0.8, embeddings=True, init="random")
    assert random[0].padding_idx == 7 and not bool((random[0].row == 7).any())
    snack.densify(model)
    assert type(model[0]) is nn.Embedding and model[0].padding_idx == 0


def test_padding_idx_on_the_meta_device():
    layer = snack.SparseEmbedding(30, 8, padding_idx=4, sparsity=0.75, device="meta")
    layer.to_empty(device="cpu")
    layer.reset_parameters()
    check_topology_invariants(layer, round(0.25 * 29 * 8))
    assert not bool((layer.row == 4).any())
