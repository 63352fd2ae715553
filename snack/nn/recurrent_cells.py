"""The elementwise part of one step of :class:`snack.SparseLSTM` and :class:`snack.SparseGRU`.

A step's sparse products run through :class:`snack.SparseLinear`; what remains is elementwise:

* :func:`lstm_cell` ``pre (N, 4H)``, ``c (N, H)`` → ``(h (N, H), c_new (N, H))``, gates in
  ``nn.LSTM``'s order (input, forget, cell, output): ``c_new = σ(f)·c + σ(i)·tanh(g)``,
  ``h = σ(o)·tanh(c_new)``;
* :func:`gru_cell` ``gx (N, 3H)``, ``gh (N, 3H)``, ``h (N, H)`` → ``h_new (N, H)``, gates in
  ``nn.GRU``'s order (reset, update, new): ``n = tanh(gx_n + r·gh_n)``, ``h_new = n + z·(h − n)``.

Written as torch calls (:func:`lstm_cell_reference`, :func:`gru_cell_reference`) a step is about a
dozen elementwise ops forward and as many backward, each an autograd node: at ``N = 32``,
``H = 256`` about 40% of a ``SparseLSTM`` training step on this project's CPU (a profile). On CPU
tensors of float32 or float64 the native kernels (``snack/backends/cpu/recurrent_kernels.cpp``)
compute each direction in one pass, as one autograd node whose backward recomputes the gates from
what the forward took (less to keep than the gates themselves; ``benchmarks/recurrent_cells.py``).
Everywhere else (other devices and dtypes, autocast's mixed dtypes, ``torch.compile``,
``torch.jit.trace``, ``torch.func`` transforms, ``use_backend("reference")``) the torch calls
run, as they did before the kernels.

Gradients of gradients (``create_graph=True``) work on both paths: there the node's backward
is the torch formulas of :func:`lstm_cell_grads` and :func:`gru_cell_grads`, which autograd
differentiates again.
"""

from __future__ import annotations

import torch
from torch import Tensor

from snack.func import transforms_active
from snack.indexing import native_for

__all__ = ["gru_cell", "gru_cell_grads", "gru_cell_reference", "lstm_cell", "lstm_cell_grads", "lstm_cell_reference"]

_KERNEL_DTYPES = (torch.float32, torch.float64)


def _native(*tensors: Tensor) -> bool:
    """Whether the native kernels run a cell of ``tensors``: eager code, one float32 or float64
    dtype, CPU tensors with the native backend loaded and not overridden (:func:`native_for`)."""
    dtype = tensors[0].dtype
    if dtype not in _KERNEL_DTYPES or any(t.dtype != dtype for t in tensors):
        return False
    if torch._C._get_tracing_state() is not None or transforms_active():
        return False
    return native_for(*tensors)


def _needs_graph(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


# ---------------------------------------------------------------- LSTM


def lstm_cell_reference(pre: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`lstm_cell` as torch calls: ``pre (N, 4H)``, ``c (N, H)`` → ``(h, c_new)``, each ``(N, H)``."""
    i, f, g, o = pre.chunk(4, dim=1)
    c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c_new), c_new


def lstm_cell_grads(
    dh: Tensor | None, dc_new: Tensor | None, pre: Tensor, c: Tensor, c_new: Tensor
) -> tuple[Tensor, Tensor]:
    """``(dpre (N, 4H), dc (N, H))`` of :func:`lstm_cell` for the outputs' gradients ``dh`` and
    ``dc_new`` (``(N, H)``; ``None`` counts as zeros), in torch calls (differentiable)."""
    i, f, g, o = pre.chunk(4, dim=1)
    i, f, g, o = torch.sigmoid(i), torch.sigmoid(f), torch.tanh(g), torch.sigmoid(o)
    tanh_cell = torch.tanh(c_new)
    dh = torch.zeros_like(c) if dh is None else dh
    # the cell's gradient: from c_new directly and through h = o·tanh(c_new)
    dcell = dh * o * (1 - tanh_cell * tanh_cell)
    if dc_new is not None:
        dcell = dcell + dc_new
    dpre = torch.cat([dcell * g * i * (1 - i), dcell * c * f * (1 - f), dcell * i * (1 - g * g),
                      dh * tanh_cell * o * (1 - o)], dim=1)  # fmt: skip
    return dpre, dcell * f


class _LSTMCell(torch.autograd.Function):
    """:func:`lstm_cell` on the native kernels, as one autograd node."""

    @staticmethod
    def forward(ctx, pre: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
        h, c_new = torch.ops.snack_cpu.lstm_cell(pre, c)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zeros to allocate
        ctx.save_for_backward(pre, c, c_new)
        return h, c_new

    @staticmethod
    def backward(ctx, dh: Tensor | None, dc_new: Tensor | None) -> tuple[Tensor, Tensor]:
        pre, c, c_new = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: formulas autograd can differentiate
            return lstm_cell_grads(dh, dc_new, pre, c, c_new)
        return torch.ops.snack_cpu.lstm_cell_backward(dh, dc_new, pre, c, c_new)


def lstm_cell(pre: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """One LSTM step's elementwise part: ``pre (N, 4H)`` (both products and biases, gates
    ``i, f, g, o``), ``c (N, H)`` → ``(h (N, H), c_new (N, H))``; see the module docstring."""
    if not _native(pre, c):
        return lstm_cell_reference(pre, c)
    if _needs_graph(pre, c):
        return _LSTMCell.apply(pre, c)
    return torch.ops.snack_cpu.lstm_cell(pre, c)


# ---------------------------------------------------------------- GRU


def gru_cell_reference(gx: Tensor, gh: Tensor, h: Tensor) -> Tensor:
    """:func:`gru_cell` as torch calls: ``gx (N, 3H)``, ``gh (N, 3H)``, ``h (N, H)`` → ``(N, H)``."""
    x_r, x_z, x_n = gx.chunk(3, dim=1)
    h_r, h_z, h_n = gh.chunk(3, dim=1)
    r, z = torch.sigmoid(x_r + h_r), torch.sigmoid(x_z + h_z)
    n = torch.tanh(x_n + r * h_n)
    return n + z * (h - n)  # (1 − z)·n + z·h


def gru_cell_grads(dh_new: Tensor, gx: Tensor, gh: Tensor, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(dgx (N, 3H), dgh (N, 3H), dh (N, H))`` of :func:`gru_cell` for the output's gradient
    ``dh_new (N, H)``, in torch calls (differentiable)."""
    x_r, x_z, x_n = gx.chunk(3, dim=1)
    h_r, h_z, h_n = gh.chunk(3, dim=1)
    r, z = torch.sigmoid(x_r + h_r), torch.sigmoid(x_z + h_z)
    n = torch.tanh(x_n + r * h_n)
    dn = dh_new * (1 - z) * (1 - n * n)  # before its tanh
    dr = dn * h_n * r * (1 - r)  # before its sigmoid
    dz = dh_new * (h - n) * z * (1 - z)
    return torch.cat([dr, dz, dn], dim=1), torch.cat([dr, dz, dn * r], dim=1), dh_new * z


class _GRUCell(torch.autograd.Function):
    """:func:`gru_cell` on the native kernels, as one autograd node."""

    @staticmethod
    def forward(ctx, gx: Tensor, gh: Tensor, h: Tensor) -> Tensor:
        ctx.save_for_backward(gx, gh, h)
        return torch.ops.snack_cpu.gru_cell(gx, gh, h)

    @staticmethod
    def backward(ctx, dh_new: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        gx, gh, h = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: formulas autograd can differentiate
            return gru_cell_grads(dh_new, gx, gh, h)
        return torch.ops.snack_cpu.gru_cell_backward(dh_new, gx, gh, h)


def gru_cell(gx: Tensor, gh: Tensor, h: Tensor) -> Tensor:
    """One GRU step's elementwise part: ``gx (N, 3H)`` (the input product and ``b_ih``), ``gh
    (N, 3H)`` (the hidden product and ``b_hh``), ``h (N, H)`` → ``h_new (N, H)``; see the module
    docstring."""
    if not _native(gx, gh, h):
        return gru_cell_reference(gx, gh, h)
    if _needs_graph(gx, gh, h):
        return _GRUCell.apply(gx, gh, h)
    return torch.ops.snack_cpu.gru_cell(gx, gh, h)
