"""``SparseConv2d``, a truly sparse drop-in for ``nn.Conv2d`` (grouped and depthwise ones too)."""

from __future__ import annotations

import math
from typing import Self

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from snack import backends
from snack.backends import full
from snack.backends.cpu import conv as direct
from snack.func import transforms_active
from snack.nn import tracing
from snack.nn.conv_base import _channels_of_weight, _check_channels, _no_tracer_warnings, _SparseConvNd
from snack.nn.conv_rows import rows_conv2d
from snack.nn.layer import PRE_HOOKS_REASON, SparseLinear, _copied_bias, _reject_meta
from snack.ops import _sparse_linear, autocast_inputs
from snack.topology import coo_from_dense

__all__ = ["SparseConv2d"]


class _SparseConvolution(_SparseConvNd):
    """What :class:`SparseConv2d` (and :class:`SparseConv1d`) and :class:`snack.SparseConv3d`
    share: the constructors, the forward's frame, the padding, the im2col path and the
    conversions, for ``_dims`` spatial dimensions (computed in ``_computed_dims``). Subclasses give
    the geometry's arithmetic (``_padding_amounts``, ``_check_input``) and ``_fast_forward``."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, ...],
        stride: int | tuple[int, ...] = 1,
        padding: int | tuple[int, ...] | str = 0,
        dilation: int | tuple[int, ...] = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        *,
        sparsity: float = 0.9,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        geometry = self._checked_geometry(kernel_size, stride, padding, dilation, groups, padding_mode)
        _check_channels(in_channels, out_channels, geometry, type(self).__name__)
        in_features = int(in_channels) // geometry["groups"] * math.prod(geometry["kernel_size"])
        super().__init__(in_features, out_channels, bias, sparsity=sparsity, device=device, dtype=dtype)
        self._set_geometry(int(in_channels), geometry)

    @property
    def out_channels(self) -> int:
        return self.out_features

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_dense(
        cls,
        conv_or_weight: nn.Module | Tensor,
        *,
        sparsity: float | None = None,
        bias: Tensor | None = None,
        stride: int | tuple[int, ...] = 1,
        padding: int | tuple[int, ...] | str = 0,
        dilation: int | tuple[int, ...] = 1,
        groups: int = 1,
        padding_mode: str = "zeros",
    ) -> Self:
        """A sparse layer holding the non-zeros (``sparsity=None``) or the largest-magnitude
        ``round((1 - sparsity) · numel)`` weights of an ``nn.Conv2d`` (its geometry and bias are
        used) or of an ``(out_channels, in_channels / groups, kh, kw)`` weight tensor (with
        ``bias``, ``stride``, ``padding``, ``dilation``, ``groups``, ``padding_mode`` given here).
        Parameters are copies. (:class:`SparseConv1d`: of an ``nn.Conv1d`` or an ``(out_channels,
        in_channels / groups, k)`` weight; :class:`snack.SparseConv3d`: of an ``nn.Conv3d`` or an
        ``(out_channels, in_channels / groups, kd, kh, kw)`` weight.)"""
        dense_name = f"nn.{cls._dense_class.__name__}"
        if isinstance(conv_or_weight, cls._dense_class):
            conv = conv_or_weight
            given = dict(bias=bias, stride=stride, padding=padding, dilation=dilation, groups=groups,
                         padding_mode=padding_mode)  # fmt: skip
            defaults = dict(bias=None, stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros")
            if given != defaults:
                raise ValueError(
                    "from_dense: bias, stride, padding, dilation, groups and padding_mode must not be given with an "
                    f"{dense_name}; its own are used"
                )
            if conv._forward_pre_hooks:
                raise ValueError(f"conv_or_weight: {PRE_HOOKS_REASON}; remove them first")
            weight, bias = conv.weight, conv.bias
            stride, padding, dilation, groups = conv.stride, conv.padding, conv.dilation, conv.groups
            padding_mode = conv.padding_mode
        elif isinstance(conv_or_weight, Tensor):
            weight = conv_or_weight
            if weight.dim() != 2 + cls._dims:
                raise ValueError(f"conv_or_weight: a weight must be {cls._weight_shape()}, got {tuple(weight.shape)}")
        else:
            raise TypeError(f"conv_or_weight must be an {dense_name} or a Tensor, got {type(conv_or_weight).__name__}")
        _reject_meta(weight.device)
        out_channels, group_channels, *kernel = weight.shape
        geometry = cls._checked_geometry(tuple(kernel), stride, padding, dilation, groups, padding_mode)
        in_channels = _channels_of_weight(weight.shape, geometry, "conv_or_weight", cls.__name__)
        row, col, values = coo_from_dense(weight.reshape(out_channels, -1), sparsity)
        layer = cls._from_parts(group_channels * math.prod(kernel), out_channels, row, col, values,
                                _copied_bias(bias, out_channels, weight.dtype))  # fmt: skip
        layer._set_geometry(in_channels, geometry)
        return layer

    @classmethod
    def from_coo(
        cls,
        row: Tensor,
        col: Tensor,
        values: Tensor,
        shape: tuple[int, ...],
        *,
        bias: Tensor | None = None,
        stride: int | tuple[int, ...] = 1,
        padding: int | tuple[int, ...] | str = 0,
        dilation: int | tuple[int, ...] = 1,
        groups: int = 1,
        padding_mode: str = "zeros",
    ) -> Self:
        """A sparse layer from coordinates into the flattened kernel: ``row`` the output channel,
        ``col`` the position in ``in_channels / groups · kh · kw`` (``c · kh · kw + i · kw + j``, ``c``
        counted within the output channel's group), in any order, without duplicates; ``shape`` is
        the dense weight's, ``(out_channels, in_channels / groups, kh, kw)`` (:class:`SparseConv1d`:
        ``col`` is ``c · k + j`` and ``shape`` ``(out_channels, in_channels / groups, k)``;
        :class:`snack.SparseConv3d`: ``col`` is ``c · kd · kh · kw + (i · kh + j) · kw + l`` and
        ``shape`` ``(out_channels, in_channels / groups, kd, kh, kw)``)."""
        if not (isinstance(shape, (tuple, list, torch.Size)) and len(shape) == 2 + cls._dims):
            raise ValueError(f"shape must be {cls._weight_shape()}, got {shape!r}")
        out_channels, group_channels, *kernel = shape
        geometry = cls._checked_geometry(tuple(kernel), stride, padding, dilation, groups, padding_mode)
        in_channels = _channels_of_weight(shape, geometry, "shape", cls.__name__)
        kernel_size = math.prod(geometry["kernel_size"])
        linear = SparseLinear.from_coo(row, col, values, (out_channels, group_channels * kernel_size), bias=bias)
        layer = cls._from_parts(linear.in_features, linear.out_features, linear.row, linear.col,
                                linear.values.data, None if linear.bias is None else linear.bias.data)  # fmt: skip
        layer._set_geometry(in_channels, geometry)
        return layer

    def forward(self, input: Tensor) -> Tensor:
        """``input (N, in_channels, *spatial)`` or ``(in_channels, *spatial)`` → ``(N, out_channels,
        *output spatial)`` (or without ``N``), in the layer's dtype (see :class:`SparseLinear`)."""
        if tracing.fx_symbolic_tracing():
            return self._fx_forward(input)
        if not isinstance(input, Tensor):
            raise TypeError(f"{type(self).__name__} expects a Tensor input, got {type(input).__name__}")
        batched = input.dim() == self._computed_dims + 2
        x = input if batched else input.unsqueeze(0)
        with _no_tracer_warnings():
            self._check_input(input, x)
        y = self._fast_forward(x)
        if y is None:
            y = self._through_rows(self._padded(x), self._product)
        return y if batched else y.squeeze(0)

    def _padded(self, x: Tensor) -> Tensor:
        """``x (N, C, *spatial)`` with the padding applied (:meth:`_padding_amounts`, in ``F.pad``'s
        order: left, right, top, bottom, and front, back for a 3-D layer)."""
        amounts = self._padding_amounts()
        if not any(amounts):
            return x
        return F.pad(x, amounts, mode="constant" if self.padding_mode == "zeros" else self.padding_mode)

    def _fast_forward(self, x: Tensor) -> Tensor | None:
        """The convolution of unpadded ``x`` in eager code: by the native kernels or the dense
        convolution for a full topology (:meth:`_full_or_direct`), or else in a step that records
        gradients by im2col as one node that keeps ``x``, not its rows (:mod:`snack.nn.conv_rows`);
        ``None`` elsewhere (the composite im2col path runs)."""
        if torch.compiler.is_compiling() or torch._C._get_tracing_state() is not None or transforms_active():
            return None
        values, bias, topology = self._consistent_state()
        if values.shape != (topology.nnz,) or (bias is not None and bias.shape != (self.out_features,)):
            return None  # the im2col path's checks name the problem
        if x.device != values.device:
            return None
        # zero padding is the kernels' (and the rows node's) own: their input gradient then comes
        # without it; other modes pad first
        amounts = self._padding_amounts()
        zero_padding = amounts if self.padding_mode == "zeros" else (0,) * len(amounts)
        geometry = direct.ConvGeometry(*self._computed_geometry, zero_padding)
        training = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, values, bias))
        if x.dtype == values.dtype and not torch._C._is_any_autocast_enabled():
            y = self._full_or_direct(x, values, bias, topology, geometry, training)
            if y is not None:
                return y
        if not training:
            return None  # inference: the composite path's rows live only for the call
        return self._rows_keeping_input(x, values, bias, topology, geometry)

    def _rows_keeping_input(self, x, values, bias, topology, geometry: direct.ConvGeometry) -> Tensor | None:
        """im2col as one autograd node that keeps ``x`` for the backward, not its rows
        (:mod:`snack.nn.conv_rows`), inside ``torch.autocast`` in the region's dtype; ``None`` for
        an input whose dtype is not the layer's (the composite path raises, naming both)."""
        cast_x, cast_values, cast_bias = autocast_inputs(x, values, bias)
        if cast_x.dtype != cast_values.dtype:
            return None
        cast_x = cast_x if self.padding_mode == "zeros" else self._padded(cast_x)
        cast_from = (values,) if cast_values is not values else ()
        rows = rows_conv2d(cast_x, cast_values, cast_bias, self._unfolded(topology), geometry,
                           lambda padded: self._im2col(padded)[0], cast_from)  # fmt: skip
        return self._output_of_rows(rows, cast_x, geometry.zero_padding)

    def _through_rows(self, x: Tensor, linear) -> Tensor:
        """The convolution of padded ``x`` by im2col: its rows through ``linear`` (rows →
        ``(rows, out_channels)``), back to ``(N, out_channels, *output sizes)`` (in channels-last
        memory order, no copy; contiguous in compiled code)."""
        rows, sizes = self._im2col(x)
        y = linear(rows).view(*sizes, self.out_features).movedim(-1, 1)
        # Compiled code lays the output out as nn.Conv2d's (Inductor fuses the copy into the bias
        # add): with the image size symbolic (a model called with a second size) it failed to lay
        # out this channels-last view as a graph output (ValueRangeError in its size analysis).
        return y.contiguous() if torch.compiler.is_compiling() else y

    def _fx_root_forward(self, input):
        col = self.col if self.groups == 1 else self._unfolded_col(self.row, self.col)
        return self._through_rows(self._padded(input), lambda rows: tracing.fx_sparse_linear(
            rows, self.values, self.bias, self.row, col, self.out_features, self._rows_width
        ))  # fmt: skip

    # ------------------------------------------------------------------ conversion

    @classmethod
    def _random_like(cls, conv: nn.Module, sparsity: float) -> Self:
        """A layer of ``conv``'s geometry with a random topology (``sparsify(init="random")``)."""
        weight = conv.weight
        return cls(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding, conv.dilation,
                   conv.groups, conv.bias is not None, conv.padding_mode, sparsity=sparsity, device=weight.device,
                   dtype=weight.dtype)  # fmt: skip

    def _dense_arguments(self) -> dict:
        """The dense layer's constructor arguments for this layer's geometry (``densify``)."""
        return dict(in_channels=self.in_channels, out_channels=self.out_channels, kernel_size=self.kernel_size,
                    stride=self.stride, padding=self.padding, dilation=self.dilation, groups=self.groups,
                    bias=self.bias is not None, padding_mode=self.padding_mode)  # fmt: skip

    def extra_repr(self) -> str:
        parts = [f"{self.in_channels}, {self.out_channels}", f"kernel_size={self.kernel_size}", f"stride={self.stride}"]
        if self.padding != (0,) * self._dims:
            parts.append(f"padding={self.padding!r}")
        if self.dilation != (1,) * self._dims:
            parts.append(f"dilation={self.dilation}")
        if self.groups != 1:
            parts.append(f"groups={self.groups}")
        if self.padding_mode != "zeros":
            parts.append(f"padding_mode={self.padding_mode!r}")
        parts.append(f"nnz={self.nnz}, sparsity={self.sparsity:.4f}, bias={self.bias is not None}")
        return ", ".join(parts)


class SparseConv2d(_SparseConvolution):
    """A 2-D convolution whose kernel stores only its ``nnz`` connections.

    Input ``(N, C_in, H, W)`` or ``(C_in, H, W)``, output ``(N, C_out, H_out, W_out)`` (or without
    ``N``), with ``nn.Conv2d``'s arguments and output size. The weight is the sparse
    ``(out_channels, in_channels / groups · kh · kw)`` matrix ``nn.Conv2d``'s weight is when
    flattened: connection ``(o, col)`` joins output channel ``o`` to input channel ``col // (kh·kw)``
    of its group at kernel tap ``divmod(col % (kh·kw), kw)``. So this is a :class:`SparseLinear`
    with ``in_features = in_channels / groups · kh · kw``: ``row``, ``col``, ``values``,
    ``set_topology``, the state_dict and every :mod:`snack.dst` algorithm work on it unchanged, and
    :meth:`to_dense` gives the ``(out_channels, in_channels / groups, kh, kw)`` weight.
    Initialisation is ``nn.Conv2d``'s variance with the sparse fan-in, as for :class:`SparseLinear`
    (whose ``fan_in`` rule is ``nn.Conv2d``'s with ``in_features`` inputs).

    With ``groups > 1`` output channel ``o`` reads the input channels of its group only (group
    ``o // (out_channels / groups)``), as in ``nn.Conv2d``: a topology, a rewire or growth can
    only name connections inside the groups, since ``col`` counts within one. The kernels compute
    it as an ungrouped convolution whose connections all lie in their groups' blocks (each
    ``col`` moved to its group's block of ``in_channels · kh · kw`` columns): the layer keeps a
    second column index for that, ``nnz`` int32s and their column order, rebuilt with each
    topology. Depthwise layers (``groups == in_channels > 1``) run kernels of their own on the
    CPU, on the layer's own topology.

    How it computes:

    * on the CPU, float32 and float64, eagerly: a direct sparse convolution (native kernels,
      ``snack/backends/cpu/conv_kernels.cpp``): each connection multiplies one window of an input
      plane into one output plane, and nothing is unfolded; except where the output has few
      positions for the connections (batch 1 on small images), where im2col rows are faster
      (:func:`snack.backends.cpu.conv.rows_are_faster`);
    * elsewhere (a GPU, other dtypes, ``torch.autocast``, ``torch.compile``, tracing, ``torch.func``
      transforms, a forced backend): im2col, the input's windows unfolded into
      ``(N · H_out · W_out, in_features)`` rows through :class:`SparseLinear`'s ops. The rows hold
      ``kh · kw`` copies of the input, for the call: a training step keeps the input for its
      backward, which unfolds it again (:mod:`snack.nn.conv_rows`);
    * a layer holding every connection (ERK leaves small first layers dense): ``F.conv2d`` on
      ``values`` viewed as the dense weight, unless a backend is forced.

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, padding_mode: as for
            ``nn.Conv2d`` (``padding`` an int, a pair, ``"valid"`` or ``"same"``).
        groups: as for ``nn.Conv2d``: it divides ``in_channels`` and ``out_channels``;
            ``groups == in_channels`` is a depthwise convolution.
        bias: learn an additive bias per output channel.
        sparsity: fraction of zero connections in ``[0, 1)``, drawn uniformly at random.
        device, dtype: of the parameters.
    """

    # the dense layer it replaces and its spatial dimensions (SparseConv1d: nn.Conv1d, 1), and
    # those it computes in (a 1-D layer's input gets a height of 1)
    _dense_class: type[nn.Module] = nn.Conv2d
    _dims = 2
    _computed_dims = 2

    # ------------------------------------------------------------------ forward

    def _padding_amounts(self) -> tuple[int, int, int, int]:
        if self.padding == "valid":
            return (0, 0, 0, 0)
        if self.padding == "same":  # as nn.Conv2d: an odd total puts the extra row/column last
            (kh, kw), (dh, dw) = self._kernel2d, self._dilation2d
            th, tw = dh * (kh - 1), dw * (kw - 1)
            return (tw // 2, tw - tw // 2, th // 2, th - th // 2)
        ph, pw = self._padding2d
        return (pw, pw, ph, ph)

    def _check_input(self, input: Tensor, x: Tensor) -> None:
        """Raise for an input of another number of channels or dimensions, or smaller than the
        (dilated) kernel once padded; ``x`` is ``input`` with a batch dimension."""
        if input.dim() not in (3, 4) or input.shape[-3] != self.in_channels:
            raise ValueError(
                f"SparseConv2d(in_channels={self.in_channels}): input must have shape (N, {self.in_channels}, H, W) "
                f"or ({self.in_channels}, H, W), got {tuple(input.shape)}"
            )
        (kh, kw), (dh, dw) = self._kernel2d, self._dilation2d
        left, right, top, bottom = self._padding_amounts()
        height, width = x.shape[-2] + top + bottom, x.shape[-1] + left + right
        if height < dh * (kh - 1) + 1 or width < dw * (kw - 1) + 1:
            raise ValueError(
                f"SparseConv2d: the input, padded to {(height, width)}, is smaller than the dilated kernel "
                f"({dh * (kh - 1) + 1}, {dw * (kw - 1) + 1})"
            )

    def _full_or_direct(
        self, x, values, bias, topology, geometry: direct.ConvGeometry, training: bool
    ) -> Tensor | None:
        """``F.conv2d`` for a full topology, else the native kernels where they apply and im2col
        rows would not be faster (:func:`snack.backends.cpu.conv.rows_are_faster`)."""
        zeros = self.padding_mode == "zeros"
        if backends.forced_backend() is None and full.applies(x.device, topology.tensors()):
            weight = values.view(self.out_channels, -1, *self._kernel2d)
            # zero padding inside F.conv2d, as nn.Conv2d does: no padded copy kept for the backward
            padding, x = (self._padding2d, x) if zeros else (0, self._padded(x))
            return F.conv2d(x, weight, bias, self._stride2d, padding, self._dilation2d, self.groups)
        if not direct.applies(x, values):
            return None
        if backends.forced_backend() is None:  # (a forced backend's kernels run as they are)
            height, width = self._output_size(*x.shape[-2:], self._padding_amounts())
            if direct.rows_are_faster(topology.nnz, x.shape[0] * height * width, self._rows_width, training):
                return None
        # built (once per topology) also for depthwise layers: compiled code, which runs im2col, must
        # find it built (see _unfolded)
        unfolded = self._unfolded(topology)

        def recompute(x: Tensor, values: Tensor, bias: Tensor | None) -> Tensor:
            padded = self._padded(x) if zeros else x
            return self._through_rows(padded, lambda rows: _sparse_linear(rows, values, unfolded, bias))

        x = x if zeros else self._padded(x)
        depthwise = direct.depthwise_kernels_run(self.in_channels, self.groups)
        return direct.direct_conv2d(x.contiguous(), values, bias, topology if depthwise else unfolded, geometry,
                                    recompute, training=training, depthwise=depthwise)  # fmt: skip

    # ------------------------------------------------------------------ rows for RigL

    def _record_of_input(self, x: Tensor) -> Tensor:
        """What RigL keeps of an input ``x (N, C, H, W)`` (or unbatched): the padded input ``(N, C,
        Hp, Wp)``, a copy. Not its im2col rows, ``kh·kw`` times as large: a 90% ResNet-18 at batch
        32 held 515 MB of them for an update (99 MB of inputs now), and an update added 1.2 s to
        its step (0.5 s now, scoring with the convolution's backward)."""
        x = x if x.dim() == 4 else x.unsqueeze(0)
        padded = self._padded(x)
        return padded.clone(memory_format=torch.contiguous_format) if padded is x else padded.contiguous()

    def _rows_of_output(self, y: Tensor) -> Tensor:
        """An output (or its gradient) ``(N, out_channels, H_out, W_out)`` → ``(N · H_out · W_out,
        out_channels)``, row for row with :meth:`_rows_of_record`."""
        return y.movedim(-3, -1).reshape(-1, self.out_features)



_SparseConvolution.forward.__annotations__ = {"input": Tensor, "return": Tensor}  # see the same line in layer.py
