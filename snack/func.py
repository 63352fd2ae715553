"""The sparse ops under ``torch.func`` transforms: ``grad``, ``vmap``, ``jacrev``, ``jvp`` ...

Neither the custom ops' autograd (``torch.library``, torch 2.13) nor the eager layer's autograd
node (an old-style ``autograd.Function``, the fast path) composes with ``torch.func`` or carries
forward-mode tangents. Inside a transform or a forward-AD level (:func:`transforms_active`),
:func:`snack.ops.sparse_linear` and the public ops run these ``autograd.Function`` s instead.
Each has ``setup_context``, a backward written with the others (so gradients of any order stay
sparse), a ``jvp`` (forward mode), and a ``vmap`` rule:

* a vmapped dense input with unbatched ``values`` (per-sample gradients, a batch of batches) is
  folded into the op's own batch: one kernel call;
* vmapped ``values`` (an ensemble of weights on one topology) run one call per weight set;
* the SDDMM of vmapped ``dy``/``x`` is, with one row per pair (per-sample weight gradients), one
  gather-multiply over ``(V, 1, nnz)``, summed in float32 for half precision as the kernels do;
  with more rows, one kernel call per pair.

Shapes are those of :mod:`snack.ops`; ``topo`` is a :class:`snack.topology.TopologyTensors`,
never vmapped.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd import Function, forward_ad

from snack import backends
from snack.topology import TopologyTensors

__all__ = ["Sddmm", "Spmm", "SpmmT", "transforms_active"]


def transforms_active() -> bool:
    """Whether a ``torch.func`` transform runs, or forward-mode AD (``torch.autograd.forward_ad``
    dual tensors) may: checked on every layer call, so two cheap flag reads."""
    return torch._C._are_functorch_transforms_active() or forward_ad._current_level >= 0


def _backend(device: torch.device):
    return backends.resolve(device)


def _batched_first(tensor: Tensor, dim: int | None, size: int) -> Tensor:
    """``tensor`` with its vmapped dimension first (expanded to ``size`` when it has none)."""
    if dim is None:
        return tensor.expand(size, *tensor.shape)
    return tensor.movedim(dim, 0)


def _product_vmap(function, info, in_dims, dense: Tensor, values: Tensor, topo: TopologyTensors):
    """The vmap rule of :class:`Spmm` and :class:`SpmmT`: ``dense (B, n)`` and ``values (nnz,)``
    each possibly vmapped."""
    dense_dim, values_dim = in_dims[0], in_dims[1]
    if values_dim is None:  # fold the vmapped dimension into the batch: one call
        dense = dense.movedim(dense_dim, 0)
        size, batch, width = dense.shape
        out = function.apply(dense.reshape(size * batch, width), values, topo)
        return out.view(size, batch, out.shape[-1]), 0
    dense = _batched_first(dense, dense_dim, info.batch_size)
    values = values.movedim(values_dim, 0)
    return torch.stack([function.apply(d, v, topo) for d, v in zip(dense, values)]), 0


def _total(terms: list[Tensor]) -> Tensor:
    """The sum of a jvp's terms (one per input with a tangent; at least one has one)."""
    return sum(terms[1:], terms[0])


class _SparseOp(Function):
    """What the three ops share: both dense arguments saved for backward and forward mode, the
    topology, and the backend :func:`snack.use_backend` forced at forward time, which their
    backward and jvp restore (they may run after the ``with`` block)."""

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        a, b, topo = inputs
        ctx.save_for_backward(a, b)
        ctx.save_for_forward(a, b)
        ctx.topo, ctx.forced = topo, backends.forced_backend()


class Spmm(_SparseOp):
    """``y (B, out) = x (B, in) · Wᵀ`` with ``W`` given by ``values (nnz,)`` on ``topo``."""

    @staticmethod
    def forward(x: Tensor, values: Tensor, topo: TopologyTensors) -> Tensor:
        return _backend(x.device).spmm(x.contiguous(), values.contiguous(), topo)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, values = ctx.saved_tensors
        with backends.forcing(ctx.forced):
            dx = SpmmT.apply(dy, values, ctx.topo) if ctx.needs_input_grad[0] else None
            dvalues = Sddmm.apply(dy, x, ctx.topo) if ctx.needs_input_grad[1] else None
        return dx, dvalues, None

    @staticmethod
    def jvp(ctx, x_tangent: Tensor | None, values_tangent: Tensor | None, _):
        x, values = ctx.saved_tensors
        with backends.forcing(ctx.forced):
            terms = [Spmm.apply(t, values, ctx.topo) for t in (x_tangent,) if t is not None]
            terms += [Spmm.apply(x, t, ctx.topo) for t in (values_tangent,) if t is not None]
        return _total(terms)

    @staticmethod
    def vmap(info, in_dims, x, values, topo):
        return _product_vmap(Spmm, info, in_dims, x, values, topo)


class SpmmT(_SparseOp):
    """``dx (B, in) = dy (B, out) · W``."""

    @staticmethod
    def forward(dy: Tensor, values: Tensor, topo: TopologyTensors) -> Tensor:
        return _backend(dy.device).spmm_t(dy.contiguous(), values.contiguous(), topo)

    @staticmethod
    def backward(ctx, grad: Tensor):
        dy, values = ctx.saved_tensors
        with backends.forcing(ctx.forced):
            ddy = Spmm.apply(grad, values, ctx.topo) if ctx.needs_input_grad[0] else None
            dvalues = Sddmm.apply(dy, grad, ctx.topo) if ctx.needs_input_grad[1] else None
        return ddy, dvalues, None

    @staticmethod
    def jvp(ctx, dy_tangent: Tensor | None, values_tangent: Tensor | None, _):
        dy, values = ctx.saved_tensors
        with backends.forcing(ctx.forced):
            terms = [SpmmT.apply(t, values, ctx.topo) for t in (dy_tangent,) if t is not None]
            terms += [SpmmT.apply(dy, t, ctx.topo) for t in (values_tangent,) if t is not None]
        return _total(terms)

    @staticmethod
    def vmap(info, in_dims, dy, values, topo):
        return _product_vmap(SpmmT, info, in_dims, dy, values, topo)


class Sddmm(_SparseOp):
    """``out (nnz,)[k] = Σ_b dy[b, row_k] · x[b, col_k]``."""

    @staticmethod
    def forward(dy: Tensor, x: Tensor, topo: TopologyTensors) -> Tensor:
        return _backend(dy.device).sddmm(dy.contiguous(), x.contiguous(), topo)

    @staticmethod
    def backward(ctx, grad: Tensor):
        dy, x = ctx.saved_tensors
        with backends.forcing(ctx.forced):
            ddy = Spmm.apply(x, grad, ctx.topo) if ctx.needs_input_grad[0] else None
            dx = SpmmT.apply(dy, grad, ctx.topo) if ctx.needs_input_grad[1] else None
        return ddy, dx, None

    @staticmethod
    def jvp(ctx, dy_tangent: Tensor | None, x_tangent: Tensor | None, _):
        dy, x = ctx.saved_tensors
        with backends.forcing(ctx.forced):
            terms = [Sddmm.apply(t, x, ctx.topo) for t in (dy_tangent,) if t is not None]
            terms += [Sddmm.apply(dy, t, ctx.topo) for t in (x_tangent,) if t is not None]
        return _total(terms)

    @staticmethod
    def vmap(info, in_dims, dy, x, topo):
        dy, x = (_batched_first(t, d, info.batch_size) for t, d in zip((dy, x), in_dims[:2]))
        if dy.shape[1] > 1:  # a kernel call per vmapped pair: no (V, B, nnz) intermediate
            return torch.stack([Sddmm.apply(d, x_, topo) for d, x_ in zip(dy, x)]), 0
        # one row per pair (per-sample gradients): one gather-multiply over (V, 1, nnz)
        accumulate = torch.float32 if dy.dtype in (torch.float16, torch.bfloat16) else dy.dtype
        products = dy[..., topo.row].to(accumulate) * x[..., topo.col].to(accumulate)
        return products.sum(1).to(dy.dtype), 0
