"""The recurrent steps' elementwise cells (:mod:`snack.nn.recurrent_cells`): the native kernels
against the torch calls they replace (forward, each backward, float64 gradcheck and gradgradcheck),
on batch 1, an empty batch, no hidden units, widths that are not a multiple of the vector width,
saturated gates; where each path runs; the kernels' argument errors; and whole SparseLSTM /
SparseGRU steps computed by the kernels against the same steps by the torch calls.
"""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck
from torch.nn.utils.rnn import pack_padded_sequence

import snack
from snack.backends.cpu import native  # noqa: F401  importing it builds the kernels; a failed build fails here
from snack.nn import recurrent_cells as cells

# (N, H): a step's batch and hidden size; 17 and 300 are not multiples of the vector width (16
# float32 on AVX-512), 64 x 300 is several parallel chunks
SHAPES = [(32, 256), (3, 5), (1, 17), (1, 1), (64, 300), (0, 4), (4, 0)]
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-6}, torch.float64: {"rtol": 1e-12, "atol": 1e-12}}


def _lstm_inputs(n, h, dtype, scale=3.0, *, requires_grad=False):
    torch.manual_seed(n * 1000 + h)
    pre = (torch.randn(n, 4 * h, dtype=dtype) * scale).requires_grad_(requires_grad)
    c = torch.randn(n, h, dtype=dtype).requires_grad_(requires_grad)
    return pre, c


def _gru_inputs(n, h, dtype, scale=3.0, *, requires_grad=False):
    torch.manual_seed(n * 1000 + h + 1)
    return tuple(
        (torch.randn(n, width, dtype=dtype) * scale).requires_grad_(requires_grad) for width in (3 * h, 3 * h, h)
    )


def _grads(outputs, inputs, grad_outputs):
    """Autograd's gradients of ``inputs``, ``None`` grad_outputs left out (as unused outputs)."""
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if g is not None]
    return torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n, h", SHAPES)
@pytest.mark.parametrize("given", ["both", "dh", "dc_new"])
def test_lstm_kernels_compute_what_the_torch_calls_do(n, h, dtype, given):
    pre, c = _lstm_inputs(n, h, dtype, requires_grad=True)
    h_ref, c_ref = cells.lstm_cell_reference(pre, c)
    h_new, c_new = torch.ops.snack_cpu.lstm_cell(pre.detach(), c.detach())
    torch.testing.assert_close(h_new, h_ref, **TOLERANCE[dtype])
    torch.testing.assert_close(c_new, c_ref, **TOLERANCE[dtype])

    dh = torch.randn_like(h_ref) if given != "dc_new" else None
    dc = torch.randn_like(c_ref) if given != "dh" else None
    expected = _grads((h_ref, c_ref), (pre, c), (dh, dc))
    kernel = torch.ops.snack_cpu.lstm_cell_backward(dh, dc, pre.detach(), c.detach(), c_new)
    formulas = cells.lstm_cell_grads(dh, dc, pre.detach(), c.detach(), c_new)
    for got, got_by_formula, want in zip(kernel, formulas, expected):
        torch.testing.assert_close(got, want, **TOLERANCE[dtype])
        torch.testing.assert_close(got_by_formula, want, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n, h", SHAPES)
def test_gru_kernels_compute_what_the_torch_calls_do(n, h, dtype):
    gx, gh, state = _gru_inputs(n, h, dtype, requires_grad=True)
    expected_h = cells.gru_cell_reference(gx, gh, state)
    h_new = torch.ops.snack_cpu.gru_cell(gx.detach(), gh.detach(), state.detach())
    torch.testing.assert_close(h_new, expected_h, **TOLERANCE[dtype])

    grad = torch.randn_like(expected_h)
    expected = torch.autograd.grad(expected_h, (gx, gh, state), grad)
    kernel = torch.ops.snack_cpu.gru_cell_backward(grad, gx.detach(), gh.detach(), state.detach())
    formulas = cells.gru_cell_grads(grad, gx.detach(), gh.detach(), state.detach())
    for got, got_by_formula, want in zip(kernel, formulas, expected):
        torch.testing.assert_close(got, want, **TOLERANCE[dtype])
        torch.testing.assert_close(got_by_formula, want, **TOLERANCE[dtype])


@pytest.mark.parametrize("scale", [30.0, 1e4])
def test_saturated_gates_give_no_nan_and_the_torch_calls_values(scale):
    """σ and tanh at ±30 and ±10⁴ (exp overflows to inf there): finite outputs and gradients,
    as the torch calls give."""
    pre, c = _lstm_inputs(8, 40, torch.float32, scale, requires_grad=True)
    h_ref, c_ref = cells.lstm_cell_reference(pre, c)
    dh, dc = torch.randn_like(h_ref), torch.randn_like(c_ref)
    expected = _grads((h_ref, c_ref), (pre, c), (dh, dc))
    h_new, c_new = torch.ops.snack_cpu.lstm_cell(pre.detach(), c.detach())
    dpre, dc_prev = torch.ops.snack_cpu.lstm_cell_backward(dh, dc, pre.detach(), c.detach(), c_new)
    for got, want in zip((h_new, c_new, dpre, dc_prev), (h_ref, c_ref, *expected)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])

    gx, gh, state = _gru_inputs(8, 40, torch.float32, scale)
    got = torch.ops.snack_cpu.gru_cell(gx, gh, state)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, cells.gru_cell_reference(gx, gh, state), **TOLERANCE[torch.float32])


@pytest.mark.parametrize("n, h", [(3, 5), (1, 2), (0, 3)])
def test_gradcheck_and_gradgradcheck_of_both_cells_in_float64(n, h):
    lstm_inputs = _lstm_inputs(n, h, torch.float64, 1.5, requires_grad=True)
    gru_inputs = _gru_inputs(n, h, torch.float64, 1.5, requires_grad=True)
    for cell, inputs, node in ((cells.lstm_cell, lstm_inputs, "_LSTMCellBackward"),
                               (cells.gru_cell, gru_inputs, "_GRUCellBackward")):  # fmt: skip
        assert _name(cell(*inputs)) == node  # the kernels' node is what is checked
        assert gradcheck(cell, inputs)
        assert gradgradcheck(cell, inputs)  # the backward's own graph: the torch formulas


def _name(output) -> str:
    """The name of the node that made ``output`` (a cell's first output, for the LSTM's pair)."""
    return type((output[0] if isinstance(output, tuple) else output).grad_fn).__name__


def test_the_native_kernels_run_for_eager_cpu_float_cells_only():
    pre, c = _lstm_inputs(4, 8, torch.float32, requires_grad=True)
    gx, gh, h = _gru_inputs(4, 8, torch.float32, requires_grad=True)
    assert _name(cells.lstm_cell(pre, c)) == "_LSTMCellBackward"
    assert _name(cells.gru_cell(gx, gh, h)) == "_GRUCellBackward"

    # no autograd: the kernel's output, no graph
    with torch.no_grad():
        h_new, c_new = cells.lstm_cell(pre, c)
    assert h_new.grad_fn is None and not h_new.requires_grad
    torch.testing.assert_close(h_new, cells.lstm_cell_reference(pre, c)[0].detach(), **TOLERANCE[torch.float32])

    # the torch calls: another dtype, mixed dtypes (autocast's bfloat16 gates, float32 state), a
    # forced backend other than the CPU's
    assert _name(cells.lstm_cell(pre.bfloat16(), c.bfloat16())) == "MulBackward0"
    assert _name(cells.lstm_cell(pre.bfloat16(), c)) == "MulBackward0"
    assert _name(cells.gru_cell(gx.half(), gh.half(), h.half())) == "AddBackward0"
    with snack.use_backend("reference"):
        assert _name(cells.lstm_cell(pre, c)) == "MulBackward0"
        assert _name(cells.gru_cell(gx, gh, h)) == "AddBackward0"
    with snack.use_backend("cpu"):
        assert _name(cells.lstm_cell(pre, c)) == "_LSTMCellBackward"


def test_under_torch_func_and_jit_trace_the_torch_calls_run():
    pre, c = _lstm_inputs(3, 4, torch.float64)
    # vmap over a batch of cells, grad of a sum: both through the torch calls' own rules
    batched = torch.func.vmap(cells.lstm_cell)(pre.view(3, 1, 16), c.view(3, 1, 4))
    torch.testing.assert_close(batched[0].view(3, 4), cells.lstm_cell_reference(pre, c)[0])
    grad = torch.func.grad(lambda p: cells.lstm_cell(p, c)[0].sum())(pre)
    p = pre.clone().requires_grad_()
    torch.testing.assert_close(grad, torch.autograd.grad(cells.lstm_cell_reference(p, c)[0].sum(), p)[0])

    traced = torch.jit.trace(cells.gru_cell, _gru_inputs(3, 4, torch.float64))
    assert "snack_cpu" not in str(traced.graph)  # the trace records the torch calls
    inputs = _gru_inputs(5, 4, torch.float64)
    torch.testing.assert_close(traced(*inputs), cells.gru_cell_reference(*inputs))


def test_non_contiguous_inputs_compute_the_same():
    pre, c = _lstm_inputs(6, 10, torch.float32)
    pre_t = pre.t().contiguous().t()  # the same values, column-major
    c_t = c.t().contiguous().t()
    assert not pre_t.is_contiguous() and not c_t.is_contiguous()
    for got, want in zip(cells.lstm_cell(pre_t, c_t), cells.lstm_cell(pre, c)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_kernels_refuse_bad_arguments_clearly():
    pre, c = _lstm_inputs(4, 8, torch.float32)
    ops = torch.ops.snack_cpu
    with pytest.raises(RuntimeError, match=r"lstm_cell: the gates' width must be a multiple of 4, got 30"):
        ops.lstm_cell(pre[:, :30], c)
    with pytest.raises(RuntimeError, match=r"lstm_cell: c must have shape \(4, 8\), got \[3, 8\]"):
        ops.lstm_cell(pre, c[:3])
    with pytest.raises(RuntimeError, match=r"lstm_cell: c must be a CPU tensor of dtype Float, got Double"):
        ops.lstm_cell(pre, c.double())
    with pytest.raises(RuntimeError, match=r"lstm_cell: the gates must be float32 or float64, got BFloat16"):
        ops.lstm_cell(pre.bfloat16(), c.bfloat16())
    with pytest.raises(RuntimeError, match=r"lstm_cell: the gates must be a 2-D CPU tensor, got shape \[32\]"):
        ops.lstm_cell(pre.view(-1)[:32], c)
    with pytest.raises(RuntimeError, match=r"lstm_cell_backward: dh must have shape \(4, 8\), got \[4, 7\]"):
        ops.lstm_cell_backward(c[:, :7], None, pre, c, c)
    gx, gh, h = _gru_inputs(4, 8, torch.float32)
    with pytest.raises(RuntimeError, match=r"gru_cell: gh must have shape \(4, 24\), got \[4, 32\]"):
        ops.gru_cell(gx, pre, h)
    with pytest.raises(RuntimeError, match=r"gru_cell_backward: dh_new must have shape \(4, 8\), got \[2, 8\]"):
        ops.gru_cell_backward(h[:2], gx, gh, h)


def _step_results(module, x, packed):
    """``(outputs, state, every parameter's gradient, the input's)`` of one forward and backward
    of ``x (T, N, in)``, as three sequences of lengths 5, 3 and 1 when ``packed``."""
    module.zero_grad()
    x.grad = None
    output, state = module(_sequences(x, packed))
    output = output.data if packed else output
    states = state if isinstance(state, tuple) else (state,)
    loss = (output * torch.linspace(-1, 1, output.shape[-1])).sum() + sum((s * s).sum() for s in states)
    loss.backward()
    grads = [p.grad.clone() for p in module.parameters()]
    return output.detach(), [s.detach() for s in states], grads, x.grad.clone()


def _sequences(x, packed):
    return pack_padded_sequence(x, [5, 3, 1]) if packed else x  # (the later steps run on fewer rows)


@pytest.mark.parametrize(
    "make",
    [
        lambda: snack.SparseLSTM(6, 12, num_layers=2, sparsity=0.7),
        lambda: snack.SparseLSTM(6, 12, proj_size=5, bidirectional=True, sparsity=0.7),
        lambda: snack.SparseGRU(6, 12, num_layers=2, bidirectional=True, sparsity=0.7),
    ],
    ids=["lstm", "lstm-proj-bidirectional", "gru-bidirectional"],
)
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_recurrent_step_on_the_kernels_computes_what_the_torch_calls_do(make, packed, monkeypatch):
    torch.manual_seed(0)
    module = make()
    x = torch.randn(5, 3, 6, requires_grad=True)
    on_kernels = _step_results(module, x, packed)
    assert _ran_kernels(module, _sequences(x, packed))
    monkeypatch.setattr(cells, "_native", lambda *tensors: False)
    on_torch_calls = _step_results(module, x, packed)
    assert not _ran_kernels(module, _sequences(x, packed))
    for got, want in zip(_flat(on_kernels), _flat(on_torch_calls)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _ran_kernels(module, inputs) -> bool:
    """Whether ``module``'s forward recorded a native cell's node."""
    output, _ = module(inputs)
    output = output.data if hasattr(output, "batch_sizes") else output
    seen, stack = set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ in ("_LSTMCellBackward", "_GRUCellBackward"):
            return True
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


def _flat(results):
    output, states, grads, input_grad = results
    return [output, *states, *grads, input_grad]
