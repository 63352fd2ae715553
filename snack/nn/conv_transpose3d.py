"""``SparseConvTranspose3d``, a truly sparse drop-in for ``nn.ConvTranspose3d`` (the decoders of
3-D U-Nets, volumetric upsampling)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from snack.backends.cpu import conv as direct
from snack.nn.conv_transpose import _SparseConvTransposed
from snack.nn.plane import _Convolution3d, _FromPlane, _in_kernel_order, _in_layer_order
from snack.ops import spmm_t
from snack.topology import Topology

__all__ = ["SparseConvTranspose3d"]


class SparseConvTranspose3d(_Convolution3d, _SparseConvTransposed):
    """A 3-D transposed convolution whose kernel stores only its ``nnz`` connections.

    Input ``(N, C_in, D, H, W)`` or ``(C_in, D, H, W)``, output ``(N, C_out, D_out, H_out, W_out)``
    (or without ``N``), with ``nn.ConvTranspose3d``'s arguments, output size (``D_out = (D - 1) ·
    stride - 2 · padding + dilation · (kd - 1) + output_padding + 1``, and so on) and
    ``forward(input, output_size)``. The weight is the sparse ``(in_channels, out_channels / groups
    · kd · kh · kw)`` matrix ``nn.ConvTranspose3d``'s ``(in_channels, out_channels / groups, kd,
    kh, kw)`` weight is when flattened: connection ``(i, col)`` spreads input channel ``i`` into
    output channel ``col // (kd·kh·kw)`` of its group at kernel tap ``(a, b, c)``, ``col %
    (kd·kh·kw) = (a · kh + b) · kw + c``. As :class:`snack.SparseConvTranspose2d` it is a
    :class:`SparseLinear` with ``out_features = in_channels`` (its ``bias`` has ``out_channels``
    entries): topology, state_dict, ``sparsify``/``densify`` and every :mod:`snack.dst` algorithm
    work on it (RigL scores growth with torch's 3-D convolution backward), and :meth:`to_dense`
    gives the dense weight. Initialisation is ``nn.ConvTranspose3d``'s variance with the sparse
    fan-in.

    It is the adjoint of the :class:`snack.SparseConv3d` with the same weight, and computes:

    * on the CPU, float32 and float64, eagerly: the 2-D direct kernels' transposed convolution on
      the input laid out as that convolution's output plane, the output taken out of its input
      plane (:mod:`snack.nn.plane`), nothing unfolded; except where im2col rows are faster (few
      input positions for the connections, :func:`snack.backends.cpu.conv.rows_are_faster`);
    * elsewhere (a GPU, other dtypes, ``torch.autocast``, ``torch.compile``, tracing,
      ``torch.func`` transforms, a forced backend): each input position's ``C_in`` values times the
      weight (:func:`snack.ops.spmm_t`) give its ``C_out · kd · kh · kw`` contributions, which
      ``F.fold`` sums into the output, along the depth and then over each plane. Those columns
      are ``kd · kh · kw / stride³`` times the output's size, for the call;
    * a layer holding every connection: ``F.conv_transpose3d``, unless a backend is forced.

    Args:
        in_channels, out_channels, kernel_size, stride, padding, output_padding, groups, dilation:
            as for ``nn.ConvTranspose3d`` (each an int or a triple; ``output_padding`` smaller than
            the stride or the dilation).
        bias: learn an additive bias per output channel.
        padding_mode: ``"zeros"`` only, as ``nn.ConvTranspose3d``.
        sparsity: fraction of zero connections in ``[0, 1)``, drawn uniformly at random.
        device, dtype: of the parameters.
    """

    _dense_class = nn.ConvTranspose3d
    _dims = 3
    _computed_dims = 3

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int, int],
        stride: int | tuple[int, int, int] = 1,
        padding: int | tuple[int, int, int] = 0,
        output_padding: int | tuple[int, int, int] = 0,
        groups: int = 1,
        bias: bool = True,
        dilation: int | tuple[int, int, int] = 1,
        padding_mode: str = "zeros",
        *,
        sparsity: float = 0.9,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, output_padding, groups, bias,
                         dilation, padding_mode, sparsity=sparsity, device=device, dtype=dtype)  # fmt: skip

    @property
    def _computed_padding(self) -> tuple[int, int, int]:
        return self.padding

    @property
    def _computed_output_padding(self) -> tuple[int, int, int]:
        return self.output_padding

    def _direct(self, x: Tensor, values: Tensor, bias: Tensor | None, topology: Topology,
                size: tuple[int, int, int], training: bool) -> Tensor | None:  # fmt: skip
        """``y (N, out_channels, *size)`` of ``x (N, in_channels, D_c, H_c, W_c)`` (the adjoint
        convolution's output size) by the 2-D kernels: ``x`` laid out as the adjoint convolution's
        output plane, their transposed convolution gives its input plane, whose input part is
        ``y``. ``None`` where the flattened kernel's columns would overflow int32."""
        padded = tuple(n + 2 * p for n, p in zip(size, self.padding))
        layout = self._plane_layout((x.shape, size), x.shape[0], self.out_channels, padded)
        flattened = self._flattened(topology, layout, depthwise=False)
        if flattened is None:
            return None
        kernel, order = flattened
        geometry = direct.ConvGeometry(layout.kernel, (1, 1), (1, 1), (0, 0, 0, 0))
        unfolded = self._unfolded(topology)

        def recompute(plane: Tensor, kernel_values: Tensor, bias: Tensor | None) -> Tensor:
            # by the composite path, in the 2-D kernels' output plane (zeros outside the output:
            # the incoming gradient is zero there)
            layer_values = kernel_values if order is None else _in_layer_order(kernel_values, order)
            y = self._folded(layout.output_of(plane), bias, size, lambda rows: spmm_t(rows, layer_values, unfolded))
            return layout.plane_of(y, self._zero_padding())

        kernel_values = values if order is None else _in_kernel_order(values, order)
        plane_size = (layout.rows, layout.places_w)  # the adjoint convolution's input plane
        plane = direct.direct_conv_transpose2d(layout.output_plane_of(x), kernel_values, bias, kernel, geometry,
                                               plane_size, recompute, training=training)  # fmt: skip
        return _FromPlane.apply(plane, layout, self.padding, size)

    def _folded(self, x: Tensor, bias: Tensor | None, size, times_weight) -> Tensor:
        """``y (N, out_channels, *size)`` of ``x (N, in_channels, D_c, H_c, W_c)``: each position's
        ``in_channels`` values times the weight (``times_weight``: rows ``(N · D_c · H_c · W_c,
        in_channels)`` → ``(·, out_channels · kd · kh · kw)``) give its contributions; ``F.fold``
        adds them along the depth (each plane's ``kh · kw`` taps carried as channels), then over
        each output plane. Depth first: its result is ``stride / kd`` of the columns' size.
        Differentiable ops throughout; FX proxies too."""
        n, depth, height, width = x.shape[0], x.shape[2], x.shape[3], x.shape[4]
        (kd, kh, kw), (sd, sh, sw), (dd, dh, dw) = self.kernel_size, self.stride, self.dilation
        (pd, ph, pw), channels = self.padding, self.out_channels
        columns = times_weight(x.permute(0, 2, 3, 4, 1).reshape(n * depth * height * width, self.in_channels))
        # (N, D_c, H_c·W_c, C_out, kd, kh·kw) → fold's (N, channels · taps, blocks): (N, C_out · H_c·W_c ·
        # kh·kw · kd, D_c), into (N, C_out · H_c·W_c · kh·kw, D_out, 1)
        columns = columns.view(n, depth, height * width, channels, kd, kh * kw).permute(0, 3, 2, 5, 4, 1)
        columns = columns.reshape(n, channels * height * width * kh * kw * kd, depth)
        planes = F.fold(columns, (size[0], 1), (kd, 1), dilation=(dd, 1), padding=(pd, 0), stride=(sd, 1))
        # (N, C_out · D_out · kh·kw, H_c·W_c): each plane's taps as fold's, the planes as its channels; into
        # (N, C_out · D_out, H_out, W_out)
        planes = planes.view(n, channels, height * width, kh * kw, size[0]).permute(0, 1, 4, 3, 2)
        planes = planes.reshape(n, channels * size[0] * kh * kw, height * width)
        y = F.fold(planes, (size[1], size[2]), (kh, kw), dilation=(dh, dw), padding=(ph, pw), stride=(sh, sw))
        y = y.view(n, channels, size[0], size[1], size[2])
        return y if bias is None else y + bias.view(1, -1, 1, 1, 1)


SparseConvTranspose3d.forward.__annotations__ = {"input": Tensor, "output_size": list[int] | None, "return": Tensor}
