"""The three sparse ops as ``torch.library`` custom ops, with fake kernels and autograd.

For a sparse ``W`` (``out × in``, ``nnz`` non-zeros) given by ``values`` and a topology
(:class:`snack.topology.TopologyTensors`: ``row, col, rowptr, colptr, csc_perm``):

=================  ==================================================  ==========================
op                 math                                                shapes
=================  ==================================================  ==========================
``snack::spmm``    ``Y = X · Wᵀ``                                      ``x (B, in)`` → ``(B, out)``
``snack::spmm_t``  ``dX = dY · W``                                     ``dy (B, out)`` → ``(B, in)``
``snack::sddmm``   ``out[k] = Σ_b dY[b, row_k] · X[b, col_k]``         → ``(nnz,)``
=================  ==================================================  ==========================

``out`` and ``in`` are read off the pointer lengths (``rowptr``: ``out + 1``, ``colptr``:
``in + 1``), so the schemas carry no sizes. The backward of each op is written with the other
two, so gradients of any order stay sparse. The kernel registered for each device type asks
:func:`snack.backends.resolve` which backend runs (see :func:`snack.use_backend`).

A first-order backward of ``spmm`` that needs both gradients calls ``snack::spmm_backward``
instead, which runs the backend's optional ``spmm_backward(dy, x, values, topo) -> (dx, dvalues)``
(both in one pass over the weight) or, when the backend has none, its ``spmm_t`` and ``sddmm``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from snack import backends
from snack.topology import Topology, TopologyTensors

__all__ = ["sddmm", "sparse_linear", "spmm", "spmm_t"]


def _check(op: str, dense_a: Tensor, dense_b: Tensor, topo: TopologyTensors) -> None:
    """Shape/dtype/device checks shared by the real and fake kernels of every op."""
    out_features, in_features = topo.rowptr.numel() - 1, topo.colptr.numel() - 1
    nnz = topo.row.numel()
    names = {"spmm": ("x", "values"), "spmm_t": ("dy", "values"), "sddmm": ("dy", "x")}[op]
    expected_width = {"spmm": in_features, "spmm_t": out_features, "sddmm": out_features}[op]
    a_name, b_name = names
    if dense_a.dim() != 2 or dense_a.shape[1] != expected_width:
        raise ValueError(f"snack.{op}: {a_name} must have shape (B, {expected_width}), got {tuple(dense_a.shape)}")
    if op == "sddmm":
        if dense_b.dim() != 2 or dense_b.shape != (dense_a.shape[0], in_features):
            raise ValueError(
                f"snack.sddmm: x must have shape ({dense_a.shape[0]}, {in_features}), got {tuple(dense_b.shape)}"
            )
    elif dense_b.shape != (nnz,):
        raise ValueError(f"snack.{op}: values must have shape ({nnz},), got {tuple(dense_b.shape)}")
    if dense_a.dtype != dense_b.dtype:
        raise TypeError(f"snack.{op}: {a_name} and {b_name} must share a dtype, got {dense_a.dtype} and {dense_b.dtype}")
    if not dense_a.is_floating_point():
        raise TypeError(f"snack.{op}: {a_name} must be floating point, got {dense_a.dtype}")
    devices = {t.device for t in (dense_a, dense_b, *topo)}
    if len(devices) != 1:
        raise ValueError(f"snack.{op}: all tensors must be on one device, got {sorted(map(str, devices))}")


def _device_kernel(op_name: str):
    """The kernel of ``snack::<op_name>``: check the inputs, then run the backend that
    :func:`snack.backends.resolve` picks for the inputs' device."""

    def kernel(a: Tensor, b: Tensor, *topology: Tensor) -> Tensor:
        topo = TopologyTensors(*topology)
        _check(op_name, a, b, topo)
        backend = backends.resolve(a.device)
        return getattr(backend, op_name)(a.contiguous(), b.contiguous(), topo)

    return kernel


_spmm_kernel = _device_kernel("spmm")
_spmm_t_kernel = _device_kernel("spmm_t")
_sddmm_kernel = _device_kernel("sddmm")


@torch.library.custom_op("snack::spmm", mutates_args=())
def _spmm_op(
    x: Tensor, values: Tensor, row: Tensor, col: Tensor, rowptr: Tensor, colptr: Tensor, csc_perm: Tensor
) -> Tensor:
    return _spmm_kernel(x, values, row, col, rowptr, colptr, csc_perm)


@torch.library.custom_op("snack::spmm_t", mutates_args=())
def _spmm_t_op(
    dy: Tensor, values: Tensor, row: Tensor, col: Tensor, rowptr: Tensor, colptr: Tensor, csc_perm: Tensor
) -> Tensor:
    return _spmm_t_kernel(dy, values, row, col, rowptr, colptr, csc_perm)


@torch.library.custom_op("snack::sddmm", mutates_args=())
def _sddmm_op(dy: Tensor, x: Tensor, row: Tensor, col: Tensor, rowptr: Tensor, colptr: Tensor, csc_perm: Tensor) -> Tensor:
    return _sddmm_kernel(dy, x, row, col, rowptr, colptr, csc_perm)


@torch.library.custom_op("snack::spmm_backward", mutates_args=())
def _spmm_backward_op(
    dy: Tensor, x: Tensor, values: Tensor, row: Tensor, col: Tensor, rowptr: Tensor, colptr: Tensor, csc_perm: Tensor
) -> tuple[Tensor, Tensor]:
    topo = TopologyTensors(row, col, rowptr, colptr, csc_perm)
    _check("spmm_t", dy, values, topo)
    _check("sddmm", dy, x, topo)
    backend = backends.resolve(dy.device)
    dy, x, values = dy.contiguous(), x.contiguous(), values.contiguous()
    fused = getattr(backend, "spmm_backward", None)
    if fused is not None:
        return fused(dy, x, values, topo)
    return backend.spmm_t(dy, values, topo), backend.sddmm(dy, x, topo)


for _op, _kernel in ((_spmm_op, _spmm_kernel), (_spmm_t_op, _spmm_t_kernel), (_sddmm_op, _sddmm_kernel)):
    _op.register_kernel("cpu")(_kernel)
    _op.register_kernel("cuda")(_kernel)


# ---------------------------------------------------------------- fake (meta) kernels


@_spmm_op.register_fake
def _(x, values, row, col, rowptr, colptr, csc_perm):
    _check("spmm", x, values, TopologyTensors(row, col, rowptr, colptr, csc_perm))
    return x.new_empty(x.shape[0], rowptr.shape[0] - 1)


@_spmm_t_op.register_fake
def _(dy, values, row, col, rowptr, colptr, csc_perm):
    _check("spmm_t", dy, values, TopologyTensors(row, col, rowptr, colptr, csc_perm))
    return dy.new_empty(dy.shape[0], colptr.shape[0] - 1)


@_sddmm_op.register_fake
def _(dy, x, row, col, rowptr, colptr, csc_perm):
    _check("sddmm", dy, x, TopologyTensors(row, col, rowptr, colptr, csc_perm))
    return dy.new_empty(row.shape[0])


@_spmm_backward_op.register_fake
def _(dy, x, values, row, col, rowptr, colptr, csc_perm):
    topo = TopologyTensors(row, col, rowptr, colptr, csc_perm)
    _check("spmm_t", dy, values, topo)
    _check("sddmm", dy, x, topo)
    return dy.new_empty(dy.shape[0], colptr.shape[0] - 1), dy.new_empty(row.shape[0])


# ---------------------------------------------------------------- autograd
# Each op saves only what the requested gradients need, and its backward calls the other ops.

_NO_TOPOLOGY_GRADS = (None,) * 5


def _setup(ctx, inputs, output):
    a, b, *topo = inputs
    needs_a, needs_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    # grad of a needs b (and vice versa) for all three ops
    ctx.save_for_backward(a if needs_b else None, b if needs_a else None, *topo)
    ctx.a_cols = a.shape[1]


def _spmm_backward(ctx, grad):
    x, values, *topo = ctx.saved_tensors
    if ctx.needs_input_grad[0] and ctx.needs_input_grad[1] and not torch.is_grad_enabled():
        # a training step's backward (no graph of the gradients wanted): both in one pass
        dx, dvalues = torch.ops.snack.spmm_backward(grad, x, values, *topo)
        return (dx, dvalues, *_NO_TOPOLOGY_GRADS)
    dx = torch.ops.snack.spmm_t(grad, values, *topo) if ctx.needs_input_grad[0] else None
    dvalues = torch.ops.snack.sddmm(grad, x, *topo) if ctx.needs_input_grad[1] else None
    return (dx, dvalues, *_NO_TOPOLOGY_GRADS)


def _spmm_t_backward(ctx, grad):
    dy, values, *topo = ctx.saved_tensors
    ddy = torch.ops.snack.spmm(grad, values, *topo) if ctx.needs_input_grad[0] else None
    dvalues = torch.ops.snack.sddmm(dy, grad, *topo) if ctx.needs_input_grad[1] else None
    return (ddy, dvalues, *_NO_TOPOLOGY_GRADS)


def _sddmm_backward(ctx, grad):
    dy, x, *topo = ctx.saved_tensors
    ddy = torch.ops.snack.spmm(x, grad, *topo) if ctx.needs_input_grad[0] else None
    dx = torch.ops.snack.spmm_t(dy, grad, *topo) if ctx.needs_input_grad[1] else None
    return (ddy, dx, *_NO_TOPOLOGY_GRADS)


_spmm_op.register_autograd(_spmm_backward, setup_context=_setup)
_spmm_t_op.register_autograd(_spmm_t_backward, setup_context=_setup)
_sddmm_op.register_autograd(_sddmm_backward, setup_context=_setup)


# ---------------------------------------------------------------- public functions


def spmm(x: Tensor, values: Tensor, topology: Topology) -> Tensor:
    """``Y = X · Wᵀ`` for ``x (B, in)``; returns ``(B, out)``. Differentiable in ``x`` and ``values``."""
    return torch.ops.snack.spmm(x, values, *topology.tensors())


def spmm_t(dy: Tensor, values: Tensor, topology: Topology) -> Tensor:
    """``dX = dY · W`` for ``dy (B, out)``; returns ``(B, in)``."""
    return torch.ops.snack.spmm_t(dy, values, *topology.tensors())


def sddmm(dy: Tensor, x: Tensor, topology: Topology) -> Tensor:
    """``out[k] = Σ_b dy[b, row_k] · x[b, col_k]`` for ``dy (B, out)``, ``x (B, in)``; returns ``(nnz,)``."""
    return torch.ops.snack.sddmm(dy, x, *topology.tensors())


def sparse_linear(x: Tensor, values: Tensor, topology: Topology, bias: Tensor | None = None) -> Tensor:
    """Functional form of :class:`snack.SparseLinear`: ``x (*, in)`` → ``(*, out)``, ``y = x·Wᵀ + b``."""
    out_features, in_features = topology.shape
    y = torch.ops.snack.spmm(x.reshape(-1, in_features), values, *topology.tensors())
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], out_features)
