"""``SparseConv1d``, a truly sparse drop-in for ``nn.Conv1d`` (grouped ones too): a
:class:`SparseConv2d` of height 1."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from snack.nn import tracing
from snack.nn.conv import SparseConv2d
from snack.nn.conv_base import _no_tracer_warnings

__all__ = ["SparseConv1d"]


class SparseConv1d(SparseConv2d):
    """A 1-D convolution whose kernel stores only its ``nnz`` connections.

    Input ``(N, C_in, L)`` or ``(C_in, L)``, output ``(N, C_out, L_out)`` (or without ``N``), with
    ``nn.Conv1d``'s arguments, attributes and output size. The weight is the sparse
    ``(out_channels, in_channels / groups · k)`` matrix ``nn.Conv1d``'s weight is when flattened:
    connection ``(o, col)`` joins output channel ``o`` to input channel ``col // k`` of its group at
    kernel tap ``col % k``; :meth:`to_dense` gives the ``(out_channels, in_channels / groups, k)``
    weight.

    It computes as a :class:`SparseConv2d` with a ``(1, k)`` kernel on inputs of height 1 (the
    same native kernels on the CPU, im2col elsewhere, the same RigL scoring), and is one to
    ``sparsify``, ``densify`` (which gives back an ``nn.Conv1d``) and every :mod:`snack.dst`
    algorithm (ERK weighs a ``(out, in, k)`` kernel by ``(out + in + k) / (out · in · k)``).

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, padding_mode: as for
            ``nn.Conv1d`` (each an int or a 1-tuple; ``padding`` also ``"valid"`` or ``"same"``).
        groups: as for ``nn.Conv1d`` (see :class:`SparseConv2d`).
        bias: learn an additive bias per output channel.
        sparsity: fraction of zero connections in ``[0, 1)``, drawn uniformly at random.
        device, dtype: of the parameters.
    """

    _dense_class = nn.Conv1d
    _dims = 1

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int],
        stride: int | tuple[int] = 1,
        padding: int | tuple[int] | str = 0,
        dilation: int | tuple[int] = 1,
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

    def forward(self, input: Tensor) -> Tensor:
        """``input (N, in_channels, L)`` or ``(in_channels, L)`` → ``(N, out_channels, L_out)`` (or
        without ``N``), in the layer's dtype (see :class:`SparseLinear`)."""
        if tracing.fx_symbolic_tracing():
            return self._fx_forward(input)
        if not isinstance(input, Tensor):
            raise TypeError(f"SparseConv1d expects a Tensor input, got {type(input).__name__}")
        with _no_tracer_warnings():
            self._check_input_1d(input)
        return super().forward(input.unsqueeze(-2)).squeeze(-2)

    def _check_input_1d(self, input: Tensor) -> None:
        """Raise for an input of another number of channels or dimensions, or shorter than the
        (dilated) kernel once padded (in 1-D terms, before the 2-D checks)."""
        if input.dim() not in (2, 3) or input.shape[-2] != self.in_channels:
            raise ValueError(
                f"SparseConv1d(in_channels={self.in_channels}): input must have shape (N, {self.in_channels}, L) or "
                f"({self.in_channels}, L), got {tuple(input.shape)}"
            )
        left, right, _, _ = self._padding_amounts()
        span = self.dilation[0] * (self.kernel_size[0] - 1) + 1
        if input.shape[-1] + left + right < span:
            raise ValueError(
                f"SparseConv1d: the input, padded to length {input.shape[-1] + left + right}, is shorter than the "
                f"dilated kernel ({span})"
            )

    def _fx_root_forward(self, input):
        return super()._fx_root_forward(input.unsqueeze(-2)).squeeze(-2)

    # ------------------------------------------------------------------ rows for RigL

    def _record_of_input(self, x: Tensor) -> Tensor:
        """The padded input as a 2-D convolution's, ``(N, C, 1, Lp)`` (see :class:`SparseConv2d`)."""
        return super()._record_of_input(x.unsqueeze(-2))

    def _rows_of_output(self, y: Tensor) -> Tensor:
        """An output (or its gradient) ``(N, out_channels, L_out)`` → ``(N · L_out, out_channels)``."""
        return y.movedim(-2, -1).reshape(-1, self.out_features)


SparseConv1d.forward.__annotations__ = {"input": Tensor, "return": Tensor}  # see the same line in layer.py
