"""Dense+Mask (snack.masked): the twin of a sparse model computes what it does and trains the same
connections."""

import pytest
import torch

import snack
from snack.masked import MaskedConv2d, MaskedLinear, dense_plus_mask
from snack.models import PatchTransformer, sparse_char_lstm, sparse_char_transformer, sparse_cnn, sparse_vit


def _same_outputs_and_input_gradients_then_backward(sparse, masked, in_features: int) -> None:
    """The Dense+Mask twin ``masked`` computes what ``sparse`` does, and the same input gradient;
    then its own backward runs (its weight gradients are the caller's to check)."""
    x = torch.randn(5, in_features, dtype=torch.float64, requires_grad=True)
    y_sparse, y_masked = sparse(x), masked(x)
    torch.testing.assert_close(y_masked, y_sparse)
    g = torch.randn_like(y_sparse)
    (dx_sparse,) = torch.autograd.grad(y_sparse, x, g)
    (dx_masked,) = torch.autograd.grad(y_masked, x, g, retain_graph=True)
    torch.testing.assert_close(dx_masked, dx_sparse)
    y_masked.backward(g)


def _same_logits_then_backward(sparse):
    """The Dense+Mask twin of the character model ``sparse`` (ids of 11 characters), after checking
    that it holds no sparse layer and a copy of the embedding, and gives the same logits and the same
    embedding gradient; both models' backward of one output gradient has run."""
    masked = dense_plus_mask(sparse)
    assert not any(isinstance(m, snack.SparseLinear) for m in masked.modules())
    assert masked.embed.weight.equal(sparse.embed.weight) and masked.embed is not sparse.embed
    ids = torch.randint(0, 11, (3, 8))
    logits_sparse, logits_masked = sparse(ids), masked(ids)
    torch.testing.assert_close(logits_masked, logits_sparse)
    g = torch.randn_like(logits_sparse)
    logits_sparse.backward(g)
    logits_masked.backward(g)
    torch.testing.assert_close(masked.embed.weight.grad, sparse.embed.weight.grad)
    return masked


def test_dense_plus_mask_computes_what_the_sparse_vit_does():
    torch.manual_seed(0)
    sparse = sparse_vit(12, 16, 0.8, "uniform", "cpu").double()
    masked = dense_plus_mask(sparse)
    attention = masked.blocks[1].attention
    assert type(attention).__name__ == "ParametrizedMultiheadAttention"
    assert isinstance(masked.blocks[0].mlp[0], MaskedLinear) and isinstance(masked.head, MaskedLinear)
    assert not any(isinstance(m, snack.SparseLinear) for m in masked.modules())
    _same_outputs_and_input_gradients_then_backward(sparse, masked, 144)
    # the masks keep the attention's weight gradients on the topology
    packed = attention.parametrizations.in_proj_weight
    assert (packed.original.grad[packed[0].mask == 0] == 0).all() and packed.original.grad.abs().sum() > 0
    assert int(packed[0].mask.sum()) == sum(sparse.blocks[1].attention.projections()[n].nnz
                                            for n in ("q_proj", "k_proj", "v_proj"))  # fmt: skip
    with pytest.raises(ValueError, match=r"the image side \(10\) must be a multiple of 4"):
        PatchTransformer(10, 16)


def test_dense_plus_mask_computes_what_the_sparse_cnn_does():
    torch.manual_seed(0)
    sparse = sparse_cnn(12, 16, 0.9, "uniform", "cpu").double()
    masked = dense_plus_mask(sparse)
    assert [type(m) for m in masked if isinstance(m, (MaskedConv2d, torch.nn.Conv2d))] == [MaskedConv2d] * 2
    with pytest.raises(TypeError, match="transposed convolutions have no masked twin"):
        dense_plus_mask(torch.nn.Sequential(snack.SparseConvTranspose2d(2, 2, 3)))
    conv = masked[4]
    assert int(conv.mask.sum()) == sparse[4].nnz and conv.mask.shape == (64, 32, 3, 3)
    _same_outputs_and_input_gradients_then_backward(sparse, masked, 144)
    # the mask keeps the weight gradient on the topology: Dense+Mask trains the same connections
    assert int((conv.weight.grad != 0).sum()) <= sparse[4].nnz
    assert (conv.weight.grad[conv.mask == 0] == 0).all()


def test_dense_plus_mask_computes_what_the_sparse_character_model_does():
    torch.manual_seed(0)
    sparse = sparse_char_transformer(11, 16, 8, 0.8, "erk", "cpu").double()
    masked = _same_logits_then_backward(sparse)
    # every weight gradient agrees on the topology and is zero off it; the causal attention included
    for name in ("blocks.0.attention.q_proj", "blocks.1.attention.out_proj", "blocks.1.mlp.2", "head"):
        layer = sparse.get_submodule(name)
        twin = masked.get_submodule(name.replace(".q_proj", ""))
        if name.endswith("q_proj"):
            packed = twin.parametrizations.in_proj_weight
            grad, mask = packed.original.grad[:16], packed[0].mask[:16]
        elif name.endswith("out_proj"):
            grad, mask = twin.parametrizations.weight.original.grad, twin.parametrizations.weight[0].mask
        else:
            grad, mask = twin.weight.grad, twin.mask
        assert (grad[mask == 0] == 0).all()
        torch.testing.assert_close(grad[layer.row.long(), layer.col.long()], layer.values.grad)


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_dense_plus_mask_of_a_recurrent_layer_is_the_torch_layer_with_masked_weights(kind):
    torch.manual_seed(0)
    dense_class = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn": torch.nn.RNN}[kind]
    sparse = snack.sparsify(torch.nn.Sequential(dense_class(6, 5, 2, bidirectional=True)).double(), 0.7)
    masked = dense_plus_mask(sparse)
    rnn, sparse_rnn = masked[0], sparse[0]
    assert type(rnn).__name__ == f"Parametrized{dense_class.__name__}"  # torch's layer and its fused kernel
    x = torch.randn(4, 3, 6, dtype=torch.float64, requires_grad=True)
    (out_sparse, _), (out_masked, _) = sparse_rnn(x), rnn(x)
    torch.testing.assert_close(out_masked, out_sparse)
    g = torch.randn_like(out_sparse)
    (dx_sparse,) = torch.autograd.grad(out_sparse, x, g, retain_graph=True)
    (dx_masked,) = torch.autograd.grad(out_masked, x, g, retain_graph=True)
    torch.testing.assert_close(dx_masked, dx_sparse)
    out_sparse.backward(g)
    out_masked.backward(g)
    # each matrix trains the sparse layer's connections only, with its gradients
    for name, layer in sparse_rnn.sparse_layers().items():
        weight = getattr(rnn.parametrizations, f"weight_{name}")
        grad, mask = weight.original.grad, weight[0].mask
        assert int(mask.sum()) == layer.nnz and (grad[mask == 0] == 0).all()
        torch.testing.assert_close(grad[layer.row.long(), layer.col.long()], layer.values.grad)
        torch.testing.assert_close(getattr(rnn, f"bias_{name}").grad, layer.bias.grad)


def test_dense_plus_mask_computes_what_the_sparse_character_lstm_does():
    torch.manual_seed(0)
    sparse = sparse_char_lstm(11, 16, 8, 0.8, "erk", "cpu").double()
    masked = _same_logits_then_backward(sparse)
    assert isinstance(masked.lstm, torch.nn.LSTM) and isinstance(masked.head, MaskedLinear)
    hh = masked.lstm.parametrizations.weight_hh_l1.original.grad
    torch.testing.assert_close(hh[sparse.lstm.hh_l1.row.long(), sparse.lstm.hh_l1.col.long()],
                               sparse.lstm.hh_l1.values.grad)  # fmt: skip
