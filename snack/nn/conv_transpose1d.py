"""``SparseConvTranspose1d``, a truly sparse drop-in for ``nn.ConvTranspose1d`` (the upsampling of
audio decoders and vocoders): a :class:`SparseConvTranspose2d` of height 1."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from snack.nn.conv_transpose import SparseConvTranspose2d

__all__ = ["SparseConvTranspose1d"]


class SparseConvTranspose1d(SparseConvTranspose2d):
    """A 1-D transposed convolution whose kernel stores only its ``nnz`` connections.

    Input ``(N, C_in, L)`` or ``(C_in, L)``, output ``(N, C_out, L_out)`` (or without ``N``), with
    ``nn.ConvTranspose1d``'s arguments, attributes, output size and ``forward(input,
    output_size)``. The weight is the sparse ``(in_channels, out_channels / groups · k)`` matrix
    ``nn.ConvTranspose1d``'s ``(in_channels, out_channels / groups, k)`` weight is when flattened;
    :meth:`to_dense` gives that weight.

    It computes as a :class:`SparseConvTranspose2d` with a ``(1, k)`` kernel on inputs of height 1
    (the same kernels and paths, the same RigL scoring), and is one to ``sparsify``, ``densify``
    (which gives back an ``nn.ConvTranspose1d``) and every :mod:`snack.dst` algorithm.

    Args:
        in_channels, out_channels, kernel_size, stride, padding, output_padding, groups, dilation:
            as for ``nn.ConvTranspose1d`` (each an int or a 1-tuple).
        bias: learn an additive bias per output channel.
        padding_mode: ``"zeros"`` only, as ``nn.ConvTranspose1d``.
        sparsity: fraction of zero connections in ``[0, 1)``, drawn uniformly at random.
        device, dtype: of the parameters.
    """

    _dense_class = nn.ConvTranspose1d
    _dims = 1

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int],
        stride: int | tuple[int] = 1,
        padding: int | tuple[int] = 0,
        output_padding: int | tuple[int] = 0,
        groups: int = 1,
        bias: bool = True,
        dilation: int | tuple[int] = 1,
        padding_mode: str = "zeros",
        *,
        sparsity: float = 0.9,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, output_padding, groups, bias,
                         dilation, padding_mode, sparsity=sparsity, device=device, dtype=dtype)  # fmt: skip

    def forward(self, input: Tensor, output_size: list[int] | None = None) -> Tensor:
        """``input (N, in_channels, L)`` or ``(in_channels, L)`` → ``(N, out_channels, L_out)`` (or
        without ``N``), in the layer's dtype; ``output_size`` as for ``nn.ConvTranspose1d``
        (``(L_out,)``, optionally with the leading sizes)."""
        return super().forward(input, output_size)

    def _transposed(self, input: Tensor, size: tuple[int]) -> Tensor:
        return super()._transposed(input.unsqueeze(-2), (1, *size)).squeeze(-2)

    # ------------------------------------------------------------------ records for RigL: as 2-D ones

    def _record_of_input(self, x: Tensor) -> Tensor:
        return super()._record_of_input(x.unsqueeze(-2))

    def _record_of_output_gradient(self, dy: Tensor) -> Tensor:
        return super()._record_of_output_gradient(dy.unsqueeze(-2))


SparseConvTranspose1d.forward.__annotations__ = {"input": Tensor, "output_size": list[int] | None, "return": Tensor}
