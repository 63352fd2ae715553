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
from snack.backends import reference
from snack.topology import TopologyTensors

__all__ = ["Sddmm", "Spmm", "SpmmT", "transforms_active"]


def transforms_active() -> bool:
    """Whether a ``torch.func`` transform runs, or forward-mode AD (``torch.autograd.forward_ad``
    dual tensors) may: checked on every layer call, so two cheap flag reads."""
    return torch._C._are_functorch_transforms_active() or forward_ad._current_level >= 0


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


def _gradients(ctx, grad_a, grad_b) -> tuple:
    """The backward of an op ``f(a, b, topo)``: ``grad_a(a, b)`` and ``grad_b(a, b)`` where
    needed, on the backend forced at forward time."""
    a, b = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[:2]
    with backends.forcing(ctx.forced):
        return grad_a(a, b) if need_a else None, grad_b(a, b) if need_b else None, None


def _bilinear_jvp(op, ctx, a_tangent: Tensor | None, b_tangent: Tensor | None) -> Tensor:
    """Every op is bilinear in its two dense arguments: ``d op(a, b) = op(da, b) + op(a, db)``."""
    a, b = ctx.saved_tensors
    with backends.forcing(ctx.forced):
        terms = [op.apply(t, b, ctx.topo) for t in (a_tangent,) if t is not None]
        terms += [op.apply(a, t, ctx.topo) for t in (b_tangent,) if t is not None]
    return sum(terms[1:], terms[0])  # at least one argument has a tangent


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
        return backends.resolve(x.device, topo).spmm(x.contiguous(), values.contiguous(), topo)

    @staticmethod
    def backward(ctx, dy: Tensor):
        dx = lambda x, values: SpmmT.apply(dy, values, ctx.topo)  # noqa: E731
        return _gradients(ctx, dx, lambda x, values: Sddmm.apply(dy, x, ctx.topo))

    @staticmethod
    def jvp(ctx, x_tangent, values_tangent, _):
        return _bilinear_jvp(Spmm, ctx, x_tangent, values_tangent)

    @staticmethod
    def vmap(info, in_dims, x, values, topo):
        return _product_vmap(Spmm, info, in_dims, x, values, topo)


class SpmmT(_SparseOp):
    """``dx (B, in) = dy (B, out) · W``."""

    @staticmethod
    def forward(dy: Tensor, values: Tensor, topo: TopologyTensors) -> Tensor:
        return backends.resolve(dy.device, topo).spmm_t(dy.contiguous(), values.contiguous(), topo)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ddy = lambda dy, values: Spmm.apply(grad, values, ctx.topo)  # noqa: E731
        return _gradients(ctx, ddy, lambda dy, values: Sddmm.apply(dy, grad, ctx.topo))

    @staticmethod
    def jvp(ctx, dy_tangent, values_tangent, _):
        return _bilinear_jvp(SpmmT, ctx, dy_tangent, values_tangent)

    @staticmethod
    def vmap(info, in_dims, dy, values, topo):
        return _product_vmap(SpmmT, info, in_dims, dy, values, topo)


class Sddmm(_SparseOp):
    """``out (nnz,)[k] = Σ_b dy[b, row_k] · x[b, col_k]``."""

    @staticmethod
    def forward(dy: Tensor, x: Tensor, topo: TopologyTensors) -> Tensor:
        return backends.resolve(dy.device, topo).sddmm(dy.contiguous(), x.contiguous(), topo)

    @staticmethod
    def backward(ctx, grad: Tensor):
        # grad is (nnz,): the values of a sparse W, so d/d dy = x·Wᵀ and d/dx = dy·W
        ddy = lambda dy, x: Spmm.apply(x, grad, ctx.topo)  # noqa: E731
        return _gradients(ctx, ddy, lambda dy, x: SpmmT.apply(dy, grad, ctx.topo))

    @staticmethod
    def jvp(ctx, dy_tangent, x_tangent, _):
        return _bilinear_jvp(Sddmm, ctx, dy_tangent, x_tangent)

    @staticmethod
    def vmap(info, in_dims, dy, x, topo):
        dy, x = (_batched_first(t, d, info.batch_size) for t, d in zip((dy, x), in_dims[:2]))
        if dy.shape[1] > 1:  # a kernel call per vmapped pair: no (V, B, nnz) intermediate
            return torch.stack([Sddmm.apply(d, x_, topo) for d, x_ in zip(dy, x)]), 0
        # one row per pair (per-sample gradients): one gather-multiply over (V, 1, nnz)
        return reference.sddmm(dy, x, topo), 0
