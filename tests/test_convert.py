"""sparsify and densify (snack.nn.convert): which layers convert, what they keep, what warns."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from conftest import tiny_gpt2
from torch import nn

import snack
from snack.nn import SparseLinear


def _mlp():
    return nn.Sequential(nn.Linear(20, 30), nn.ReLU(), nn.Sequential(nn.Linear(30, 30), nn.Tanh()), nn.Linear(30, 5))


def test_sparsify_replaces_linears_keeping_largest_weights():
    model = _mlp()
    original = copy.deepcopy(model)
    result = snack.sparsify(model, sparsity=0.8)
    assert result is model
    layers = [model[0], model[2][0], model[3]]
    assert all(isinstance(layer, SparseLinear) for layer in layers)
    for layer, dense in zip(layers, [original[0], original[2][0], original[3]]):
        expected = SparseLinear.from_dense(dense, sparsity=0.8)
        assert torch.equal(layer.to_dense(), expected.to_dense())
        assert torch.equal(layer.bias, dense.bias)


def test_sparsify_at_zero_sparsity_is_exact():
    model = _mlp()
    x = torch.randn(4, 20)
    expected = model(x)
    torch.testing.assert_close(snack.sparsify(model, sparsity=0.0)(x), expected)


def test_sparsify_include_exclude_and_random_init():
    model = snack.sparsify(_mlp(), sparsity=0.5, exclude="3", init="random")
    assert isinstance(model[0], SparseLinear) and isinstance(model[2][0], SparseLinear)
    assert isinstance(model[3], nn.Linear)
    model = snack.sparsify(_mlp(), sparsity=0.5, include=["2.*"])
    assert isinstance(model[2][0], SparseLinear) and isinstance(model[0], nn.Linear)


def test_sparsify_warns_when_it_likely_missed_what_was_meant():
    model = _mlp()
    with pytest.warns(UserWarning) as caught:
        snack.sparsify(model, sparsity=0.5, include="fc*")
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert all(w.filename == __file__ for w in caught)  # they point at the call
    assert messages[0].startswith("sparsify: include pattern 'fc*' matches no module name (names look like '0', ")
    assert messages[1].startswith("sparsify converted no layer: the model holds no nn.Linear, nn.MultiheadAttention, "
                                  "recurrent (nn.LSTM, nn.GRU, nn.RNN) or 1-, 2- or 3-D (transposed) convolution "
                                  "selected by include/")
    with pytest.warns(UserWarning, match="exclude pattern '33' matches no module name"):
        snack.sparsify(model, sparsity=0.5, exclude="33")
    with pytest.warns(UserWarning, match="its 3 SparseLinear layer\\(s\\) keep their sparsity"):
        snack.sparsify(model, sparsity=0.99)  # meant to raise the sparsity of a sparse model
    assert model[0].sparsity == pytest.approx(0.5, abs=0.01)


def test_sparsify_warns_that_transformer_layers_fast_path_reads_weight():
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 1)
    with pytest.warns(UserWarning, match=r"layers.0.linear1, layers.0.linear2\): in eval mode .*set_fastpath_enabled"):
        snack.sparsify(encoder, sparsity=0.5, exclude="*self_attn")


def test_sparsify_a_bare_linear_returns_a_new_layer():
    layer = snack.sparsify(nn.Linear(6, 4), sparsity=0.5)
    assert isinstance(layer, SparseLinear) and layer.nnz == 12


def test_sparsify_rejects_bad_arguments():
    model = _mlp()
    with pytest.raises(ValueError, match=r"sparsity must be in \[0, 1\)"):
        snack.sparsify(model, sparsity=1.2)
    with pytest.raises(ValueError, match="distribution must be one of"):
        snack.sparsify(model, distribution="gaussian")
    with pytest.raises(ValueError, match="init must be"):
        snack.sparsify(model, init="zeros")
    assert all(isinstance(m, nn.Linear) for m in (model[0], model[2][0], model[3]))


def test_densify_round_trip():
    model = snack.sparsify(_mlp(), sparsity=0.7)
    x = torch.randn(3, 20)
    expected = model(x)
    dense = snack.densify(model)
    assert not any(isinstance(m, SparseLinear) for m in dense.modules())
    torch.testing.assert_close(dense(x), expected)


def test_sparsify_gpt2_conv1d():
    model = tiny_gpt2().eval()
    tokens = torch.randint(0, 50, (2, 8))
    with torch.no_grad():
        expected = model(tokens).logits
    conv_weight = model.transformer.h[0].mlp.c_fc.weight.detach().clone()  # (in, out)
    snack.sparsify(model, sparsity=0.0, exclude="lm_head")
    mlp = model.transformer.h[0].mlp
    assert isinstance(mlp.c_fc, SparseLinear) and (mlp.c_fc.in_features, mlp.c_fc.out_features) == (32, 128)
    assert torch.equal(mlp.c_fc.to_dense(), conv_weight.t())
    assert isinstance(model.lm_head, nn.Linear)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, expected, rtol=1e-5, atol=1e-5)


class _DoubledLinear(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


def test_sparsify_leaves_linear_subclasses_dense_with_a_warning():
    model = nn.Sequential(_DoubledLinear(16, 16), nn.Linear(16, 16))
    with pytest.warns(UserWarning, match=r"left 1 subclass\(es\) of nn.Linear, nn.MultiheadAttention, nn.LSTM, "
                                         r"nn.GRU or nn.RNN dense: 0 \(_DoubledLinear\)") as caught:  # fmt: skip
        snack.sparsify(model, 0.5)
    assert caught[0].filename == __file__  # it points at the call
    assert type(model[0]) is _DoubledLinear and isinstance(model[1], SparseLinear)


def test_sparsify_says_how_to_convert_a_parametrized_or_lazy_linear():
    model = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(4, 4)), nn.LazyLinear(3))
    with pytest.warns(UserWarning) as caught:
        snack.sparsify(model, 0.5)
    message = str(caught[0].message)
    assert "0 (ParametrizedLinear: remove its parametrizations first (torch.nn.utils.parametrize." in message
    assert "1 (LazyLinear: run a forward first, which gives it a weight)" in message
    model(torch.randn(2, 4))  # the lazy layer becomes an nn.Linear
    snack.sparsify(model, 0.5, exclude="0")
    assert isinstance(model[1], SparseLinear)


def test_sparsify_converts_a_shared_layer_once_for_all_its_places():
    shared = nn.Linear(16, 16)
    model = snack.sparsify(nn.Sequential(shared, nn.ReLU(), shared), 0.5)
    assert isinstance(model[0], SparseLinear) and model[2] is model[0]
    back = snack.densify(model)
    assert isinstance(back[0], nn.Linear) and back[2] is back[0]


@pytest.mark.parametrize("pattern", ["include", "exclude"])
def test_a_shared_layer_is_selected_by_any_of_its_names(pattern):
    shared = nn.Linear(8, 8)
    model = nn.Sequential(nn.Sequential(shared), nn.Sequential(shared))  # names 0.0 and 1.0
    excluded = pytest.warns(UserWarning, match="converted no layer")
    with excluded if pattern == "exclude" else contextlib.nullcontext():
        model = snack.sparsify(model, 0.5, **{pattern: "1.*"})
    assert isinstance(model[1][0], SparseLinear) is (pattern == "include")
    assert model[0][0] is model[1][0]


def test_a_layer_with_forward_pre_hooks_is_not_converted_from_a_stale_weight():
    """torch.nn.utils.prune recomputes .weight from weight_orig and its mask in a forward
    pre-hook: after an optimizer step .weight is the previous forward's."""
    prune = pytest.importorskip("torch.nn.utils.prune")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    model(torch.randn(2, 8)).sum().backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()  # weight_orig moves; .weight is stale
    with pytest.raises(ValueError, match="forward pre-hooks.*prune.remove"):
        SparseLinear.from_dense(model[0])
    with pytest.warns(UserWarning, match=r"left 1 layer\(s\) dense: 0: it has forward pre-hooks"):
        snack.sparsify(model, 0.5)
    assert type(model[0]) is nn.Linear and isinstance(model[2], SparseLinear)
    prune.remove(model[0], "weight")  # makes the current pruned weight the weight
    layer = SparseLinear.from_dense(model[0])
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer(x), model[0](x))


def test_sparsify_and_densify_keep_training_mode_and_frozen_parameters():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    model[0].requires_grad_(False)
    model[1].eval()
    for converted in (snack.sparsify(model, 0.5), snack.densify(model)):
        first, second = converted[0], converted[1]
        assert all(not p.requires_grad for p in first.parameters())
        assert all(p.requires_grad for p in second.parameters())
        assert converted.training and first.training and not second.training


# ---------------------------------------------------------------------- state_dict formats and partial loads


def test_sparsify_leaves_layers_with_tied_parameters_dense():
    # a sparse copy would untie them: two layers sharing one weight, and GPT-2's lm_head ↔ wte
    first, second = nn.Linear(6, 6), nn.Linear(6, 6)
    second.weight = first.weight
    model = nn.Sequential(first, nn.ReLU(), second, nn.ReLU(), nn.Linear(6, 3))
    with pytest.warns(UserWarning, match=r"tied to another module's: 0 \(with 2\), 2 \(with 0\)"):
        snack.sparsify(model, 0.5)
    assert model[0].weight is model[2].weight and isinstance(model[4], SparseLinear)
    shared = nn.Linear(6, 6)
    model = nn.Sequential(shared, nn.ReLU(), shared)  # one module in two places is not a tie
    snack.sparsify(model, 0.5)
    assert isinstance(model[0], SparseLinear) and model[0] is model[2]


def test_sparsify_leaves_gpt2s_tied_head_dense():
    model = tiny_gpt2()
    with pytest.warns(UserWarning, match=r"lm_head \(with transformer.wte\)"):
        snack.sparsify(model, 0.5)
    assert isinstance(model.lm_head, nn.Linear) and model.lm_head.weight is model.transformer.wte.weight
    assert isinstance(model.transformer.h[0].mlp.c_fc, SparseLinear)
