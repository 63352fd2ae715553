"""SparseLSTM, SparseGRU and SparseRNN against nn.LSTM, nn.GRU and nn.RNN holding the same
(densified) weights: outputs, final states and every gradient, packed sequences, conversions and
dynamic sparse training."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import snack
from snack import SparseGRU, SparseLinear, SparseLSTM, SparseRNN
from snack.dst.capture import GradientCapture
from tests.test_attention import export_trace_and_fx, materialise_and_check_one_step
from tests.test_truly_sparse import LargestTensorMode

T, N, I, H = 5, 3, 4, 6  # steps, sequences, input_size, hidden_size of the small cases

CASES = [
    (SparseLSTM, {}),
    (SparseLSTM, dict(num_layers=2, bidirectional=True)),
    (SparseLSTM, dict(proj_size=2, batch_first=True)),
    (SparseLSTM, dict(num_layers=2, proj_size=3, bidirectional=True, bias=False)),
    (SparseGRU, dict(num_layers=2, bidirectional=True)),
    (SparseGRU, dict(batch_first=True, bias=False)),
    (SparseRNN, dict(num_layers=2)),
    (SparseRNN, dict(nonlinearity="relu", bidirectional=True, batch_first=True)),
]
IDS = [f"{cls.__name__}-{'-'.join(f'{k}={v}' for k, v in options.items()) or 'plain'}" for cls, options in CASES]


def _pair(cls, options, sparsity=0.6):
    """A float64 sparse module and the dense module holding its weights."""
    sparse = cls(I, H, sparsity=sparsity, dtype=torch.float64, **options)
    return sparse, sparse.to_dense_module()


def _initial_state(module, batched=True, requires_grad=True):
    """Random ``hx`` of the module's shapes (an LSTM's ``(h_0, c_0)``)."""
    layers = module.num_layers * (2 if module.bidirectional else 1)
    widths = [module.proj_size or module.hidden_size] + ([module.hidden_size] if isinstance(module, (
        SparseLSTM, nn.LSTM)) else [])  # fmt: skip
    parts = [torch.randn((layers, N, w) if batched else (layers, w), dtype=torch.float64,
                         requires_grad=requires_grad) for w in widths]  # fmt: skip
    return tuple(parts) if len(parts) == 2 else parts[0]


def _flat(state):
    return list(state) if isinstance(state, tuple) else [state]


def _loss(output, state):
    """A loss on every output (the same cotangents for both modules)."""
    data = output.data if isinstance(output, nn.utils.rnn.PackedSequence) else output
    generator = torch.Generator().manual_seed(3)
    parts = [data, *_flat(state)]
    return sum((p * torch.randn(p.shape, dtype=p.dtype, generator=generator)).sum() for p in parts)


def _dense_gradients_at_connections(sparse, dense) -> dict[str, torch.Tensor]:
    """``{sparse parameter name: the dense module's gradient there}``: each matrix's gradient at
    the sparse layer's connections, each bias's whole."""
    gradients = {}
    for name, layer in sparse.sparse_layers().items():
        weight = getattr(dense, f"weight_{name}")
        gradients[f"{name}.values"] = weight.grad[layer.row.long(), layer.col.long()]
        if layer.bias is not None:
            gradients[f"{name}.bias"] = getattr(dense, f"bias_{name}").grad
    return gradients


@pytest.mark.parametrize("cls, options", CASES, ids=IDS)
@pytest.mark.parametrize("given_state", [False, True])
def test_it_computes_what_the_dense_module_computes_with_its_weights(cls, options, given_state):
    torch.manual_seed(0)
    sparse, dense = _pair(cls, options)
    shape = (N, T, I) if sparse.batch_first else (T, N, I)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    hx = _initial_state(sparse) if given_state else None
    output, state = sparse(x, hx)
    expected_output, expected_state = dense(x, hx)
    torch.testing.assert_close(output, expected_output)
    for got, expected in zip(_flat(state), _flat(expected_state), strict=True):
        torch.testing.assert_close(got, expected)
    inputs = [x, *(_flat(hx) if given_state else [])]
    got_gradients = torch.autograd.grad(_loss(output, state), inputs + list(sparse.parameters()))
    _loss(expected_output, expected_state).backward(inputs=inputs + list(dense.parameters()))
    for got, tensor in zip(got_gradients, inputs):
        torch.testing.assert_close(got, tensor.grad)
    expected = _dense_gradients_at_connections(sparse, dense)
    names = [name for name, _ in sparse.named_parameters()]
    assert sorted(names) == sorted(expected)
    for name, got in zip(names, got_gradients[len(inputs):]):
        torch.testing.assert_close(got, expected[name], msg=name)


@pytest.mark.parametrize("cls, options", [CASES[1], CASES[3], CASES[4], CASES[7]], ids=[IDS[1], IDS[3], IDS[4], IDS[7]])
def test_packed_sequences_compute_what_the_dense_module_does(cls, options):
    """Unsorted lengths (one of them the whole sequence, one a single step) and a given state in
    the caller's order of sequences."""
    torch.manual_seed(1)
    sparse, dense = _pair(cls, options)
    lengths = torch.tensor([2, T, 1])
    padded = torch.randn((N, T, I) if sparse.batch_first else (T, N, I), dtype=torch.float64, requires_grad=True)
    packed = pack_padded_sequence(padded, lengths, batch_first=sparse.batch_first, enforce_sorted=False)
    hx = _initial_state(sparse)
    output, state = sparse(packed, hx)
    expected_output, expected_state = dense(packed, hx)
    assert torch.equal(output.batch_sizes, expected_output.batch_sizes)
    assert torch.equal(output.unsorted_indices, expected_output.unsorted_indices)
    torch.testing.assert_close(output.data, expected_output.data)
    for got, expected in zip(_flat(state), _flat(expected_state), strict=True):
        torch.testing.assert_close(got, expected)
    inputs = [padded, *_flat(hx)]
    got = torch.autograd.grad(_loss(output, state), inputs + list(sparse.parameters()), retain_graph=True)  # (packing)
    _loss(expected_output, expected_state).backward(inputs=inputs + list(dense.parameters()))
    for gradient, tensor in zip(got, inputs):
        torch.testing.assert_close(gradient, tensor.grad)
    expected = _dense_gradients_at_connections(sparse, dense)
    for (name, _), gradient in zip(sparse.named_parameters(), got[len(inputs):]):
        torch.testing.assert_close(gradient, expected[name], msg=name)
    unpacked, unpacked_lengths = pad_packed_sequence(output, batch_first=sparse.batch_first)
    assert torch.equal(unpacked_lengths, lengths)


def test_enforce_sorted_packed_sequences_and_one_unbatched_sequence():
    torch.manual_seed(2)
    sparse, dense = _pair(SparseGRU, dict(num_layers=2))
    packed = pack_padded_sequence(torch.randn(T, N, I, dtype=torch.float64), torch.tensor([T, 3, 1]))
    assert packed.sorted_indices is None
    torch.testing.assert_close(sparse(packed)[0].data, dense(packed)[0].data)
    lstm, dense_lstm = _pair(SparseLSTM, dict(bidirectional=True, proj_size=2))
    one = torch.randn(T, I, dtype=torch.float64)
    state = _initial_state(lstm, batched=False, requires_grad=False)
    output, (h, c) = lstm(one, state)
    expected, (expected_h, expected_c) = dense_lstm(one, state)
    assert output.shape == (T, 4) and h.shape == (2, 2) and c.shape == (2, H)
    torch.testing.assert_close(output, expected)
    torch.testing.assert_close(h, expected_h)
    torch.testing.assert_close(c, expected_c)


@pytest.mark.parametrize("cls, options", [CASES[1], CASES[3], CASES[4], CASES[7]], ids=[IDS[1], IDS[3], IDS[4], IDS[7]])
def test_gradcheck_in_float64(cls, options):
    torch.manual_seed(3)
    sparse = cls(3, 4, sparsity=0.5, dtype=torch.float64, **options)
    names = [name for name, _ in sparse.named_parameters()]
    x = torch.randn((2, 3, 3) if sparse.batch_first else (3, 2, 3), dtype=torch.float64, requires_grad=True)
    parameters = [p.detach().clone().requires_grad_() for p in sparse.parameters()]

    def outputs(x, *parameters):
        output, state = torch.func.functional_call(sparse, dict(zip(names, parameters)), (x,))
        return output, *_flat(state)

    assert torch.autograd.gradcheck(outputs, (x, *parameters))


def test_no_connections_an_empty_batch_and_one_step():
    torch.manual_seed(4)
    sparse, dense = _pair(SparseLSTM, dict(num_layers=2))
    empty = torch.zeros(0, dtype=torch.int64)
    sparse.hh_l1.set_topology(empty, empty)
    sparse.ih_l0.set_topology(empty, empty)
    dense = sparse.to_dense_module()
    for shape in ((T, N, I), (T, 0, I), (1, N, I), (1, 1, I)):
        x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
        output, (h, c) = sparse(x)
        expected, (expected_h, expected_c) = dense(x)
        torch.testing.assert_close(output, expected)
        torch.testing.assert_close(h, expected_h)
        (output.sum() + c.sum()).backward()
        assert sparse.hh_l1.values.grad.shape == (0,) and sparse.hh_l0.values.grad.shape == (sparse.hh_l0.nnz,)
        sparse.zero_grad()


def test_dropout_acts_between_layers_in_training_only():
    torch.manual_seed(5)
    with pytest.warns(UserWarning, match="dropout is applied between recurrent layers"):
        SparseGRU(I, H, dropout=0.5)
    sparse = SparseLSTM(I, H, num_layers=2, dropout=0.5, sparsity=0.5, dtype=torch.float64)
    dense = sparse.to_dense_module()
    assert dense.dropout == 0.5
    x = torch.randn(T, N, I, dtype=torch.float64)
    sparse.eval()
    dense.eval()
    torch.testing.assert_close(sparse(x)[0], dense(x)[0])
    sparse.train()
    first, second = sparse(x)[0], sparse(x)[0]
    assert not torch.allclose(first, second)  # fresh dropout masks each call
    no_dropout = copy.deepcopy(sparse)
    no_dropout.dropout = 0.0
    assert not torch.allclose(first, no_dropout(x)[0])


def test_init_keeps_the_dense_modules_gate_variance_at_any_sparsity():
    """``nn.LSTM``'s ``U(-1/√H, 1/√H)`` weights give a gate's input product the variance
    ``in / (3H)`` per unit input variance; the sparse layers keep it."""
    torch.manual_seed(6)
    lstm = SparseLSTM(256, 128, num_layers=2, sparsity=0.95)
    for name, layer in lstm.sparse_layers().items():
        fan_in = layer.nnz / layer.out_features
        expected = layer.in_features / (3 * 128)
        assert layer.values.var().item() * fan_in == pytest.approx(expected, rel=0.1), name
        assert layer.bias.abs().max() <= 1 / 128**0.5
    x = torch.randn(64, 256)
    assert lstm.ih_l0(x).var().item() == pytest.approx(256 / (3 * 128), rel=0.15)


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="hidden_size must be a positive int, got 0"):
        SparseLSTM(4, 0)
    with pytest.raises(ValueError, match="num_layers must be a positive int, got 1.5"):
        SparseGRU(4, 4, 1.5)
    with pytest.raises(TypeError, match="unexpected keyword argument 'proj_size'"):  # an LSTM's option only
        SparseGRU(4, 4, proj_size=2)
    with pytest.raises(ValueError, match=r"proj_size must be smaller than hidden_size \(4\), got 4"):
        SparseLSTM(4, 4, proj_size=4)
    with pytest.raises(ValueError, match="nonlinearity must be 'tanh' or 'relu', got 'gelu'"):
        SparseRNN(4, 4, nonlinearity="gelu")
    with pytest.raises(ValueError, match=r"dropout must be a probability in \[0, 1\], got 2"):
        SparseLSTM(4, 4, 2, dropout=2)
    with pytest.raises(ValueError, match=r"sparsity"):
        SparseLSTM(4, 4, sparsity=1.0)
    lstm = SparseLSTM(I, H, batch_first=True)
    before = {name: tensor.clone() for name, tensor in lstm.state_dict().items()}
    with pytest.raises(ValueError, match=r"input must have shape \(N, T, input_size\) or \(T, input_size\), got \(3, 5, 5\)"):
        lstm(torch.randn(3, 5, 5))
    with pytest.raises(TypeError, match="input must be a Tensor or a PackedSequence, got list"):
        lstm([1.0])
    with pytest.raises(ValueError, match="sequence length must be at least 1, got 0"):
        lstm(torch.randn(3, 0, I))
    x = torch.randn(N, T, I)
    with pytest.raises(TypeError, match=r"hx must be a tuple \(h_0, c_0\) or None, got Tensor"):
        lstm(x, torch.zeros(1, N, H))
    with pytest.raises(ValueError, match=r"c_0 must have shape \(1, 3, 6\), got \(1, 2, 6\)"):
        lstm(x, (torch.zeros(1, N, H), torch.zeros(1, 2, H)))
    with pytest.raises(ValueError, match="h_0 must be torch.float32 on cpu as the input is, got torch.float64"):
        lstm(x, (torch.zeros(1, N, H, dtype=torch.float64), torch.zeros(1, N, H)))
    with pytest.raises(TypeError, match="h_0 must be a Tensor, got tuple"):
        SparseGRU(I, H)(torch.randn(T, N, I), (torch.zeros(1, N, H),))
    with pytest.raises(AttributeError, match=r"no dense weight_hh_l0: .* held by hh_l0 here: hh_l0.values"):
        lstm.weight_hh_l0
    with pytest.raises(AttributeError, match=r"no dense bias_ih_l0: .* \(bias_ih_l0: ih_l0.bias\)"):
        lstm.bias_ih_l0
    with pytest.raises(AttributeError, match="has no attribute 'weight_ih_l7'"):  # no such layer: the plain error
        lstm.weight_ih_l7
    with pytest.raises(TypeError, match="rnn must be an LSTM, got GRU"):
        SparseLSTM.from_dense(nn.GRU(I, H))
    with pytest.raises(ValueError, match="a mapping must name exactly"):
        SparseLSTM.from_dense(nn.LSTM(I, H), sparsity={"ih_l0": 0.5})
    assert all(torch.equal(tensor, before[name]) for name, tensor in lstm.state_dict().items())


def test_from_dense_keeps_each_matrixs_largest_weights_and_the_flags():
    torch.manual_seed(7)
    dense = nn.LSTM(I, H, proj_size=2, bidirectional=True).eval()
    dense.weight_hh_l0.requires_grad_(False)
    sparse = SparseLSTM.from_dense(dense, sparsity={name: 0.5 if name.startswith("hh") else None
                                                    for name in SparseLSTM.dense_weights(dense)})  # fmt: skip
    assert not sparse.training and not sparse.hh_l0.values.requires_grad and sparse.ih_l0.values.requires_grad
    assert sparse.ih_l0.nnz == 4 * H * I and sparse.hh_l0.nnz == 4 * H * 2 // 2
    kept = dense.weight_hh_l0.detach()[sparse.hh_l0.row.long(), sparse.hh_l0.col.long()].abs()
    assert kept.min() >= dense.weight_hh_l0.detach().abs().median()
    back = sparse.to_dense_module()
    assert not back.weight_hh_l0.requires_grad and back.weight_ih_l0.requires_grad and not back.training
    torch.testing.assert_close(back.weight_ih_l0, dense.weight_ih_l0)
    torch.testing.assert_close(back.weight_hr_l0_reverse, dense.weight_hr_l0_reverse)


def test_no_gate_sized_dense_tensor_in_a_training_step():
    """Truly sparse: a 512-wide LSTM's training step builds no (4·512, 512) tensor, nor a quarter
    of one (the activations here are far smaller)."""
    with LargestTensorMode() as mode:
        lstm = SparseLSTM(512, 512, num_layers=2, sparsity=0.95)
        x = torch.randn(4, 2, 512, requires_grad=True)
        output, (h, c) = lstm(x)
        (output.square().sum() + c.sum()).backward()
        torch.optim.Adam(lstm.parameters()).step()
    assert lstm.hh_l1.values.grad is not None and x.grad is not None
    assert mode.largest < 512 * 512 // 4, f"{mode.largest_op} produced {mode.largest} elements"


# --------------------------------------------------------------------- conversions


class _Tagger(nn.Module):
    """Embedding → recurrent layer → classifier per step."""

    def __init__(self, recurrent: nn.Module):
        super().__init__()
        self.embedding = nn.Embedding(20, I)
        self.recurrent = recurrent
        width = recurrent.hidden_size * (2 if recurrent.bidirectional else 1)
        self.head = nn.Linear(width, 3)

    def forward(self, ids):
        return self.head(self.recurrent(self.embedding(ids))[0])


@pytest.mark.parametrize("recurrent", [lambda: nn.LSTM(I, H, 2, batch_first=True),
                                       lambda: nn.GRU(I, H, bidirectional=True, batch_first=True),
                                       lambda: nn.RNN(I, H, nonlinearity="relu", batch_first=True)])  # fmt: skip
def test_sparsify_and_densify_convert_the_recurrent_layers(recurrent):
    torch.manual_seed(8)
    model = _Tagger(recurrent()).double()
    ids = torch.randint(0, 20, (N, T))
    expected = model(ids)
    dense_class = type(model.recurrent)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left dense to warn about
        snack.sparsify(model, sparsity=0.0)
    assert isinstance(model.recurrent, snack.nn.convert.SPARSE_COMPOSITES[dense_class])
    torch.testing.assert_close(model(ids), expected)
    snack.sparsify(model := _Tagger(recurrent()).double(), sparsity=0.8)
    logits = model(ids)
    back = snack.densify(model)
    assert type(back.recurrent) is dense_class and type(back.head) is nn.Linear
    torch.testing.assert_close(back(ids), logits)


def test_sparsify_counts_each_matrix_as_a_layer_for_the_distribution():
    model = nn.Sequential(nn.LSTM(16, 64, 2, proj_size=8))
    snack.sparsify(model, sparsity=0.9, distribution="erk")
    layers = model[0].sparse_layers()
    shapes = {f"0.{name}": (layer.out_features, layer.in_features) for name, layer in layers.items()}
    assert set(shapes) == {"0.ih_l0", "0.hh_l0", "0.hr_l0", "0.ih_l1", "0.hh_l1", "0.hr_l1"}
    expected = snack.distributions.layer_sparsities(shapes, 0.9, "erk")
    assert {f"0.{name}": layer.sparsity for name, layer in layers.items()} == pytest.approx(expected, abs=2e-3)
    assert expected["0.hr_l0"] < expected["0.ih_l1"]  # ERK: the smaller matrix stays denser


def test_sparsify_leaves_subclassed_tied_and_excluded_recurrent_layers_dense():
    class LSTM(nn.LSTM):
        pass

    model = nn.Sequential(LSTM(I, H), nn.Linear(H, H))
    with pytest.warns(UserWarning, match=r"subclass\(es\) of nn.Linear, nn.MultiheadAttention, nn.LSTM, nn.GRU or "
                                         r"nn.RNN dense: 0 \(LSTM"):  # fmt: skip
        snack.sparsify(model, 0.5)
    assert type(model[0]) is LSTM and isinstance(model[1], SparseLinear)
    tied = nn.Sequential(nn.GRU(H, H), nn.GRU(H, H))
    tied[1].weight_hh_l0 = tied[0].weight_hh_l0
    with pytest.warns(UserWarning) as caught:
        snack.sparsify(tied, 0.5)
    assert "tied to another module's: 0 (with 1), 1 (with 0)" in str(caught[0].message)
    assert [str(w.message)[:30] for w in caught][1:] == ["sparsify converted no layer: t"]
    assert all(type(m) is nn.GRU for m in tied)
    model = nn.Sequential(nn.RNN(I, H), nn.Linear(H, H))
    snack.sparsify(model, 0.5, exclude="0")
    assert type(model[0]) is nn.RNN


def test_a_meta_model_sparsified_at_random_materialises_and_trains():
    with torch.device("meta"):
        model = _Tagger(nn.LSTM(I, H, 2, batch_first=True))
    with pytest.raises(NotImplementedError, match="are on the meta device"):
        snack.sparsify(model, 0.8)
    snack.sparsify(model, 0.8, init="random")
    materialise_and_check_one_step(model, torch.randint(0, 20, (N, T)), lr=0.1)
    layer = model.recurrent.hh_l1
    assert layer.row.device.type == "cpu" and layer.nnz == round(0.2 * 4 * H * H)


def test_state_dict_deepcopy_and_pickle_carry_the_topologies():
    torch.manual_seed(9)
    lstm = SparseLSTM(I, H, 2, bidirectional=True, proj_size=2, sparsity=0.7)
    other = SparseLSTM(I, H, 2, bidirectional=True, proj_size=2, sparsity=0.3)  # other nnz everywhere
    other.load_state_dict(lstm.state_dict())
    x = torch.randn(T, N, I)
    expected = lstm(x)[0]
    for copied in (other, copy.deepcopy(lstm), pickle.loads(pickle.dumps(lstm))):
        assert copied.hh_l1_reverse.nnz == lstm.hh_l1_reverse.nnz
        torch.testing.assert_close(copied(x)[0], expected)
    lstm.flatten_parameters()  # what code written for nn.LSTM calls: nothing to do
    assert "proj_size=2, num_layers=2, bidirectional=True" in repr(lstm)


# --------------------------------------------------------------------- dynamic sparse training


def test_rigl_records_every_step_and_their_sum_is_the_weight_gradient():
    """The hidden-to-hidden layer runs once per step: its records, joined, give ``dYᵀ·X`` equal to
    the dense module's weight gradient at every position, and RigL grows its top inactive ones."""
    torch.manual_seed(10)
    sparse, dense = _pair(SparseLSTM, dict(num_layers=2, bidirectional=True))
    layers = [sparse.hh_l0, sparse.hh_l1_reverse, sparse.ih_l1]
    capture = GradientCapture(layers)
    capture.arm()
    x = torch.randn(T, N, I, dtype=torch.float64)
    lengths = torch.tensor([T, 2, 4])
    output, state = sparse(pack_padded_sequence(x, lengths, enforce_sorted=False))
    _loss(output, state).backward()
    expected_output, expected_state = dense(pack_padded_sequence(x, lengths, enforce_sorted=False))
    _loss(expected_output, expected_state).backward()
    for index, (name, weight) in enumerate((("hh_l0", dense.weight_hh_l0), ("hh_l1_reverse", dense.weight_hh_l1_reverse),
                                            ("ih_l1", dense.weight_ih_l1))):  # fmt: skip
        x_kept, dy = capture.batch(index)
        assert x_kept.shape[0] == int(lengths.sum()), name  # one row per sequence and step it ran
        torch.testing.assert_close(dy.T @ x_kept, weight.grad, msg=name)
        layer = layers[index]
        inactive = weight.grad.abs().flatten()
        inactive[snack.dst.prune_grow.linear_index(layer.topology)] = -1
        grown = snack.dst.gradient_grow(x_kept, dy, layer.topology, 5)
        assert torch.equal(grown, inactive.topk(5).indices.sort().values), name
    capture.disarm()


@pytest.mark.parametrize("algorithm", ["RigL", "SET"])
def test_dst_rewires_every_matrix_and_the_model_learns(algorithm):
    torch.manual_seed(11)
    model = snack.sparsify(_Tagger(nn.LSTM(I, 16, 2, batch_first=True)), 0.7, init="random")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    dst = getattr(snack.dst, algorithm)(model, optimizer, update_every=5, total_steps=60)
    ids = torch.randint(0, 20, (8, T))
    target = ids % 3  # each token's class
    before = {name: layer.indices().clone() for name, layer in model.recurrent.sparse_layers().items()}
    losses = []
    for _ in range(60):
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), target.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        dst.step()
        losses.append(loss.item())
    for name, layer in model.recurrent.sparse_layers().items():
        assert layer.nnz == before[name].shape[1] and not torch.equal(layer.indices(), before[name]), name
    assert losses[-1] < 0.3 * losses[0]


def test_a_compiled_lstm_computes_what_the_eager_one_does():
    torch.manual_seed(12)
    lstm = SparseLSTM(I, H, bidirectional=True, proj_size=2, sparsity=0.5)
    compiled = torch.compile(lstm, fullgraph=True, backend="aot_eager")
    x = torch.randn(3, N, I, requires_grad=True)
    got, (h, c) = compiled(x)
    expected, (expected_h, expected_c) = lstm(x)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(c, expected_c)
    (grad,) = torch.autograd.grad(got.sum() + c.sum(), x)
    torch.testing.assert_close(grad, torch.autograd.grad(expected.sum() + expected_c.sum(), x)[0])


@pytest.mark.parametrize("cls", [SparseGRU, SparseLSTM])
def test_autocast_computes_the_products_in_bfloat16_and_carries_the_state_in_float32(cls):
    torch.manual_seed(13)
    sparse = cls(I, H, sparsity=0.5)
    x = torch.randn(T, N, I)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output, _ = sparse(x)
        gates = sparse.ih_l0(x)
    assert gates.dtype == torch.bfloat16 and output.dtype == torch.float32
    expected = sparse(x)[0]
    torch.testing.assert_close(output, expected, atol=0.05, rtol=0.05)
    assert not torch.allclose(output, expected, atol=1e-5, rtol=0)  # bfloat16's rounding, not float32 math
    output.sum().backward()
    assert sparse.hh_l0.values.grad.dtype == torch.float32


def test_programs_made_by_export_trace_and_fx_compute_what_the_module_does():
    """Export (a dynamic batch; the steps unrolled, as for ``nn.LSTM``'s decomposition), a trace,
    and FX, which records the layer as one call, as it records ``nn.LSTM``, computing with its
    connections of the moment (after a rewire too)."""
    torch.manual_seed(14)
    model = _Tagger(SparseLSTM(I, H, 2, batch_first=True, sparsity=0.5)).eval()
    ids, other = torch.randint(0, 20, (N, T)), torch.randint(0, 20, (N + 2, T))
    exported, graph = export_trace_and_fx(model, ids, {0: torch.export.Dim("batch")})
    torch.testing.assert_close(exported(other), model(other))
    layer, rewired = model.recurrent.hh_l1, SparseLinear(H, 4 * H, sparsity=0.3)
    layer.set_topology(rewired.row, rewired.col, rewired.values.detach())
    torch.testing.assert_close(graph(ids), model(ids))
    with pytest.raises(NotImplementedError, match="symbolic_trace of a SparseLSTM itself"):
        torch.fx.symbolic_trace(model.recurrent)


def test_per_sample_gradients_with_torch_func():
    torch.manual_seed(15)
    model = _Tagger(SparseGRU(I, H, 2, batch_first=True, sparsity=0.5))
    ids = torch.randint(0, 20, (N, T))
    parameters = {name: p.detach() for name, p in model.named_parameters()}

    def loss(parameters, sample):
        return torch.func.functional_call(model, parameters, (sample[None],)).square().sum()

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(parameters, ids)
    for i in range(N):
        model.zero_grad()
        loss(dict(model.named_parameters()), ids[i]).backward()
        for name in ("recurrent.hh_l1.values", "recurrent.ih_l0.values", "recurrent.hh_l0.bias"):
            torch.testing.assert_close(per_sample[name][i], dict(model.named_parameters())[name].grad)
