"""SparseEmbedding.attend and SparseTiedHead: a sparse table that is both a model's token embedding
and its output layer, against dense math on the tied table; RigL scoring it from both uses;
sparsify/densify of tied pairs."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_gpt2
from test_truly_sparse import LargestTensorMode
from torch import nn

import snack
from snack.dst.prune_grow import gradient_grow, random_grow


def _embedding(num_embeddings=40, embedding_dim=12, sparsity=0.7, *, empty_rows=(), dtype=torch.float64):
    table = torch.randn(num_embeddings, embedding_dim, dtype=dtype)
    table[list(empty_rows)] = 0
    return snack.SparseEmbedding.from_dense(table * (torch.rand(table.shape) >= sparsity))


class _TiedLM(nn.Module):
    """Token embedding, one linear layer, and a head tied to the embedding (GPT-2's layout): ``ids
    (*)`` → logits ``(*, num_embeddings)``."""

    def __init__(self, num_embeddings=40, embedding_dim=12, bias=False, dtype=torch.float64):
        super().__init__()
        self.embedding = nn.Embedding(num_embeddings, embedding_dim, dtype=dtype)
        self.mid = nn.Linear(embedding_dim, embedding_dim, dtype=dtype)
        self.head = nn.Linear(embedding_dim, num_embeddings, bias=bias, dtype=dtype)
        self.head.weight = self.embedding.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.embedding(ids))))


# --------------------------------------------------------------------- attend


@pytest.mark.parametrize("shape", [(12,), (1, 12), (3, 5, 12), (0, 12)])
def test_attend_and_its_gradient_match_dense_math(shape):
    layer = _embedding(empty_rows=(0, 7))
    hidden = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    logits = layer.attend(hidden)
    grad_out = torch.randn_like(logits)
    logits.backward(grad_out)
    table = layer.to_dense().detach().requires_grad_()
    expected = F.linear(hidden.detach(), table)
    (table_grad,) = torch.autograd.grad(expected, table, grad_out)
    assert logits.shape == (*shape[:-1], 40)
    torch.testing.assert_close(logits, expected)
    torch.testing.assert_close(layer.values.grad, table_grad[layer.row.long(), layer.col.long()])
    torch.testing.assert_close(hidden.grad, grad_out @ layer.to_dense())


def test_attend_gradcheck_float64_and_no_connections():
    head = snack.SparseTiedHead(_embedding(9, 5, 0.5), bias=True)
    hidden = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    values = head.embedding.values.detach().clone().requires_grad_()
    bias = torch.randn(9, dtype=torch.float64, requires_grad=True)

    def logits(hidden, values, bias):
        return torch.func.functional_call(head, {"embedding.values": values, "bias": bias}, (hidden,))

    assert torch.autograd.gradcheck(logits, (hidden, values, bias))
    empty = torch.zeros(0, dtype=torch.int64)
    head.embedding.set_topology(empty, empty)
    output = head.embedding.attend(hidden)
    assert torch.equal(output, torch.zeros(3, 9, dtype=torch.float64))
    output.sum().backward()
    assert head.embedding.values.grad.shape == (0,) and torch.equal(hidden.grad, torch.zeros_like(hidden))


def test_lookup_and_attend_gradients_add_up_as_for_a_dense_tied_table():
    dense = _TiedLM(bias=True)
    sparse = snack.sparsify(copy.deepcopy(dense), 0.0, embeddings=True)
    assert isinstance(sparse.head, snack.SparseTiedHead) and sparse.head.embedding is sparse.embedding
    ids = torch.randint(0, 40, (3, 6))
    target = torch.randint(0, 40, (18,))
    for model in (dense, sparse):
        F.cross_entropy(model(ids).view(-1, 40), target).backward()
    torch.testing.assert_close(sparse(ids), dense(ids))
    # sparsity 0 keeps every entry: values are the table, row-major
    torch.testing.assert_close(sparse.embedding.values.grad, dense.embedding.weight.grad.view(-1))
    torch.testing.assert_close(sparse.head.bias.grad, dense.head.bias.grad)
    torch.testing.assert_close(sparse.mid.values.grad, dense.mid.weight.grad.view(-1))


def test_attend_errors_name_what_was_expected():
    layer = _embedding(dtype=torch.float32)
    with pytest.raises(ValueError, match=r"attend: hidden must have shape \(\*, embedding_dim=12\), got \(3, 5\)"):
        layer.attend(torch.randn(3, 5))
    with pytest.raises(ValueError, match="must have shape"):
        layer.attend(torch.tensor(1.0))
    with pytest.raises(TypeError, match="input dtype torch.float64 does not match the layer's torch.float32"):
        layer.attend(torch.randn(3, 12, dtype=torch.float64))
    with pytest.raises(TypeError, match="attend expects a Tensor, got list"):
        layer.attend([1.0] * 12)
    with pytest.raises(TypeError, match="embedding must be a snack.SparseEmbedding, got Linear"):
        snack.SparseTiedHead(nn.Linear(3, 4))
    with pytest.raises(TypeError, match="bias must be a bool"):
        snack.SparseTiedHead(layer, bias=1.0)
    with pytest.raises(AttributeError, match="weight is the table of its `embedding`"):
        snack.SparseTiedHead(layer).weight


def test_head_module_sizes_bias_and_autocast():
    layer = _embedding(dtype=torch.float32)
    head = snack.SparseTiedHead(layer, bias=True)
    assert (head.in_features, head.out_features) == (12, 40)
    assert torch.equal(head.bias, torch.zeros(40)) and "bias=True" in repr(head)
    assert sorted(name for name, _ in head.named_parameters()) == ["bias", "embedding.values"]
    hidden = torch.randn(4, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = head(hidden)
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), F.linear(hidden, layer.to_dense()), rtol=2e-2, atol=2e-2)


# --------------------------------------------------------------------- state, copies, programs


def test_state_dict_copies_and_pickles_keep_the_tie():
    model = snack.sparsify(_TiedLM(dtype=torch.float32), 0.8, embeddings=True)
    ids = torch.randint(0, 40, (2, 5))
    expected = model(ids)
    for twin in (copy.deepcopy(model), _pickled(model)):
        assert twin.head.embedding is twin.embedding
        torch.testing.assert_close(twin(ids), expected)
    state = model.state_dict()
    assert {"embedding.values", "head.embedding.values"} <= set(state)
    fresh = snack.sparsify(_TiedLM(dtype=torch.float32), 0.5, embeddings=True)  # another nnz
    fresh.load_state_dict(state)
    assert fresh.head.embedding is fresh.embedding and fresh.embedding.nnz == model.embedding.nnz
    torch.testing.assert_close(fresh(ids), expected)


def _pickled(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_built_on_the_meta_device_and_materialised():
    with torch.device("meta"):
        model = snack.sparsify(_TiedLM(bias=True, dtype=torch.float32), 0.8, embeddings=True, init="random")
    assert model.head.bias.is_meta and model.head.embedding is model.embedding
    model.to_empty(device="cpu")
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    assert torch.equal(model.head.bias, torch.zeros(40)) and model.embedding.nnz == round(0.2 * 40 * 12)
    hidden = torch.randn(2, 12)
    torch.testing.assert_close(model.head(hidden), F.linear(hidden, model.embedding.to_dense()))


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
def test_compiled_fx_and_exported_programs_match_eager():
    torch._dynamo.reset()
    model = snack.sparsify(_TiedLM(dtype=torch.float32), 0.7, embeddings=True)
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 40, (3, 5))
    compiled = torch.compile(model, fullgraph=True)
    y, expected = compiled(ids), twin(ids)
    torch.testing.assert_close(y, expected)
    y.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(model.embedding.values.grad, twin.embedding.values.grad)
    traced = torch.fx.symbolic_trace(twin)
    assert "fx_embedding_attend" in traced.code
    torch.testing.assert_close(traced(ids), twin(ids))
    twin.embedding.set_topology(twin.embedding.row[::2].clone(), twin.embedding.col[::2].clone())
    torch.testing.assert_close(traced(ids), twin(ids))  # the program computes with the connections of the moment
    root = torch.fx.symbolic_trace(snack.SparseTiedHead(twin.embedding))  # the head as the root
    hidden = torch.randn(2, 12)
    torch.testing.assert_close(root(hidden), twin.head(hidden))
    program = torch.export.export(twin, (ids,))
    torch.testing.assert_close(program.module()(ids), twin(ids))
    torch.testing.assert_close(torch.jit.trace(twin, (ids,), check_trace=False)(ids), twin(ids))


def test_rigl_records_the_head_of_a_compiled_model():
    torch._dynamo.reset()
    model = snack.sparsify(_TiedLM(dtype=torch.float32), 0.7, embeddings=True)
    seen = {}

    class Recording(snack.dst.DropGrow):
        needs_gradient = True

        def grow(self, layer, k):
            seen["head"] = self.recorded_head_batch(layer)
            return random_grow(layer.growth_topology, k, self.generator)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dst = Recording(model, optimizer, update_every=1, total_steps=10, layers=[model.embedding])
    ids = torch.randint(0, 40, (3, 5))
    torch.compile(model)(ids).sum().backward()
    optimizer.step()
    assert dst.step()
    hidden, dlogits = seen["head"]
    assert hidden.shape == (15, 12) and torch.equal(dlogits, torch.ones(15, 40))


def test_per_sample_gradients_through_both_uses():
    model = snack.sparsify(_TiedLM(), 0.6, embeddings=True)
    params = dict(model.named_parameters())
    ids = torch.randint(0, 40, (4, 3))

    def loss(p, sample):
        return torch.func.functional_call(model, p, (sample[None],)).square().sum()

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, ids)
    for i in range(4):
        model.zero_grad()
        loss(params, ids[i]).backward()
        torch.testing.assert_close(per_sample["embedding.values"][i], model.embedding.values.grad)


# --------------------------------------------------------------------- dynamic sparse training


def test_gradient_grow_scores_the_sum_of_both_uses():
    """The table's gradient is ``one_hot(ids)ᵀ·dY + dlogitsᵀ·hidden``; small blocks make it sample a
    bar from strided rows; a table used only as the head scores as a linear layer."""
    layer = _embedding(300, 7, 0.8)
    ids = torch.randint(0, 120, (64,))
    dy = torch.randn(64, 7, dtype=torch.float64)
    hidden, dlogits = torch.randn(10, 7, dtype=torch.float64), torch.randn(10, 300, dtype=torch.float64)
    gradient = F.one_hot(ids, 300).to(torch.float64).t() @ dy + dlogits.t() @ hidden
    scores = gradient.abs().view(-1)
    scores[layer.row.long() * 7 + layer.col.long()] = -1
    expected = set(scores.topk(50).indices.tolist())
    for block_elements in (7, 70, 2**20):
        grown = gradient_grow(ids, dy, layer.topology, 50, block_elements=block_elements, head=(hidden, dlogits))
        assert set(grown.tolist()) == expected and torch.equal(grown, grown.sort().values)
    no_ids, no_dy = torch.zeros(0, dtype=torch.int64), torch.zeros(0, 7, dtype=torch.float64)
    assert torch.equal(
        gradient_grow(no_ids, no_dy, layer.topology, 50, head=(hidden, dlogits)),
        gradient_grow(hidden, dlogits, layer.topology, 50),
    )


def test_gradient_grow_head_errors():
    layer = _embedding(30, 7)
    ids, dy = torch.randint(0, 30, (5,)), torch.randn(5, 7, dtype=torch.float64)
    hidden, dlogits = torch.randn(4, 7, dtype=torch.float64), torch.randn(4, 30, dtype=torch.float64)
    with pytest.raises(ValueError, match="head= is for an embedding's table"):
        gradient_grow(dy, torch.randn(5, 30, dtype=torch.float64), layer.topology, 3, head=(hidden, dlogits))
    with pytest.raises(ValueError, match=r"head must be \(hidden \(B, 7\), dlogits \(B, 30\)\); got shapes \(4, 7\)"):
        gradient_grow(ids, dy, layer.topology, 3, head=(hidden, dlogits[:3]))
    with pytest.raises(TypeError, match="head must be a pair of tensors"):
        gradient_grow(ids, dy, layer.topology, 3, head=hidden)
    with pytest.raises(TypeError, match="head must be floating tensors"):
        gradient_grow(ids, dy, layer.topology, 3, head=(hidden.long(), dlogits))


def test_rigl_grows_where_the_tied_tables_gradient_is_largest():
    model = snack.sparsify(_TiedLM(dtype=torch.float32), 0.9, embeddings=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the step changes no value
    embedding = model.embedding
    dst = snack.dst.RigL(model, optimizer, update_every=1, total_steps=10, drop_fraction=0.25, layers=[embedding])
    ids = torch.randint(0, 40, (4, 9))
    # the table's gradient, as the lookups' part plus the head's
    looked_up, as_head = (embedding.to_dense().detach().requires_grad_() for _ in range(2))
    logits = F.linear(torch.tanh(model.mid(F.embedding(ids, looked_up))), as_head)
    parts = torch.autograd.grad(F.cross_entropy(logits.view(-1, 40), ids.view(-1)), (looked_up, as_head))
    before = set((embedding.row.long() * 12 + embedding.col.long()).tolist())
    F.cross_entropy(model(ids).view(-1, 40), ids.view(-1)).backward()
    optimizer.step()
    dst.step()
    after = set((embedding.row.long() * 12 + embedding.col.long()).tolist())
    grown = after - before
    assert len(grown) == len(before - after) > 0
    free = torch.tensor([p for p in range(40 * 12) if p not in before])
    scores = (parts[0] + parts[1]).abs().view(-1)
    free_not_grown = [p for p in free.tolist() if p not in grown]
    assert scores[list(grown)].min() >= scores[free_not_grown].max() * (1 - 1e-5)
    # either part alone would have grown elsewhere
    for part in parts:
        alone = set(free[part.abs().view(-1)[free].topk(len(grown)).indices].tolist())
        assert alone != grown


def test_recorded_head_batch_holds_each_attend_call():
    seen = {}

    class Recording(snack.dst.DropGrow):
        needs_gradient = True

        def grow(self, layer, k):
            seen[type(layer).__name__] = (self.recorded_batch(layer), self.recorded_head_batch(layer))
            return random_grow(layer.growth_topology, k, self.generator)

    model = snack.sparsify(_TiedLM(dtype=torch.float32), 0.9, embeddings=True)
    dst = Recording(model, torch.optim.SGD(model.parameters(), lr=0.1), update_every=1, total_steps=10)
    ids = torch.randint(0, 40, (3, 4))
    hidden = torch.randn(2, 12)
    logits = model(ids)
    (logits.sum() + 2 * model.head(hidden).sum()).backward()  # a second head call, on other rows
    dst.step()
    (recorded_ids, dy), (recorded_hidden, dlogits) = seen["SparseEmbedding"]
    assert torch.equal(recorded_ids, ids.view(-1)) and dy.shape == (12, 12)
    assert recorded_hidden.shape == (14, 12) and torch.equal(recorded_hidden[12:], hidden)
    assert torch.equal(dlogits, torch.cat([torch.ones(12, 40), torch.full((2, 40), 2.0)]))
    assert seen["SparseLinear"][1] is None  # (mid) no head use

    # the table used only as the head: empty lookups
    dst = Recording(model, torch.optim.SGD(model.parameters(), lr=0.1), update_every=1, total_steps=10,
                    layers=[model.embedding])  # fmt: skip
    model.head(hidden).sum().backward()
    dst.step()
    (recorded_ids, dy), (recorded_hidden, _) = seen["SparseEmbedding"]
    assert recorded_ids.shape == (0,) and dy.shape == (0, 12) and torch.equal(recorded_hidden, hidden)


def test_layers_may_name_the_table_through_its_head():
    model = snack.sparsify(_TiedLM(dtype=torch.float32), 0.8, embeddings=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for layers in ("head", "head.embedding", model.head, ["head", "mid"]):
        dst = snack.dst.RigL(model, optimizer, update_every=1, total_steps=10, layers=layers)
        assert [layer for _, layer in dst.layers][0] is model.embedding and dst.layers[0][0] == "embedding"
    with pytest.raises(ValueError, match="a layer is listed twice"):
        snack.dst.RigL(model, optimizer, update_every=1, total_steps=10, layers=["embedding", "head"])


def test_set_and_mest_rewire_a_tied_table_and_training_goes_on():
    for algorithm in (snack.dst.SET, snack.dst.MEST):
        model = snack.sparsify(_TiedLM(dtype=torch.float32), 0.8, embeddings=True)
        optimizer = torch.optim.Adam(model.parameters())
        dst = algorithm(model, optimizer, update_every=1, total_steps=10)
        before = model.embedding.indices().clone()
        for _ in range(2):
            ids = torch.randint(0, 40, (4, 5))
            optimizer.zero_grad()
            F.cross_entropy(model(ids).view(-1, 40), ids.view(-1)).backward()
            optimizer.step()
            dst.step()
        assert model.head.embedding is model.embedding and not torch.equal(model.embedding.indices(), before)
        assert torch.isfinite(model(ids)).all()


def test_no_table_sized_tensor_in_a_tied_training_step_and_a_rigl_update():
    embedding = snack.SparseEmbedding(20_000, 256, sparsity=0.99)
    model = nn.Sequential(embedding, snack.SparseTiedHead(embedding))
    optimizer = torch.optim.Adam(model.parameters())
    dst = snack.dst.RigL(model, optimizer, update_every=1, total_steps=10)
    with LargestTensorMode() as mode:
        F.cross_entropy(model(torch.randint(0, 20_000, (1, 16))).view(-1, 20_000), torch.zeros(16).long()).backward()
        optimizer.step()
        assert dst.step()
    # the table has 5.1e6 entries; the logits and their gradient (16, 20,000), RigL's blocks 2**20
    assert 16 * 20_000 <= mode.largest <= 2**20, f"{mode.largest_op} produced {mode.largest} elements"


# --------------------------------------------------------------------- sparsify, densify


def test_sparsify_converts_a_tied_pair_and_densify_ties_it_again():
    dense = _TiedLM(bias=True, dtype=torch.float32)
    with torch.no_grad():
        dense.head.bias.uniform_()
    dense.head.bias.requires_grad_(False)
    ids = torch.randint(0, 40, (2, 7))
    expected = dense(ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = snack.sparsify(dense, 0.0, embeddings=True)
    assert isinstance(model.embedding, snack.SparseEmbedding) and model.head.embedding is model.embedding
    assert not model.head.bias.requires_grad
    torch.testing.assert_close(model(ids), expected)
    snack.densify(model)
    assert type(model.head) is nn.Linear and model.head.weight is model.embedding.weight
    assert type(model.embedding) is nn.Embedding and not model.head.bias.requires_grad
    torch.testing.assert_close(model(ids), expected)
    # a head alone (the root): an nn.Linear holding its table
    head = snack.SparseTiedHead(_embedding(dtype=torch.float32))
    linear = snack.densify(head)
    assert type(linear) is nn.Linear and torch.equal(linear.weight, head.embedding.to_dense())


def test_sparsify_counts_the_tied_table_once():
    model = snack.sparsify(_TiedLM(200, 16, dtype=torch.float32), 0.8, embeddings=True, init="random",
                           distribution="erk")  # fmt: skip
    assert model.embedding.nnz + model.mid.nnz == round(0.2 * (200 * 16 + 16 * 16))


def test_sparsify_random_init_keeps_the_dense_tables_scale():
    """GPT-2 draws its table with std 0.02: a random sparse table's rows and logits keep that scale
    (SparseEmbedding's own init has nn.Embedding's 1, logits 50 times as large)."""
    dense = _TiedLM(2000, 64, dtype=torch.float32)
    nn.init.normal_(dense.embedding.weight, std=0.02)
    model = snack.sparsify(dense, 0.9, embeddings=True, init="random")
    table = model.embedding.to_dense()
    assert table.square().mean().sqrt().item() == pytest.approx(0.02, rel=0.05)
    hidden = torch.randn(256, 64)
    assert model.head(hidden).std().item() == pytest.approx(0.02 * 64**0.5, rel=0.1)


def test_a_tie_sparsify_cannot_keep_stays_dense_with_a_warning():
    for options in (dict(exclude="head"), dict(include="embedding"), dict()):
        model = _TiedLM()
        embeddings = bool(options)  # (without, the head alone is selected)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            snack.sparsify(model, 0.5, embeddings=embeddings, **options)
        assert any("tied to another module's" in str(w.message) for w in caught)
        assert type(model.embedding) is nn.Embedding and model.head.weight is model.embedding.weight
    model = _TiedLM()
    model.scorer = nn.Module()
    model.scorer.table = model.embedding.weight  # a holder under another name
    with pytest.warns(UserWarning, match="tied to another module's: embedding \\(with head, scorer\\)"):
        snack.sparsify(model, 0.5, embeddings=True)
    assert type(model.embedding) is nn.Embedding and type(model.head) is nn.Linear
    model = _TiedLM()
    other = nn.Linear(12, 40)
    other.weight = model.embedding.weight  # a second holder that is selected out
    model.extra = other
    with pytest.warns(UserWarning, match="tied to another module's"):
        snack.sparsify(model, 0.5, embeddings=True, exclude="extra")
    assert type(model.embedding) is nn.Embedding


class _SharedTable(nn.Module):
    """T5's layout: one table held by three modules, two embeddings and the head."""

    def __init__(self, padding_idx=None):
        super().__init__()
        self.shared = nn.Embedding(40, 12, padding_idx=padding_idx)
        self.encoder_tokens = nn.Embedding(40, 12, padding_idx=padding_idx)
        self.decoder_tokens = nn.Embedding(40, 12, padding_idx=padding_idx)
        self.head = nn.Linear(12, 40, bias=False)
        for module in (self.encoder_tokens, self.decoder_tokens, self.head):
            module.weight = self.shared.weight

    def forward(self, source, target):
        context = self.encoder_tokens(source).mean(1, keepdim=True)
        return self.head(torch.tanh(self.decoder_tokens(target) + context))


def test_embeddings_sharing_a_table_become_one_sparse_embedding():
    model = _SharedTable()
    source, target = torch.randint(0, 40, (2, 5)), torch.randint(0, 40, (2, 4))
    expected = model(source, target)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        snack.sparsify(model, 0.0, embeddings=True)
    assert isinstance(model.shared, snack.SparseEmbedding)
    assert model.encoder_tokens is model.shared and model.decoder_tokens is model.shared
    assert model.head.embedding is model.shared
    torch.testing.assert_close(model(source, target), expected)
    snack.densify(model)
    assert model.encoder_tokens is model.shared and model.head.weight is model.shared.weight
    torch.testing.assert_close(model(source, target), expected)
    # tables of another padding_idx are not one embedding: all stay dense
    model = _SharedTable(padding_idx=0)
    model.decoder_tokens.padding_idx = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        snack.sparsify(model, 0.5, embeddings=True)  # (and: converted no layer)
    assert any("tied to another module's" in str(w.message) for w in caught)
    assert type(model.shared) is nn.Embedding and model.head.weight is model.shared.weight


def test_t5_with_its_shared_table_sparsified_gives_the_same_logits():
    """T5's feed-forward reads wo.weight's dtype, which a sparse layer does not have: wo stays dense."""
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2,
                                   decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config).eval()
    source, target = torch.randint(1, 64, (2, 6)), torch.randint(1, 64, (2, 5))
    with torch.no_grad():
        expected = model(input_ids=source, labels=target).logits
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        snack.sparsify(model, 0.0, embeddings=True, exclude="*.wo")
    assert model.encoder.embed_tokens is model.shared and model.lm_head.embedding is model.shared
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=source, labels=target).logits, expected)


def test_gpt2_with_its_tied_head_sparsified_gives_the_same_logits_and_trains_with_rigl():
    model = tiny_gpt2().eval()
    tokens = torch.randint(0, 50, (2, 8))
    with torch.no_grad():
        expected = model(tokens).logits
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        snack.sparsify(model, sparsity=0.0, embeddings=True)  # every non-zero kept: the same model
    wte = model.transformer.wte
    assert isinstance(wte, snack.SparseEmbedding) and model.lm_head.embedding is wte
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, expected, rtol=1e-5, atol=1e-5)
    model = snack.sparsify(tiny_gpt2(), 0.8, embeddings=True).train()
    optimizer = torch.optim.Adam(model.parameters())
    dst = snack.dst.RigL(model, optimizer, update_every=1, total_steps=10)
    before = model.transformer.wte.indices().clone()
    model(tokens, labels=tokens).loss.backward()
    optimizer.step()
    assert dst.step() and not torch.equal(model.transformer.wte.indices(), before)


def test_gpt2_trained_sparse_goes_back_to_transformers_own_layout(tmp_path):
    """sparsify, a RigL step, densify: GPT-2's Conv1D layers and tied head come back as they were
    built, so save_pretrained writes and from_pretrained reads the same model."""
    transformers = pytest.importorskip("transformers")
    model = snack.sparsify(tiny_gpt2(), 0.8, embeddings=True)
    optimizer = torch.optim.Adam(model.parameters())
    dst = snack.dst.RigL(model, optimizer, update_every=1, total_steps=10)
    tokens = torch.randint(0, 50, (2, 8))
    model(tokens, labels=tokens).loss.backward()
    optimizer.step()
    assert dst.step()
    model.eval()
    with torch.no_grad():
        expected = model(tokens).logits
    snack.densify(model)
    attention = model.transformer.h[0].attn.c_attn
    assert type(attention) is transformers.pytorch_utils.Conv1D and attention.weight.shape == (32, 96)
    assert model.lm_head.weight is model.transformer.wte.weight
    model.save_pretrained(tmp_path)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, expected, rtol=1e-5, atol=1e-5)
