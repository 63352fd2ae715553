"""SparseMultiheadAttention against nn.MultiheadAttention holding the same (masked) weights."""

from __future__ import annotations

import copy
import itertools
import re
import warnings

import pytest
import torch
from torch import nn

import snack
from snack import SparseLinear, SparseMultiheadAttention
from tests.test_truly_sparse import LargestTensorMode

E, H = 8, 2  # embed_dim, num_heads of the small cases
N, L, S = 3, 4, 6  # batch, target and source lengths


def _dense_attention(kdim=None, vdim=None, **options) -> nn.MultiheadAttention:
    return nn.MultiheadAttention(E, H, kdim=kdim, vdim=vdim, dtype=torch.float64, **options).eval()


def _inputs(batch_first: bool, kdim: int, vdim: int, batched: bool = True):
    def sequence(length, width):
        if not batched:
            return torch.randn(length, width, dtype=torch.float64, requires_grad=True)
        shape = (N, length, width) if batch_first else (length, N, width)
        return torch.randn(shape, dtype=torch.float64, requires_grad=True)

    return sequence(L, E), sequence(S, kdim), sequence(S, vdim)


def _masks(kind: int, batched: bool = True):
    """``(key_padding_mask, attn_mask)``: none, boolean padding, a float 2-D mask, both, a 3-D
    boolean mask (no row fully masked: torch gives NaN there, and so does this module)."""
    padding = torch.rand((N, S) if batched else (S,)) < 0.4
    padding[..., 0] = False
    per_head = torch.rand(N * H, L, S) < 0.3
    per_head[..., 1] = False
    return [(None, None), (padding, None), (None, torch.randn(L, S, dtype=torch.float64)),
            (padding.double() * -3.0, torch.randn(L, S, dtype=torch.float64)), (None, per_head)][kind]  # fmt: skip


def _outputs_and_gradients(attention, inputs, **call):
    """``(output, weights, the inputs' gradients, {parameter name: gradient})`` of one loss on the
    module's outputs."""
    output, weights = attention(*inputs, **call)
    torch.manual_seed(7)  # the same cotangents for both modules (randn_like would follow their strides)
    loss = (output * torch.randn(output.shape, dtype=output.dtype)).sum()
    if weights is not None:
        loss = loss + (weights * torch.randn(weights.shape, dtype=weights.dtype)).sum()
    gradients = torch.autograd.grad(loss, [*inputs, *attention.parameters()])
    return output, weights, gradients[:3], dict(zip([name for name, _ in attention.named_parameters()], gradients[3:]))


def _sparse_gradients_as_dense(sparse: SparseMultiheadAttention, gradients: dict) -> dict:
    """``{projection: (dense weight gradient, bias gradient)}`` from a sparse module's gradients."""
    dense = {}
    for name, layer in sparse.projections().items():
        weight = torch.zeros(layer.out_features, layer.in_features, dtype=torch.float64)
        weight[layer.row.long(), layer.col.long()] = gradients[f"{name}.values"]
        dense[name] = (weight, gradients.get(f"{name}.bias"))
    return dense


def _dense_gradients(dense: nn.MultiheadAttention, gradients: dict, sparse: SparseMultiheadAttention) -> dict:
    """The same from the dense module's, kept at the sparse connections only (the dense module's
    gradient off them is what a mask would throw away)."""
    if dense._qkv_same_embed_dim:
        inputs = gradients["in_proj_weight"].chunk(3)
    else:
        inputs = [gradients[f"{name}_weight"] for name in ("q_proj", "k_proj", "v_proj")]
    biases = gradients["in_proj_bias"].chunk(3) if "in_proj_bias" in gradients else (None,) * 3
    pairs = dict(zip(("q_proj", "k_proj", "v_proj"), zip(inputs, biases)))
    pairs["out_proj"] = (gradients["out_proj.weight"], gradients.get("out_proj.bias"))
    kept = {}
    for name, (weight, bias) in pairs.items():
        mask = torch.zeros_like(weight, dtype=torch.bool)
        layer = getattr(sparse, name)
        mask[layer.row.long(), layer.col.long()] = True
        kept[name] = (weight * mask, bias)
    return kept


CASES = list(itertools.product(
    [False, True],  # batch_first
    [(None, None), (5, 7)],  # kdim, vdim
    [True, False],  # bias
    [(False, False), (True, False), (True, True)],  # add_bias_kv, add_zero_attn
    [True, False],  # need_weights
))  # fmt: skip


@pytest.mark.parametrize("batch_first, dims, bias, extra, need_weights", CASES)
def test_it_computes_what_nn_multihead_attention_computes_with_its_sparse_weights(
    batch_first, dims, bias, extra, need_weights
):
    """Outputs, attention weights and every gradient equal those of an nn.MultiheadAttention whose
    weights are the sparse ones (zero elsewhere), for every mask kind."""
    kdim, vdim = dims
    add_bias_kv, add_zero_attn = extra
    original = _dense_attention(kdim, vdim, bias=bias, add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn,
                                batch_first=batch_first)  # fmt: skip
    sparse = SparseMultiheadAttention.from_dense(original, sparsity=0.6)
    layers = sparse.projections().values()
    assert all(layer.nnz == round(0.4 * layer.out_features * layer.in_features) for layer in layers)
    dense = sparse.to_dense_module()
    for kind in range(5):
        inputs = _inputs(batch_first, kdim or E, vdim or E)
        key_padding_mask, attn_mask = _masks(kind)
        call = dict(key_padding_mask=key_padding_mask, attn_mask=attn_mask, need_weights=need_weights,
                    average_attn_weights=kind % 2 == 0)  # fmt: skip
        got = _outputs_and_gradients(sparse, inputs, **call)
        expected = _outputs_and_gradients(dense, inputs, **call)
        torch.testing.assert_close(got[0], expected[0])
        assert (got[1] is None) == (expected[1] is None) == (not need_weights)
        if need_weights:
            torch.testing.assert_close(got[1], expected[1])
        for mine, theirs in zip(got[2], expected[2]):
            torch.testing.assert_close(mine, theirs)
        torch.testing.assert_close(_sparse_gradients_as_dense(sparse, got[3]),
                                   _dense_gradients(dense, expected[3], sparse))  # fmt: skip
        for name in ("bias_k", "bias_v"):
            if add_bias_kv:
                torch.testing.assert_close(got[3][name], expected[3][name])


def test_to_dense_module_holds_each_projections_dense_weight():
    """The oracle above: the dense module's packed and separate weights are the projections'."""
    for dims in ((None, None), (5, 7)):
        sparse = SparseMultiheadAttention.from_dense(_dense_attention(*dims, add_bias_kv=True), sparsity=0.5)
        dense = sparse.to_dense_module()
        assert type(dense) is nn.MultiheadAttention and not dense.training
        weights = dense.in_proj_weight.chunk(3) if dense._qkv_same_embed_dim else (
            dense.q_proj_weight, dense.k_proj_weight, dense.v_proj_weight)  # fmt: skip
        for weight, bias, name in zip(weights, dense.in_proj_bias.chunk(3), ("q_proj", "k_proj", "v_proj")):
            assert torch.equal(weight, getattr(sparse, name).to_dense())
            assert torch.equal(bias, getattr(sparse, name).bias)
        assert torch.equal(dense.out_proj.weight, sparse.out_proj.to_dense())
        assert torch.equal(dense.bias_k, sparse.bias_k) and torch.equal(dense.bias_v, sparse.bias_v)


def test_from_dense_keeping_every_weight_computes_exactly_what_the_original_does():
    original = _dense_attention(batch_first=True)
    sparse = SparseMultiheadAttention.from_dense(original)
    assert all(layer.sparsity == 0 for layer in sparse.projections().values())
    inputs = _inputs(True, E, E)
    for need_weights in (True, False):
        got, expected = sparse(*inputs, need_weights=need_weights), original(*inputs, need_weights=need_weights)
        torch.testing.assert_close(got[0], expected[0])


def test_from_dense_takes_one_sparsity_per_projection_and_keeps_the_largest_weights():
    original = _dense_attention()
    sparsities = {"q_proj": 0.5, "k_proj": 0.75, "v_proj": None, "out_proj": 0.25}
    sparse = SparseMultiheadAttention.from_dense(original, sparsity=sparsities)
    assert [layer.nnz for layer in sparse.projections().values()] == [32, 16, 64, 48]
    q_weight = original.in_proj_weight[:E].detach()
    kept = q_weight.abs().flatten().topk(32).indices
    assert torch.equal(torch.sort(sparse.q_proj._flat_index()).values, torch.sort(kept).values)
    with pytest.raises(ValueError, match=r"a mapping must name exactly \('q_proj', 'k_proj', 'v_proj', 'out_proj'\)"):
        SparseMultiheadAttention.from_dense(original, sparsity={"q_proj": 0.5})
    with pytest.raises(TypeError, match="attention must be an nn.MultiheadAttention, got Linear"):
        SparseMultiheadAttention.from_dense(nn.Linear(4, 4))


def test_one_unbatched_sample_is_a_batch_of_one():
    for batch_first in (False, True):
        sparse = SparseMultiheadAttention.from_dense(_dense_attention(5, 7, batch_first=batch_first), sparsity=0.5)
        dense = sparse.to_dense_module()
        inputs = _inputs(batch_first, 5, 7, batched=False)
        padding, _ = _masks(1, batched=False)
        for need_weights in (True, False):
            got = sparse(*inputs, key_padding_mask=padding, need_weights=need_weights)
            expected = dense(*inputs, key_padding_mask=padding, need_weights=need_weights)
            assert got[0].shape == (L, E)
            torch.testing.assert_close(got[0], expected[0])
            if need_weights:
                assert got[1].shape == (L, S)
                torch.testing.assert_close(got[1], expected[1])


def test_is_causal_needs_its_mask_and_gives_what_the_mask_gives():
    sparse = SparseMultiheadAttention(E, H, batch_first=True, sparsity=0.5, dtype=torch.float64).eval()
    x = torch.randn(N, L, E, dtype=torch.float64)
    causal = nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64)
    with pytest.raises(ValueError, match="is_causal=True is a hint that attn_mask is causal, and needs that attn_mask"):
        sparse(x, x, x, is_causal=True)
    expected = sparse.to_dense_module()(x, x, x, attn_mask=causal, need_weights=False)[0]
    for need_weights in (False, True):  # SDPA's causal flag, or the mask
        got = sparse(x, x, x, attn_mask=causal, is_causal=True, need_weights=need_weights)[0]
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("need_weights", [True, False])
def test_dropout_in_training_draws_what_the_dense_module_draws(need_weights):
    """The same random numbers as nn.MultiheadAttention (projections draw none)."""
    sparse = SparseMultiheadAttention(E, H, dropout=0.5, sparsity=0.5, dtype=torch.float64)
    dense = sparse.to_dense_module()
    assert sparse.training and dense.training
    inputs = _inputs(False, E, E)
    torch.manual_seed(3)
    got = sparse(*inputs, need_weights=need_weights)[0]
    torch.manual_seed(3)
    expected = dense(*inputs, need_weights=need_weights)[0]
    torch.testing.assert_close(got, expected)
    assert not torch.allclose(got, sparse.eval()(*inputs, need_weights=need_weights)[0])


def test_gradcheck_in_float64():
    sparse = SparseMultiheadAttention(6, 2, kdim=5, vdim=3, add_bias_kv=True, sparsity=0.5, dtype=torch.float64)
    query = torch.randn(3, 2, 6, dtype=torch.float64, requires_grad=True)
    key = torch.randn(4, 2, 5, dtype=torch.float64, requires_grad=True)
    value = torch.randn(4, 2, 3, dtype=torch.float64, requires_grad=True)
    parameters = [p for _, p in sorted(sparse.named_parameters())]

    def attend(query, key, value, *values):
        with torch.nn.utils.stateless._reparametrize_module(
            sparse, dict(zip(sorted(name for name, _ in sparse.named_parameters()), values))
        ):
            return sparse(query, key, value, need_weights=False)[0]

    assert torch.autograd.gradcheck(attend, (query, key, value, *parameters))


def test_projections_with_no_connection_or_empty_rows():
    """nnz = 0 in a projection (its output is its bias), and rows without connections."""
    original = _dense_attention(batch_first=True)
    with torch.no_grad():
        original.in_proj_weight[:E].zero_()  # q_proj: no connection at all
        original.out_proj.weight[::2].zero_()  # out_proj: every other row empty
    sparse = SparseMultiheadAttention.from_dense(original)
    assert sparse.q_proj.nnz == 0 and sparse.out_proj.nnz == E * E // 2
    inputs = _inputs(True, E, E)
    got = _outputs_and_gradients(sparse, inputs)
    expected = _outputs_and_gradients(sparse.to_dense_module(), inputs)
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1])
    for mine, theirs in zip(got[2], expected[2]):
        torch.testing.assert_close(mine, theirs)
    assert got[3]["q_proj.values"].numel() == 0


def test_init_gives_the_projection_variances_of_the_dense_init():
    """Each input projection's output variance is what nn.MultiheadAttention's Xavier init gives
    (half the input's when packed, 2d/(E+d) of it when separate), at any sparsity."""
    torch.manual_seed(0)
    for kdim in (None, 512):
        dense = nn.MultiheadAttention(256, 4, kdim=kdim, vdim=kdim)
        sparse = SparseMultiheadAttention(256, 4, kdim=kdim, vdim=kdim, sparsity=0.95)
        assert all(layer.bias.abs().max() == 0 for layer in sparse.projections().values())
        x = torch.randn(4096, kdim or 256)
        with torch.no_grad():
            k_weight = dense.in_proj_weight[256:512] if kdim is None else dense.k_proj_weight
            expected = (x @ k_weight.T).var()
            got = sparse.k_proj(x).var()
        assert got == pytest.approx(float(expected), rel=0.1)
        assert expected == pytest.approx(0.5 if kdim is None else 2 * 512 / (256 + 512), rel=0.1)


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match=r"embed_dim \(10\) must be divisible by num_heads \(4\)"):
        SparseMultiheadAttention(10, 4)
    with pytest.raises(ValueError, match="num_heads must be a positive int, got 0"):
        SparseMultiheadAttention(8, 0)
    with pytest.raises(ValueError, match="kdim must be a positive int, got -3"):
        SparseMultiheadAttention(8, 2, kdim=-3)
    with pytest.raises(ValueError, match=r"dropout must be a probability in \[0, 1\], got 1.5"):
        SparseMultiheadAttention(8, 2, dropout=1.5)
    with pytest.raises(ValueError, match=r"sparsity must be in \[0, 1\)"):
        SparseMultiheadAttention(8, 2, sparsity=1.0)
    sparse = SparseMultiheadAttention(E, H, kdim=5, sparsity=0.5)
    before = copy.deepcopy(sparse.state_dict())
    x, k = torch.randn(L, N, E), torch.randn(S, N, 5)
    with pytest.raises(ValueError, match=r"key must have 5 features in its last dimension, got shape \(6, 3, 8\)"):
        sparse(x, torch.randn(S, N, E), k)
    with pytest.raises(ValueError, match="query, key and value must all be 3-D .* or all 2-D"):
        sparse(x[0], k, torch.randn(S, N, E))
    with pytest.raises(ValueError, match=r"key and value must have the same sequence length and batch"):
        sparse(x, k, torch.randn(S + 1, N, E))
    with pytest.raises(ValueError, match=r"query and key must have the same batch, got shapes \(4, 3, 8\) and"):
        sparse(x, torch.randn(S, N + 1, 5), torch.randn(S, N + 1, E))
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(3, 6\), got \(6, 3\)"):
        sparse(x, k, torch.randn(S, N, E), key_padding_mask=torch.zeros(S, N, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attn_mask must have shape \(4, 6\) or \(6, 4, 6\), got \(6, 4\)"):
        sparse(x, k, torch.randn(S, N, E), attn_mask=torch.zeros(S, L))
    with pytest.raises(TypeError, match="attn_mask must be boolean or floating, got torch.int64"):
        sparse(x, k, torch.randn(S, N, E), attn_mask=torch.zeros(L, S, dtype=torch.long))
    with pytest.raises(TypeError, match="value must be a Tensor, got list"):
        sparse(x, k, [1.0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # nested tensors are a prototype
        nested = torch.nested.nested_tensor([torch.randn(3, E), torch.randn(4, E)])
    with pytest.raises(ValueError, match="query is a nested tensor, which it does not take; pad the sequences"):
        sparse(nested, nested, nested)
    assert all(torch.equal(before[key], value) for key, value in sparse.state_dict().items())


def test_no_embed_dim_squared_tensor_in_a_training_step():
    """Truly sparse: a 512-wide attention's training step builds no (512, 512) tensor (the
    activations and scores here are far smaller)."""
    with LargestTensorMode() as mode:
        sparse = SparseMultiheadAttention(512, 8, batch_first=True, sparsity=0.95)
        x = torch.randn(2, 16, 512, requires_grad=True)
        output, weights = sparse(x, x, x)
        (output.square().sum() + weights.sum()).backward()
        torch.optim.Adam(sparse.parameters()).step()
    assert sparse.q_proj.values.grad is not None and x.grad is not None
    assert mode.largest < 512 * 512 // 4, f"{mode.largest_op} produced {mode.largest} elements"


def _encoder(batch_first=True) -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=batch_first)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")  # the dense model's fast path
def test_sparsify_converts_the_attention_of_a_transformer_and_its_eval_fast_paths_step_aside():
    torch.manual_seed(0)
    model = _encoder().eval()
    x = torch.randn(3, 5, 16)
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[0, 3:] = True
    with torch.no_grad():
        expected = model(x, src_key_padding_mask=padding)  # the nested-tensor fast path, dense
    assert model.use_nested_tensor
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: every layer converted
        snack.sparsify(model, sparsity=0.0)
    for layer in model.layers:
        assert isinstance(layer.self_attn, SparseMultiheadAttention)
        assert all(isinstance(m, SparseLinear) for m in (*layer.self_attn.projections().values(), layer.linear1))
    assert not model.use_nested_tensor  # its fast path reads out_proj.weight
    with torch.no_grad():
        got = model(x, src_key_padding_mask=padding)
    torch.testing.assert_close(got[~padding], expected[~padding], rtol=1e-5, atol=1e-5)
    back = snack.densify(model)
    assert all(type(layer.self_attn) is nn.MultiheadAttention for layer in back.layers)
    with torch.no_grad():
        torch.testing.assert_close(back(x, src_key_padding_mask=padding)[~padding], expected[~padding],
                                   rtol=1e-5, atol=1e-5)  # fmt: skip


def test_sparsify_counts_each_projection_as_a_layer_for_the_distribution():
    model = nn.Sequential(nn.MultiheadAttention(64, 4, kdim=16, vdim=16))
    snack.sparsify(model, sparsity=0.9, distribution="erk")
    layers = model[0].projections()
    shapes = {f"0.{name}": (layer.out_features, layer.in_features) for name, layer in layers.items()}
    expected = snack.distributions.layer_sparsities(shapes, 0.9, "erk")
    assert {f"0.{name}": layer.sparsity for name, layer in layers.items()} == pytest.approx(expected, abs=1e-3)
    assert expected["0.k_proj"] < expected["0.q_proj"]  # ERK: the narrower projection is denser
    total = sum(layer.nnz for layer in layers.values())
    assert total == pytest.approx(0.1 * (2 * 64 * 64 + 2 * 64 * 16), rel=0.01)


def test_sparsify_leaves_out_proj_to_its_attention_and_warns_where_a_fast_path_stays():
    model = _encoder()
    with pytest.warns(UserWarning, match=r"converted no layer: the model holds no nn.Linear, nn.MultiheadAttention"):
        snack.sparsify(model, 0.5, include="*out_proj")  # out_proj alone is never converted
    with pytest.warns(UserWarning) as caught:
        snack.sparsify(model, 0.5, exclude="*self_attn")
    assert len(caught) == 1
    assert "layers.0.linear1, layers.0.linear2, layers.1.linear1, layers.1.linear2" in str(caught[0].message)
    assert "whose self_attn stays a dense nn.MultiheadAttention" in str(caught[0].message)
    assert all(type(layer.self_attn) is nn.MultiheadAttention for layer in model.layers)

    class Attention(nn.MultiheadAttention):
        pass

    with pytest.warns(UserWarning, match=r"subclass\(es\) of nn.Linear, nn.MultiheadAttention, nn.LSTM, nn.GRU or "
                                         r"nn.RNN dense: 0 \(Attention"):  # fmt: skip
        snack.sparsify(nn.Sequential(Attention(8, 2), nn.Linear(8, 8)), 0.5)


def test_sparsify_leaves_an_attention_with_tied_or_hooked_parameters_dense():
    model = nn.Sequential(nn.MultiheadAttention(8, 2), nn.Linear(8, 8))
    model[1].weight = model[0].out_proj.weight
    hooked = nn.Sequential(nn.MultiheadAttention(8, 2))
    hooked[0].register_forward_pre_hook(lambda module, args: None)
    for model, options, why in ((model, dict(exclude="1"), r"tied to another module's: 0 \(with 1\)"),
                                (hooked, {}, r"sparsify left 1 layer\(s\) dense: 0: it has forward pre-hooks")):
        with pytest.warns(UserWarning) as caught:
            snack.sparsify(model, 0.5, **options)
        assert [str(w.message)[:30] for w in caught][1:] == ["sparsify converted no layer: t"]
        assert re.search(why, str(caught[0].message))
        assert type(model[0]) is nn.MultiheadAttention


def test_sparsify_a_bare_attention_and_keep_its_state():
    original = nn.MultiheadAttention(8, 2, bias=False, add_bias_kv=True, batch_first=True).eval()
    original.out_proj.weight.requires_grad_(False)
    sparse = snack.sparsify(original, 0.5)
    assert isinstance(sparse, SparseMultiheadAttention) and not sparse.training and sparse.batch_first
    assert sparse.q_proj.bias is None and sparse.bias_k is not None
    assert not sparse.out_proj.values.requires_grad and sparse.q_proj.values.requires_grad
    dense = snack.densify(sparse)
    assert type(dense) is nn.MultiheadAttention and dense.in_proj_bias is None
    assert not dense.out_proj.weight.requires_grad and dense.in_proj_weight.requires_grad


def test_a_meta_model_sparsified_at_random_materialises_and_trains():
    with torch.device("meta"):
        model = _encoder()
    with pytest.raises(NotImplementedError, match="are on the meta device"):
        snack.sparsify(model, 0.8)
    snack.sparsify(model, 0.8, init="random")
    materialise_and_check_one_step(model, torch.randn(2, 5, 16), lr=0.05)
    attention = model.layers[0].self_attn
    assert attention.q_proj.row.device.type == "cpu" and attention.q_proj.nnz == round(0.2 * 16 * 16)


def materialise_and_check_one_step(model: nn.Module, x: torch.Tensor, lr: float) -> None:
    """Materialise a model built on the meta device (``to_empty`` on the CPU, every module's
    ``reset_parameters``) and check that one SGD step on ``model(x)``'s mean square lowers it."""
    model.to_empty(device="cpu")
    model.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    assert model(x).square().mean() < loss


def test_dst_rewires_the_projections_and_the_state_dict_carries_them():
    torch.manual_seed(0)
    model = snack.sparsify(nn.Sequential(_encoder(), nn.Flatten(), nn.Linear(5 * 16, 3)), 0.8, init="random")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rigl = snack.dst.RigL(model, optimizer, update_every=2, total_steps=100)
    q_proj = model[0].layers[0].self_attn.q_proj
    before = q_proj.indices().clone()
    x, y = torch.randn(4, 5, 16), torch.randint(0, 3, (4,))
    for _ in range(4):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        rigl.step()
    assert not torch.equal(q_proj.indices(), before)
    assert q_proj in [layer for _, layer in rigl.layers]
    other = snack.sparsify(nn.Sequential(_encoder(), nn.Flatten(), nn.Linear(5 * 16, 3)), 0.8, init="random")
    other.load_state_dict(model.state_dict())
    torch.testing.assert_close(other(x), model(x))


def test_a_compiled_attention_computes_what_the_eager_one_does():
    sparse = SparseMultiheadAttention(E, H, batch_first=True, sparsity=0.5)
    compiled = torch.compile(sparse, fullgraph=True, backend="aot_eager")
    x = torch.randn(N, L, E, requires_grad=True)
    padding = torch.zeros(N, L, dtype=torch.bool)
    padding[:, -1] = True
    for need_weights in (False, True):
        got = compiled(x, x, x, key_padding_mask=padding, need_weights=need_weights)[0]
        expected = sparse(x, x, x, key_padding_mask=padding, need_weights=need_weights)[0]
        torch.testing.assert_close(got, expected)
        (grad,) = torch.autograd.grad(got.sum(), x)
        torch.testing.assert_close(grad, torch.autograd.grad(expected.sum(), x)[0])


def test_autocast_computes_in_bfloat16_with_masks():
    sparse = SparseMultiheadAttention(E, H, batch_first=True, sparsity=0.5)
    x = torch.randn(N, L, E)
    padding = torch.zeros(N, L, dtype=torch.bool)
    padding[0, -1] = True
    for need_weights in (True, False):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            output, _ = sparse(x, x, x, key_padding_mask=padding, need_weights=need_weights)
        assert output.dtype == torch.bfloat16
        expected = sparse(x, x, x, key_padding_mask=padding, need_weights=need_weights)[0]
        torch.testing.assert_close(output.float(), expected, rtol=0.05, atol=0.05)
        output.float().sum().backward()
        assert sparse.q_proj.values.grad.dtype == torch.float32


class _SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = SparseMultiheadAttention(E, H, batch_first=True, sparsity=0.5)

    def forward(self, x):
        return self.attention(x, x, x, need_weights=False)[0]


def test_programs_made_by_export_trace_and_fx_compute_what_the_module_does():
    model = _SelfAttention().eval()
    x, other = torch.randn(N, L, E), torch.randn(N + 2, L + 1, E)
    exported, _ = export_trace_and_fx(model, x, {0: torch.export.Dim("batch"), 1: torch.export.Dim("length")})
    torch.testing.assert_close(exported(other), model(other))
    with pytest.raises(NotImplementedError, match="symbolic_trace of a SparseMultiheadAttention itself"):
        torch.fx.symbolic_trace(model.attention)


def export_trace_and_fx(model: nn.Module, x: torch.Tensor, dynamic: dict) -> tuple:
    """The exported and FX programs of ``model`` (whose forward returns its sparse
    composite's first output) on ``x``, ``dynamic`` the export's dynamic dimensions of ``x``;
    checks that they and a ``jit.trace`` (which warns nothing) compute what ``model`` does on ``x``, and
    that FX records the composite as one call."""
    exported = torch.export.export(model, (x,), dynamic_shapes=(dynamic,)).module()
    with warnings.catch_warnings():
        warnings.simplefilter("error", torch.jit.TracerWarning)  # the checks say nothing into the trace
        warnings.filterwarnings("ignore", "`torch.jit.trace", DeprecationWarning)
        traced = torch.jit.trace(model, (x,))
    graph = torch.fx.symbolic_trace(model)
    assert [n.target.__name__ for n in graph.graph.nodes if n.op == "call_function"] == ["fx_layer_forward", "getitem"]
    for program in (exported, traced, graph):
        torch.testing.assert_close(program(x), model(x))
    return exported, graph


def test_an_averaged_copy_follows_the_projections_rewires():
    torch.manual_seed(0)
    model = snack.sparsify(nn.Sequential(_encoder(), nn.Flatten(), nn.Linear(5 * 16, 3)), 0.8, init="random")
    averaged = snack.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rigl = snack.dst.RigL(model, optimizer, update_every=1, total_steps=100)
    x, y = torch.randn(4, 5, 16), torch.randint(0, 3, (4,))
    for _ in range(2):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        assert rigl.step()
        averaged.update_parameters(model)
    for mine, copy_ in zip(model[0].layers[0].self_attn.projections().values(),
                           averaged.module[0].layers[0].self_attn.projections().values()):  # fmt: skip
        assert torch.equal(mine.indices(), copy_.indices())
    assert torch.isfinite(averaged(x)).all()  # the copy computes with its aligned projections


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # torch's SDPA backward has no batching rule
def test_per_sample_gradients_with_torch_func():
    """vmap(grad(...)) through functional_call gives each sample's gradient of every projection's
    values, as a loop over the samples does (snack.func makes the sparse ops compose)."""
    from torch.func import functional_call, grad, vmap

    sparse = SparseMultiheadAttention(E, H, batch_first=True, sparsity=0.5, dtype=torch.float64)
    params = {name: p.detach() for name, p in sparse.named_parameters()}
    buffers = dict(sparse.named_buffers())
    x = torch.randn(4, L, E, dtype=torch.float64)

    def loss(parameters, sample):
        one = sample[None]
        output, _ = functional_call(sparse, (parameters, buffers), (one, one, one), {"need_weights": False})
        return output.square().sum()

    per_sample = vmap(grad(loss), in_dims=(None, 0))(params, x)
    assert per_sample["q_proj.values"].shape == (4, sparse.q_proj.nnz)
    for i in range(4):
        leaves = {name: p.clone().requires_grad_() for name, p in params.items()}
        expected = torch.autograd.grad(loss(leaves, x[i]), list(leaves.values()))
        for name, gradient in zip(leaves, expected):
            torch.testing.assert_close(per_sample[name][i], gradient)
