"""The im2col path of :class:`snack.SparseConv2d` in an eager training step: one autograd node
that keeps the input, not its rows.

Where the native CPU kernels do not run (a GPU, other dtypes, ``torch.autocast``, a forced
backend), a convolution unfolds its input into ``(N · H_out · W_out, C · kh · kw)`` rows and
multiplies them by the sparse weight. Through :class:`snack.SparseLinear`'s ops those rows were
what autograd kept for the values gradient until the backward: ``kh · kw`` copies of the input (9
for a 3×3 kernel) per layer, where ``nn.Conv2d`` keeps one. This node keeps the unpadded input and
unfolds it again in the backward, for the values gradient only; the input gradient folds the rows'
gradient back (``F.fold``; a 3-D convolution's tap by tap) and cuts the zero padding off.

Compiled, traced and ``torch.func`` code, and a forward that records no gradient, take the
composite path (:meth:`snack.SparseConv2d._through_rows`), whose ops those understand.

Shapes: ``x (N, C, H, W)`` (:class:`snack.SparseConv3d`'s ``(N, C, D, H, W)``), ``values (nnz,)``,
``bias (out,)`` or ``None`` → rows ``(N · H_out · W_out, out)`` (``N · D_out · H_out · W_out``), in
the order of ``im2col``'s rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from snack import backends
from snack.backends.cpu.conv import ConvGeometry, gradients_by_recomputing
from snack.ops import _linear_kernel, _sparse_linear, _spmm_grads
from snack.topology import Topology

__all__ = ["rows_conv2d"]


def rows_conv2d(
    x: Tensor, values: Tensor, bias: Tensor | None, topology: Topology, geometry: ConvGeometry,
    im2col: Callable[[Tensor], Tensor], cast_from: tuple[Tensor, ...],
) -> Tensor:
    """Output rows ``(N · H_out · W_out, out)`` of ``x`` zero padded by ``geometry.zero_padding``
    and unfolded by ``im2col`` (padded ``(N, C, Hp, Wp)`` → rows, by differentiable ops), times
    the sparse weight, plus ``bias``. ``cast_from`` holds the tensor ``values`` was cast from
    under autocast (saved, so that a backward after it changed raises)."""
    return _RowsConv2d.apply(x, values, bias, topology, geometry, im2col, cast_from)


class _RowsConv2d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, values, bias, topology, geometry, im2col, cast_from):
        y = _linear_kernel(im2col(_zero_padded(x, geometry)), values, bias, topology.tensors())
        # values saved too: autograd's version check then refuses a backward after values changed
        ctx.save_for_backward(x, values, bias, *cast_from)
        ctx.topology, ctx.geometry, ctx.im2col = topology, geometry, im2col
        ctx.forced = backends.forced_backend()  # the backward runs where the forward ran
        return y

    @staticmethod
    def backward(ctx, dy):
        x, values, bias = ctx.saved_tensors[:3]
        needed = ctx.needs_input_grad[:3]
        unused = (None,) * 4
        if torch.is_grad_enabled():  # create_graph: the recomputed rows' ops have derivatives of every order

            def recompute(x, values, bias):
                return _sparse_linear(ctx.im2col(_zero_padded(x, ctx.geometry)), values, ctx.topology, bias)

            with backends.forcing(ctx.forced):
                return (*gradients_by_recomputing(recompute, needed, x, values, bias, dy), *unused)
        need_x, need_values, need_bias = needed
        with backends.forcing(ctx.forced):
            rows = ctx.im2col(_zero_padded(x, ctx.geometry)) if need_values else None
            drows, dvalues = _spmm_grads(dy, rows, values, ctx.topology.tensors(), need_x, need_values, direct=True)
        dx = _folded(drows, x.shape, ctx.geometry) if need_x else None
        return dx, dvalues, dy.sum(0) if need_bias else None, *unused


def _zero_padded(x: Tensor, geometry: ConvGeometry) -> Tensor:
    return F.pad(x, geometry.zero_padding) if any(geometry.zero_padding) else x


def _folded(drows: Tensor, shape: torch.Size, geometry: ConvGeometry) -> Tensor:
    """The input gradient ``(N, C, H, W)`` of rows' gradient ``drows (N · H_out · W_out, C · kh ·
    kw)``: each row's entries summed back into the windows they came from, the padding cut off
    (a 3-D convolution's, :func:`_folded_3d`)."""
    if len(shape) == 5:
        return _folded_3d(drows, shape, geometry)
    n, _, height, width = shape
    if n == 0:  # (no rows to tell H_out · W_out)
        return drows.new_zeros(shape)
    left, right, top, bottom = geometry.zero_padding
    columns = drows.view(n, -1, drows.shape[1]).transpose(1, 2)  # (N, C·kh·kw, H_out·W_out), as F.fold takes
    padded = F.fold(columns, (height + top + bottom, width + left + right), geometry.kernel,
                    dilation=geometry.dilation, stride=geometry.stride)  # fmt: skip
    return padded[:, :, top : top + height, left : left + width]


def _folded_3d(drows: Tensor, shape: torch.Size, geometry: ConvGeometry) -> Tensor:
    """:func:`_folded` of a 3-D convolution (``F.fold`` is 2-D only): ``drows (N · D_out · H_out ·
    W_out, C · kd · kh · kw)`` added back tap by tap, each tap's column a strided slab of the padded
    input ``(N, C, Dp, Hp, Wp)``."""
    n, channels, *sizes = shape
    if n == 0:
        return drows.new_zeros(shape)
    left, right, top, bottom, front, back = geometry.zero_padding
    before = (front, top, left)
    padded_sizes = [size + a + b for size, a, b in zip(sizes, before, (back, bottom, right))]
    outputs = [(p - d * (k - 1) - 1) // s + 1
               for p, k, s, d in zip(padded_sizes, geometry.kernel, geometry.stride, geometry.dilation)]  # fmt: skip
    taps = drows.view(n, *outputs, channels, *geometry.kernel).permute(0, 4, 1, 2, 3, 5, 6, 7)
    padded = drows.new_zeros(n, channels, *padded_sizes)
    for tap in itertools.product(*(range(k) for k in geometry.kernel)):
        window = tuple(slice(t * d, t * d + s * (o - 1) + 1, s)
                       for t, d, s, o in zip(tap, geometry.dilation, geometry.stride, outputs))  # fmt: skip
        padded[(slice(None), slice(None), *window)] += taps[(..., *tap)]
    inside = tuple(slice(b, b + size) for b, size in zip(before, sizes))
    return padded[(slice(None), slice(None), *inside)]
