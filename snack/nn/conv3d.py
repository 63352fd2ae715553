"""``SparseConv3d``, a truly sparse drop-in for ``nn.Conv3d`` (grouped and depthwise ones too).

On the CPU it runs the 2-D direct kernels on the padded input laid out as one 2-D plane
(:mod:`snack.nn.plane`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from snack import backends
from snack.backends import full
from snack.backends.cpu import conv as direct
from snack.nn.conv import _SparseConvolution
from snack.nn.plane import _Convolution3d, _in_kernel_order, _in_layer_order
from snack.ops import _sparse_linear
from snack.topology import Topology

__all__ = ["SparseConv3d"]


class SparseConv3d(_Convolution3d, _SparseConvolution):
    """A 3-D convolution whose kernel stores only its ``nnz`` connections.

    Input ``(N, C_in, D, H, W)`` or ``(C_in, D, H, W)``, output ``(N, C_out, D_out, H_out, W_out)``
    (or without ``N``), with ``nn.Conv3d``'s arguments and output size. The weight is the sparse
    ``(out_channels, in_channels / groups · kd · kh · kw)`` matrix ``nn.Conv3d``'s weight is when
    flattened: connection ``(o, col)`` joins output channel ``o`` to input channel ``col // (kd·kh·kw)``
    of its group at kernel tap ``(i, j, l)``, ``col % (kd·kh·kw) = (i · kh + j) · kw + l``. As
    :class:`SparseConv2d` it is a :class:`SparseLinear` with ``in_features = in_channels / groups
    · kd · kh · kw``: topology, state_dict, ``sparsify``/``densify`` and every :mod:`snack.dst`
    algorithm work on it (RigL scores growth with torch's 3-D convolution backward, from the
    padded input), and :meth:`to_dense` gives the ``(out_channels, in_channels / groups, kd, kh,
    kw)`` weight.

    How it computes:

    * on the CPU, float32 and float64, eagerly: the 2-D direct sparse kernels on the padded
      input laid out as one plane (:mod:`snack.nn.plane`), nothing unfolded; the laid-out input is
      one copy, kept for the backward; except where im2col rows are faster (few output positions
      for the connections, :func:`snack.backends.cpu.conv.rows_are_faster`);
    * elsewhere (a GPU, other dtypes, ``torch.autocast``, ``torch.compile``, tracing,
      ``torch.func`` transforms, a forced backend): im2col, the input's windows unfolded into
      ``(N · D_out · H_out · W_out, in_features)`` rows through :class:`SparseLinear`'s ops. The
      rows hold ``kd · kh · kw`` copies of the input, for the call: an eager training step keeps
      the input for its backward, which unfolds it again (:mod:`snack.nn.conv_rows`);
    * a layer holding every connection: ``F.conv3d`` on ``values`` viewed as the dense weight,
      unless a backend is forced.

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, padding_mode: as for
            ``nn.Conv3d`` (``padding`` an int, a triple, ``"valid"`` or ``"same"``).
        groups: as for ``nn.Conv3d``: it divides ``in_channels`` and ``out_channels``.
        bias: learn an additive bias per output channel.
        sparsity: fraction of zero connections in ``[0, 1)``, drawn uniformly at random.
        device, dtype: of the parameters.
    """

    _dense_class: type[nn.Module] = nn.Conv3d
    _dims = 3
    _computed_dims = 3

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int, int],
        stride: int | tuple[int, int, int] = 1,
        padding: int | tuple[int, int, int] | str = 0,
        dilation: int | tuple[int, int, int] = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        *,
        sparsity: float = 0.9,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode,
                         sparsity=sparsity, device=device, dtype=dtype)  # fmt: skip

    # ------------------------------------------------------------------ geometry

    def _padding_amounts(self) -> tuple[int, int, int, int, int, int]:
        """Padding in ``F.pad``'s order: left, right, top, bottom, front, back."""
        if self.padding == "valid":
            return (0,) * 6
        if self.padding == "same":  # as nn.Conv3d: an odd total puts the extra plane, row, column last
            totals = [d * (k - 1) for k, d in zip(self.kernel_size, self.dilation)]
            return tuple(amount for total in reversed(totals) for amount in (total // 2, total - total // 2))
        pd, ph, pw = self.padding
        return (pw, pw, ph, ph, pd, pd)

    def _padded_sizes(self, x: Tensor) -> tuple[int, int, int]:
        """``(Dp, Hp, Wp)`` of ``x (N, C, D, H, W)`` once padded."""
        left, right, top, bottom, front, back = self._padding_amounts()
        depth, height, width = x.shape[-3:]
        return depth + front + back, height + top + bottom, width + left + right

    def _check_input(self, input: Tensor, x: Tensor) -> None:
        """Raise for an input of another number of channels or dimensions, or smaller than the
        (dilated) kernel once padded; ``x`` is ``input`` with a batch dimension."""
        if input.dim() not in (4, 5) or input.shape[-4] != self.in_channels:
            raise ValueError(
                f"SparseConv3d(in_channels={self.in_channels}): input must have shape (N, {self.in_channels}, D, H, W) "
                f"or ({self.in_channels}, D, H, W), got {tuple(input.shape)}"
            )
        padded = self._padded_sizes(x)
        spans = tuple(d * (k - 1) + 1 for k, d in zip(self.kernel_size, self.dilation))
        if any(size < span for size, span in zip(padded, spans)):
            raise ValueError(f"SparseConv3d: the input, padded to {padded}, is smaller than the dilated kernel {spans}")

    # ------------------------------------------------------------------ forward

    def _full_or_direct(self, x: Tensor, values: Tensor, bias: Tensor | None, topology: Topology,
                        geometry: direct.ConvGeometry, training: bool) -> Tensor | None:  # fmt: skip
        """``F.conv3d`` for a full topology, else the native kernels where they apply and im2col
        rows would not be faster (:func:`snack.backends.cpu.conv.rows_are_faster`). (``geometry``,
        the rows node's, goes unused: the kernels run on the plane :mod:`snack.nn.plane` lays out.)"""
        forced = backends.forced_backend()
        if forced is None and full.applies(x.device, topology.tensors()):
            weight = values.view(self.out_channels, -1, *self.kernel_size)
            # zero padding inside F.conv3d, as nn.Conv3d does: no padded copy kept for the backward
            padding, x = (self.padding, x) if self.padding_mode == "zeros" else (0, self._padded(x))
            return F.conv3d(x, weight, bias, self.stride, padding, self.dilation, self.groups)
        if not direct.applies(x, values):
            return None
        if forced is None:
            positions = x.shape[0] * math.prod(self._output_size(*self._padded_sizes(x)))
            if direct.rows_are_faster(topology.nnz, positions, self._rows_width, training):
                return None
        return self._direct(x, values, bias, topology, training)

    def _direct(
        self, x: Tensor, values: Tensor, bias: Tensor | None, topology: Topology, training: bool
    ) -> Tensor | None:
        """The 2-D direct kernels on ``x (N, C, D, H, W)`` laid out as one plane
        (:class:`snack.nn.plane._PlaneLayout`); ``None`` where the flattened kernel's
        columns would overflow int32."""
        layout = self._plane_layout(x.shape, x.shape[0], self.in_channels, self._padded_sizes(x))
        depthwise = direct.depthwise_kernels_run(self.in_channels, self.groups)
        flattened = self._flattened(topology, layout, depthwise)
        if flattened is None:
            return None
        kernel, order = flattened
        if self.padding_mode == "zeros":
            plane = layout.plane_of(x, self._padding_amounts())
        else:
            plane = layout.plane_of(self._padded(x), (0,) * 6)
        geometry = direct.ConvGeometry(layout.kernel, (1, 1), (1, 1), (0, 0, 0, 0))
        unfolded = self._unfolded(topology)

        def recompute(plane: Tensor, kernel_values: Tensor, bias: Tensor | None) -> Tensor:
            # by im2col on the padded input, in the 2-D kernel's output rows (the unused ones zero:
            # their output gradient is zero)
            layer_values = kernel_values if order is None else _in_layer_order(kernel_values, order)
            volume = layout.volume_of(plane)
            y = self._through_rows(volume, lambda rows: _sparse_linear(rows, layer_values, unfolded, bias))
            return layout.output_plane_of(y)

        kernel_values = values if order is None else _in_kernel_order(values, order)
        y = direct.direct_conv2d(plane, kernel_values, bias, kernel, geometry, recompute, training=training,
                                 depthwise=depthwise)  # fmt: skip
        return layout.output_of(y).contiguous()  # as nn.Conv3d's: a later .view() must work

    # ------------------------------------------------------------------ rows for RigL

    def _record_of_input(self, x: Tensor) -> Tensor:
        """What RigL keeps of an input ``x (N, C, D, H, W)`` (or unbatched): the padded input, a
        copy (not its im2col rows, ``kd·kh·kw`` times as large)."""
        x = x if x.dim() == 5 else x.unsqueeze(0)
        padded = self._padded(x)
        return padded.clone(memory_format=torch.contiguous_format) if padded is x else padded.contiguous()

    def _rows_of_output(self, y: Tensor) -> Tensor:
        """An output (or its gradient) ``(N, out_channels, D_out, H_out, W_out)`` → ``(N · D_out ·
        H_out · W_out, out_channels)``, row for row with :meth:`_rows_of_record`."""
        return y.movedim(-4, -1).reshape(-1, self.out_features)
