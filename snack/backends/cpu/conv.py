"""The direct sparse convolution of :class:`snack.SparseConv2d` on the CPU (``conv_kernels.cpp``;
depthwise layers ``depthwise_kernels.cpp``), as one autograd node.

Shapes: ``x (N, C, H, W)`` (zero padded by the kernels, or already padded with another mode),
``values (nnz,)``, ``bias (out,)`` or ``None`` → ``y (N, out, Ho, Wo)``. The kernels compute float32 and
float64; other dtypes, autocast regions, compiled or traced code and ``torch.func`` transforms
take the layer's im2col path instead
(:meth:`snack.SparseConv2d.forward` decides).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from snack import backends
from snack.topology import Topology

__all__ = [
    "ConvGeometry", "applies", "depthwise_kernels_run", "direct_conv2d", "direct_conv_transpose2d",
    "gradients_by_recomputing", "rows_are_faster",
]

KERNEL_DTYPES = (torch.float32, torch.float64)

# From how many connections per element of the im2col rows (``q = nnz / (rows · C · kh · kw)``)
# those rows through SparseLinear's CPU kernels beat the direct kernels, for inference and for a
# training step. Few output positions (batch 1 on a CNN's last, small planes) and many connections:
# the direct kernels pay per connection per sample (a short run, a pass's setup), where the rows'
# SpMM walks each connection once over all rows, and the rows are small. ``benchmarks/conv_paths.py``
# timed both on 108 layer shapes (every distinct convolution of 90-98% ERK CIFAR ResNet-18s and a
# 95% MobileNetV2 at batch 1 to 32; 2026-12-02 13:37, AMD Zen 4, 2 threads): from q = 0.25 the
# rows' inference was 0.94-15.5x as fast as the kernels' (faster in 28 of 29), below it 0.03-1.8x
# (slower in 76 of 79); from q = 0.5 their training step was 1.13-8.6x as fast (18 of 18), below it
# 0.04-1.24x (slower in 84 of 90). (10:54, before the strided loops: 0.90-10.9x, 28 of 29; 1.03-6.5x,
# 18 of 18.) Large planes and depthwise layers (few connections for many row elements) stay direct.
ROWS_FOR_INFERENCE_FROM = 0.25
ROWS_FOR_TRAINING_FROM = 0.5
# The same for a transposed convolution (SparseConvTranspose2d: rows ``N · H · W`` of its input,
# ``row_width = out · kh · kw``), whose rows multiply by the transposed weight and fold their
# result back (slower than a convolution's rows: the transposed SpMM, and F.fold).
# ``benchmarks/conv_transpose_layer.py``'s second table (24 decoder layers, batch 1 and 4, 90 and
# 98%; 2026-12-02 13:30, AMD Zen 4, 2 threads): from q = 0.5 the rows' inference was 0.73-5.7x as
# fast as the kernels' (faster in 6 of 7), below it 0.07-1.15x (1 of 17); from q = 0.4 their
# training step was 1.01-6.6x as fast (10 of 10), below it 0.15-0.88x (0 of 14).
TRANSPOSED_ROWS_FOR_INFERENCE_FROM = 0.5
TRANSPOSED_ROWS_FOR_TRAINING_FROM = 0.4


class ConvGeometry(NamedTuple):
    """Kernel size, stride and dilation, each ``(height, width)``, and the zero padding
    ``(left, right, top, bottom)`` the convolution adds itself (other padding modes pad first).
    (A 3-D convolution's im2col node, :mod:`snack.nn.conv_rows`, takes ``(depth, height, width)``
    triples and ``(left, right, top, bottom, front, back)``.)"""

    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    zero_padding: tuple[int, ...]


def applies(x: Tensor, values: Tensor) -> bool:
    """Whether the native kernels run this convolution: ``x`` and ``values`` float32 or float64
    on the CPU, and the backend there is the native one (not forced to another)."""
    if x.device.type != "cpu" or x.dtype not in KERNEL_DTYPES or values.dtype != x.dtype:
        return False
    try:
        return backends.resolve(x.device) is backends.get_backend("cpu")
    except backends.BackendUnavailableError:  # a native build that failed: the im2col path runs
        return False


def rows_are_faster(nnz: int, rows: int, row_width: int, training: bool, transposed: bool = False) -> bool:
    """Whether im2col rows ``(rows, row_width)`` through SparseLinear's kernels beat the direct
    kernels for a convolution (``transposed``: a transposed one) of ``nnz`` connections (see
    ``ROWS_FOR_INFERENCE_FROM``); never for no rows (an empty batch)."""
    if transposed:
        threshold = TRANSPOSED_ROWS_FOR_TRAINING_FROM if training else TRANSPOSED_ROWS_FOR_INFERENCE_FROM
    else:
        threshold = ROWS_FOR_TRAINING_FROM if training else ROWS_FOR_INFERENCE_FROM
    return rows > 0 and nnz >= threshold * rows * row_width


def direct_conv2d(
    x: Tensor, values: Tensor, bias: Tensor | None, topology: Topology, geometry: ConvGeometry,
    recompute: Callable[[Tensor, Tensor, Tensor | None], Tensor], *, training: bool, depthwise: bool = False,
) -> Tensor:
    """``y (N, out, Ho, Wo)`` of contiguous ``x (N, C, H, W)``, zero padded by
    ``geometry.zero_padding``; see the module docstring. The kernels pad, not the caller: the
    backward then keeps only ``x`` (a padded copy saved for it would double the activation memory
    convolutions keep) and returns the input gradient without the padding, in one pass.

    ``topology``: the ungrouped ``(out, C · kh · kw)`` one (a grouped layer's connections moved to
    their group's block), or with ``depthwise`` a depthwise layer's own ``(out, kh · kw)`` one
    (groups = C, output channel ``o`` reading channel ``o // (out / C)``), which the depthwise
    kernels run (``depthwise_kernels.cpp``; see :func:`depthwise_kernels_run`).

    ``recompute(x, values, bias)`` gives the same result by another route, for a backward that
    itself builds a graph (``create_graph=True``): these kernels have no derivatives of their own.

    ``training``: whether autograd records this call (grad mode on and an input requiring a
    gradient, as the caller found); without it the kernel runs alone (the autograd.Function's
    call cost 10-15 µs, a third of a small layer's batch-1 forward)."""
    if not training:
        return _forward(x, values, bias, topology, geometry, depthwise)
    return _DirectConv2d.apply(x, values, bias, topology, geometry, recompute, depthwise)


def depthwise_kernels_run(in_channels: int, groups: int) -> bool:
    """Whether a layer's direct convolution runs the depthwise kernels (``depthwise_kernels.cpp``,
    which lay out one plane at a time where the ungrouped ones lay out the whole input first):
    ``groups == in_channels > 1``. Kernel A/B against the ungrouped kernels on 3×3 depthwise layers
    of 2 to 24 channels, 8×8 to 32×32 planes (AMD Zen 4, 2 threads, two runs): forward 1.05-1.8x,
    backward 1.3-4.7x as fast at batch 1 and 32. One input channel (``groups == in_channels == 1``) is an
    ordinary convolution: at batch 1 the depthwise forward would be one task, where the ungrouped
    kernels split the output channels."""
    return groups == in_channels > 1


def _forward(x: Tensor, values: Tensor, bias: Tensor | None, topology: Topology, g: ConvGeometry,
             depthwise: bool = False) -> Tensor:  # fmt: skip
    forward = torch.ops.snack_cpu.depthwise_conv2d_forward if depthwise else torch.ops.snack_cpu.conv2d_forward
    return forward(x, values, topology.rowptr, topology.col, bias, g.kernel, g.stride, g.dilation, g.zero_padding)


def _backward(dy: Tensor, x: Tensor, values: Tensor, topology: Topology, g: ConvGeometry, depthwise: bool,
              needs: tuple[bool, bool, bool]) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``(dx, dvalues, dbias)`` of the convolution, each empty where ``needs`` says not needed."""
    geometry = (g.kernel, g.stride, g.dilation, g.zero_padding)
    if depthwise:
        return torch.ops.snack_cpu.depthwise_conv2d_backward(
            dy, x, values, topology.rowptr, topology.col, *geometry, *needs
        )
    return torch.ops.snack_cpu.conv2d_backward(
        dy, x, values, topology.row, topology.col, topology.rowptr, topology.csc_perm, topology.colptr, *geometry,
        *needs,
    )  # fmt: skip


class _DirectConv2d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, values, bias, topology, geometry, recompute, depthwise):
        y = _forward(x, values, bias, topology, geometry, depthwise)
        # values saved too: autograd's version check then refuses a backward after values changed
        # (a rewire, an in-place clamp), as the layer's other paths do
        ctx.save_for_backward(x, values, bias)
        ctx.topology, ctx.geometry, ctx.recompute, ctx.depthwise = topology, geometry, recompute, depthwise
        return y

    @staticmethod
    def backward(ctx, dy):
        x, values, bias = ctx.saved_tensors
        unused = (None,) * 4
        if torch.is_grad_enabled():
            # create_graph: differentiate the recomputed result, whose ops have derivatives of every order
            return (*gradients_by_recomputing(ctx.recompute, ctx.needs_input_grad[:3], x, values, bias, dy), *unused)
        needs = tuple(ctx.needs_input_grad[:3])
        grads = _backward(dy, x, values, ctx.topology, ctx.geometry, ctx.depthwise, needs)
        return (*(grad if need else None for grad, need in zip(grads, needs)), *unused)


def direct_conv_transpose2d(
    x: Tensor, values: Tensor, bias: Tensor | None, topology: Topology, geometry: ConvGeometry,
    output_size: tuple[int, int], recompute: Callable[[Tensor, Tensor, Tensor | None], Tensor], *, training: bool,
) -> Tensor:
    """The transposed convolution ``y (N, out, Ho, Wo)`` of contiguous ``x (N, in, H, W)``: the
    adjoint of the convolution ``c`` whose weight has ``topology`` (rows: the ``in`` channels,
    columns: ``out · kh · kw``) and ``geometry``, on inputs of ``output_size`` ``(Ho, Wo)``; ``c``'s
    output is ``H × W``. So the forward is ``c``'s input gradient (``conv2d_backward``) for the
    output gradient ``x``, and the backward is ``c`` itself (the input gradient:
    ``conv2d_forward`` of ``dy``) and ``c``'s values gradient with the roles of input and output
    gradient swapped. ``bias`` is ``(out,)``; ``recompute`` and ``training`` as for
    :func:`direct_conv2d`."""
    if not training:
        return _transposed_forward(x, values, bias, topology, geometry, output_size)
    return _DirectConvTranspose2d.apply(x, values, bias, topology, geometry, output_size, recompute)


def _transposed_forward(x, values, bias, topology: Topology, g: ConvGeometry, output_size) -> Tensor:
    channels = topology.shape[1] // (g.kernel[0] * g.kernel[1])
    # the kernel reads only the sizes of c's input: an uninitialised tensor, whose pages are never touched
    input_of_c = x.new_empty((x.shape[0], channels, *output_size))
    y = torch.ops.snack_cpu.conv2d_backward(
        x, input_of_c, values, topology.row, topology.col, topology.rowptr, topology.csc_perm, topology.colptr,
        g.kernel, g.stride, g.dilation, g.zero_padding, True, False, False,
    )[0]  # fmt: skip
    return y if bias is None else y.add_(bias.view(1, -1, 1, 1))


class _DirectConvTranspose2d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, values, bias, topology, geometry, output_size, recompute):
        y = _transposed_forward(x, values, bias, topology, geometry, output_size)
        ctx.save_for_backward(x, values, bias)  # values: autograd's version check (see _DirectConv2d)
        ctx.topology, ctx.geometry, ctx.recompute = topology, geometry, recompute
        return y

    @staticmethod
    def backward(ctx, dy):
        x, values, bias = ctx.saved_tensors
        unused = (None,) * 4
        if torch.is_grad_enabled():  # create_graph (see _DirectConv2d)
            return (*gradients_by_recomputing(ctx.recompute, ctx.needs_input_grad[:3], x, values, bias, dy), *unused)
        topology, g = ctx.topology, ctx.geometry
        needs_input, needs_values, needs_bias = ctx.needs_input_grad[:3]
        dy = dy.contiguous()
        dx = _forward(dy, values, None, topology, g) if needs_input else None
        dvalues = None
        if needs_values:  # c's values gradient, x in the role of its output gradient and dy in that of its input
            dvalues = _backward(x, dy, values, topology, g, False, (False, True, False))[1]
        return dx, dvalues, dy.sum((0, 2, 3)) if needs_bias else None, *unused


def gradients_by_recomputing(recompute, needed, x, values, bias, dy) -> list[Tensor | None]:
    """The gradients of ``recompute(x, values, bias)`` (differentiable ops) for the incoming
    ``dy``, each a graph of its own (a backward with ``create_graph=True``); ``None`` where
    ``needed`` (three flags) says not needed."""
    inputs = [t for t, need in zip((x, values, bias), needed) if need]
    with torch.enable_grad():
        y = recompute(x, values, bias)
        grads = iter(torch.autograd.grad(y, inputs, dy, create_graph=True, allow_unused=True))
    return [next(grads) if need else None for need in needed]
