"""``SparseConvTranspose2d``, a truly sparse drop-in for ``nn.ConvTranspose2d`` (U-Net decoders,
GAN generators, upsampling heads)."""

from __future__ import annotations

import math
import numbers
from typing import Self

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from snack import backends
from snack.backends import full
from snack.backends.cpu import conv as direct
from snack.func import transforms_active
from snack.nn import tracing
from snack.nn.conv_base import (
    _as_2d, _check_channels, _checked_geometry, _ints, _no_tracer_warnings, _SparseConvNd, _tuple_of,
)
from snack.nn.layer import PRE_HOOKS_REASON, SparseLinear, _copied_bias, _reject_meta
from snack.ops import spmm_t
from snack.topology import Topology, coo_from_dense

__all__ = ["SparseConvTranspose2d"]


class _SparseConvTransposed(_SparseConvNd):
    """What :class:`SparseConvTranspose2d` (and :class:`snack.SparseConvTranspose1d`) and
    :class:`snack.SparseConvTranspose3d` share: the constructors, the output's size, the forward's
    frame, the composite path's checks, the records RigL scores and the conversions, in the
    dimensions the layer computes in (``_computed_dims``, ``_computed_geometry``, ``_computed_padding``,
    ``_computed_output_padding``: 2-D for a 1-D layer). Subclasses give ``_direct`` (the native
    kernels) and ``_folded`` (the composite path)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, ...],
        stride: int | tuple[int, ...] = 1,
        padding: int | tuple[int, ...] = 0,
        output_padding: int | tuple[int, ...] = 0,
        groups: int = 1,
        bias: bool = True,
        dilation: int | tuple[int, ...] = 1,
        padding_mode: str = "zeros",
        *,
        sparsity: float = 0.9,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        name = type(self).__name__
        if not isinstance(bias, bool) and bias not in (0, 1):  # (SparseLinear checks the bias it is given: none)
            raise TypeError(f"{name}: bias must be a bool, got {type(bias).__name__} {bias!r}")
        geometry = self._checked_geometry(kernel_size, stride, padding, output_padding, dilation, groups, padding_mode)
        _check_transposed_channels(in_channels, out_channels, geometry, name)
        in_features = int(out_channels) // geometry["groups"] * math.prod(geometry["kernel_size"])
        # the bias is the output channels', not the weight rows' (the input channels): added below
        super().__init__(in_features, in_channels, False, sparsity=sparsity, device=device, dtype=dtype)
        self._set_geometry(int(in_channels), geometry)
        if bias:
            self.bias = nn.Parameter(torch.empty(int(out_channels), device=device, dtype=dtype))
            self.reset_parameters()

    @classmethod
    def _weight_shape(cls) -> str:
        kernel = {1: "kernel_size", 2: "kh, kw", 3: "kd, kh, kw"}[cls._dims]
        return f"(in_channels, out_channels / groups, {kernel})"

    @classmethod
    def _checked_geometry(cls, kernel_size, stride, padding, output_padding, dilation, groups, padding_mode) -> dict:
        name = cls.__name__
        dense = f"nn.{cls._dense_class.__name__}"
        if padding_mode != "zeros":
            raise ValueError(f"{name}: padding_mode must be 'zeros' (as for {dense}), got {padding_mode!r}")
        if isinstance(padding, str):
            raise ValueError(
                f"{name}: padding must be an int or {_tuple_of(cls._dims)} (as for {dense}), got {padding!r}"
            )
        geometry = _checked_geometry(kernel_size, stride, padding, dilation, groups, padding_mode, cls._dims, name)
        output_padding = _ints(output_padding, "output_padding", 0, cls._dims, name)
        if any(o >= max(s, d) for o, s, d in zip(output_padding, geometry["stride"], geometry["dilation"])):
            raise ValueError(
                f"{name}: output_padding must be smaller than the stride or the dilation, got output_padding="
                f"{output_padding} with stride={geometry['stride']} and dilation={geometry['dilation']}"
            )
        return {**geometry, "output_padding": output_padding}

    @property
    def out_channels(self) -> int:
        return self._window_channels

    @property
    def _computed_padding(self) -> tuple[int, ...]:
        return self._padding2d

    @property
    def _computed_output_padding(self) -> tuple[int, ...]:
        return _as_2d(self.output_padding, 0)

    @property
    def _bias_features(self) -> int:
        return self.out_channels

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_dense(
        cls,
        conv_or_weight: nn.Module | Tensor,
        *,
        sparsity: float | None = None,
        bias: Tensor | None = None,
        stride: int | tuple[int, ...] = 1,
        padding: int | tuple[int, ...] = 0,
        output_padding: int | tuple[int, ...] = 0,
        groups: int = 1,
        dilation: int | tuple[int, ...] = 1,
    ) -> Self:
        """A sparse layer holding the non-zeros (``sparsity=None``) or the largest-magnitude
        ``round((1 - sparsity) · numel)`` weights of an ``nn.ConvTranspose2d`` (its geometry and
        bias are used) or of an ``(in_channels, out_channels / groups, kh, kw)`` weight tensor
        (with ``bias``, ``stride``, ``padding``, ``output_padding``, ``groups`` and ``dilation``
        given here). Parameters are copies. (:class:`snack.SparseConvTranspose1d`: of an
        ``nn.ConvTranspose1d`` or an ``(in_channels, out_channels / groups, k)`` weight;
        :class:`snack.SparseConvTranspose3d`: of an ``nn.ConvTranspose3d`` or an ``(in_channels,
        out_channels / groups, kd, kh, kw)`` weight.)"""
        geometry_arguments = dict(stride=stride, padding=padding, output_padding=output_padding, groups=groups,
                                  dilation=dilation)  # fmt: skip
        dense_name = f"nn.{cls._dense_class.__name__}"
        if isinstance(conv_or_weight, cls._dense_class):
            conv = conv_or_weight
            defaults = dict(stride=1, padding=0, output_padding=0, groups=1, dilation=1)
            if bias is not None or geometry_arguments != defaults:
                raise ValueError(
                    "from_dense: bias, stride, padding, output_padding, groups and dilation must not be given with an "
                    f"{dense_name}; its own are used"
                )
            if conv._forward_pre_hooks:
                raise ValueError(f"conv_or_weight: {PRE_HOOKS_REASON}; remove them first")
            weight, bias = conv.weight, conv.bias
            geometry_arguments = dict(stride=conv.stride, padding=conv.padding, output_padding=conv.output_padding,
                                      groups=conv.groups, dilation=conv.dilation)  # fmt: skip
        elif isinstance(conv_or_weight, Tensor):
            weight = conv_or_weight
            if weight.dim() != 2 + cls._dims:
                raise ValueError(f"conv_or_weight: a weight must be {cls._weight_shape()}, got {tuple(weight.shape)}")
        else:
            raise TypeError(
                f"conv_or_weight must be an {dense_name} or a Tensor, got {type(conv_or_weight).__name__}"
            )
        _reject_meta(weight.device)
        row, col, values = coo_from_dense(weight.reshape(weight.shape[0], -1), sparsity)
        return cls._assembled(weight.shape, row, col, values, bias, geometry_arguments, "conv_or_weight")

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
        padding: int | tuple[int, ...] = 0,
        output_padding: int | tuple[int, ...] = 0,
        groups: int = 1,
        dilation: int | tuple[int, ...] = 1,
    ) -> Self:
        """A sparse layer from coordinates into the flattened kernel: ``row`` the input channel,
        ``col`` the position in ``out_channels / groups · kh · kw`` (``c · kh · kw + i · kw + j``, ``c``
        counted within the input channel's group), in any order, without duplicates; ``shape`` is
        the dense weight's, ``(in_channels, out_channels / groups, kh, kw)``. (1-D: ``col`` is ``c · k
        + i``; 3-D: ``c · kd · kh · kw + (i · kh + j) · kw + l``, ``shape`` ``(in_channels,
        out_channels / groups, kd, kh, kw)``.)"""
        if not (isinstance(shape, (tuple, list, torch.Size)) and len(shape) == 2 + cls._dims):
            raise ValueError(f"shape must be {cls._weight_shape()}, got {shape!r}")
        geometry_arguments = dict(stride=stride, padding=padding, output_padding=output_padding, groups=groups,
                                  dilation=dilation)  # fmt: skip
        return cls._assembled(shape, row, col, values, bias, geometry_arguments, "shape", checked=False)

    @classmethod
    def _assembled(cls, shape, row, col, values, bias, arguments: dict, argument: str, checked: bool = True):
        """A layer of a weight of ``shape`` ``(in_channels, out_channels / groups, kh, kw)`` with
        connections ``row``/``col``/``values`` (``checked``: sorted and valid, else validated by
        :meth:`SparseLinear.from_coo`), ``bias`` (copied) and the geometry ``arguments``; errors
        about the shape name ``argument``."""
        in_channels, group_channels, *kernel = shape
        geometry = cls._checked_geometry(tuple(kernel), padding_mode="zeros", **arguments)
        if not all(isinstance(size, numbers.Integral) and size > 0 for size in (in_channels, group_channels)):
            raise ValueError(
                f"{argument}: a weight's first two sizes (in_channels, out_channels / groups) must be positive ints, "
                f"got {tuple(shape)}"
            )
        out_channels = int(group_channels) * geometry["groups"]
        _check_transposed_channels(in_channels, out_channels, geometry, cls.__name__)
        features = (int(in_channels), int(group_channels) * math.prod(geometry["kernel_size"]))
        if not checked:
            linear = SparseLinear.from_coo(row, col, values, features)
            row, col, values = linear.row, linear.col, linear.values.data
        layer = cls._from_parts(features[1], features[0], row, col, values, None)
        bias = _copied_bias(bias, out_channels, values.dtype)
        if bias is not None:
            layer.bias = nn.Parameter(bias)
        layer._set_geometry(int(in_channels), geometry)
        return layer

    # ------------------------------------------------------------------ forward

    def forward(self, input: Tensor, output_size: list[int] | None = None) -> Tensor:
        """``input (N, in_channels, H, W)`` or ``(in_channels, H, W)`` → ``(N, out_channels, H_out,
        W_out)`` (or without ``N``), in the layer's dtype (see :class:`SparseLinear`).
        ``output_size`` (as for ``nn.ConvTranspose2d``: ``(H_out, W_out)``, optionally with the
        leading sizes) picks among the sizes a strided layer can give, in place of
        ``output_padding``. (:class:`snack.SparseConvTranspose3d`: ``(N, in_channels, D, H, W)`` →
        ``(N, out_channels, D_out, H_out, W_out)``.)"""
        if tracing.fx_symbolic_tracing():
            return self._fx_forward(input, *(() if output_size is None else (output_size,)))
        if not isinstance(input, Tensor):
            raise TypeError(f"{type(self).__name__} expects a Tensor input, got {type(input).__name__}")
        with _no_tracer_warnings():
            self._check_input(input)
            size = self._size_of_output(input, output_size)
        return self._transposed(input, size)

    def _transposed(self, input: Tensor, size: tuple[int, ...]) -> Tensor:
        """The output of spatial size ``size`` of a checked ``input`` ``(N, in_channels, *spatial)``
        or ``(in_channels, *spatial)``, in the computed dimensions."""
        batched = input.dim() == len(size) + 2
        x = input if batched else input.unsqueeze(0)
        # the convolution it is the adjoint of gives adjoint_size for the output: with an output
        # padding of a stride or more (dilation > stride) that is more than the input's, and the
        # extra positions hold zeros
        adjoint_size = self._adjoint_output_size(size)
        with _no_tracer_warnings():  # (whether it extends depends on the geometry only: a trace may fix it)
            extends = adjoint_size != tuple(x.shape[2:])
        if extends:
            extension = [a - n for a, n in zip(adjoint_size, x.shape[2:])]
            x = F.pad(x, [amount for e in reversed(extension) for amount in (0, e)])
        y = self._fast_forward(x, size)
        if y is None:
            y = self._through_fold(x, size)
        return y if batched else y.squeeze(0)

    def _adjoint_output_size(self, size: tuple[int, ...]) -> tuple[int, ...]:
        """The output size of the convolution this layer is the adjoint of, on an input of ``size``
        (this layer's output size), in the computed dimensions."""
        kernel, stride, dilation = self._computed_geometry
        return tuple((n + 2 * p - d * (k - 1) - 1) // s + 1
                     for n, p, k, s, d in zip(size, self._computed_padding, kernel, stride, dilation))  # fmt: skip

    def _zero_padding(self) -> tuple[int, ...]:
        """The computed padding in ``F.pad``'s order (left, right, top, bottom[, front, back])."""
        return tuple(amount for p in reversed(self._computed_padding) for amount in (p, p))

    def _check_input(self, input: Tensor) -> None:
        spatial = {1: "L", 2: "H, W", 3: "D, H, W"}[self._dims]
        if input.dim() not in (self._dims + 1, self._dims + 2) or input.shape[-self._dims - 1] != self.in_channels:
            raise ValueError(
                f"{type(self).__name__}(in_channels={self.in_channels}): input must have shape (N, {self.in_channels}, "
                f"{spatial}) or ({self.in_channels}, {spatial}), got {tuple(input.shape)}"
            )

    def _size_of_output(self, input: Tensor, output_size) -> tuple[int, ...]:
        """The output's spatial size for ``input`` (``(H_out, W_out)``; 1-D ``(L_out,)``, 3-D
        ``(D_out, H_out, W_out)``): with
        ``output_padding``, or ``output_size`` checked to be one the layer can give (from that size
        to ``stride - 1`` more, as ``nn.ConvTranspose2d``)."""
        name, dims = type(self).__name__, self._dims
        spatial = tuple(input.shape[-dims:])
        smallest = _smallest_output_size(spatial, self.kernel_size, self.stride, self.padding, self.dilation)
        if output_size is None:
            size = tuple(low + o for low, o in zip(smallest, self.output_padding))
        else:
            given = list(output_size) if isinstance(output_size, (tuple, list, torch.Size)) else None
            if given is not None and len(given) == input.dim():
                given = given[-dims:]
            if given is None or len(given) != dims or not all(isinstance(s, numbers.Integral) for s in given):
                sizes = {1: "(L_out,)", 2: "(H_out, W_out)", 3: "(D_out, H_out, W_out)"}[dims]
                raise ValueError(
                    f"{name}: output_size must be {sizes}, or the whole output shape, of ints; got {output_size!r} for "
                    f"an input of shape {tuple(input.shape)}"
                )
            largest = tuple(low + stride - 1 for low, stride in zip(smallest, self.stride))
            if not all(low <= s <= high for s, low, high in zip(given, smallest, largest)):
                raise ValueError(
                    f"{name}: output_size {tuple(given)} is not one this layer gives for an input of {spatial}: sizes "
                    f"range from {smallest} to {largest}"
                )
            size = tuple(int(s) for s in given)
        if min(size) < 1:
            raise ValueError(
                f"{name}: the output of an input of {spatial} would be {size}; the input is too small for the padding"
            )
        return size

    def _fast_forward(self, x: Tensor, size: tuple[int, ...]) -> Tensor | None:
        """The transposed convolution of batched ``x`` in eager code, by ``F.conv_transpose2d`` (3-D:
        ``F.conv_transpose3d``) for a full topology or the native kernels (:meth:`_direct`, where
        they apply and im2col rows are not faster); ``None`` elsewhere (:meth:`_through_fold` runs)."""
        if torch.compiler.is_compiling() or torch._C._get_tracing_state() is not None or transforms_active():
            return None
        values, bias, topology = self._consistent_state()
        if values.shape != (topology.nnz,) or (bias is not None and bias.shape != (self.out_channels,)):
            return None  # the fold path's checks name the problem
        if x.device != values.device or x.dtype != values.dtype or torch._C._is_any_autocast_enabled():
            return None
        kernel, stride, dilation = self._computed_geometry
        if backends.forced_backend() is None and full.applies(x.device, topology.tensors()):
            weight = values.view(self.in_channels, -1, *kernel)
            conv_transpose = F.conv_transpose3d if len(kernel) == 3 else F.conv_transpose2d
            padding = self._computed_padding
            smallest = _smallest_output_size(x.shape[2:], kernel, stride, padding, dilation)
            output_padding = tuple(out - low for out, low in zip(size, smallest))
            return conv_transpose(x, weight, bias, stride, padding, output_padding, self.groups, dilation)
        if not direct.applies(x, values):
            return None
        training = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, values, bias))
        rows = x.shape[0] * math.prod(x.shape[2:])
        if backends.forced_backend() is None and direct.rows_are_faster(topology.nnz, rows, self._rows_width, training,
                                                                        transposed=True):  # fmt: skip
            return None
        return self._direct(x, values, bias, topology, size, training)

    def _through_fold(self, x: Tensor, size: tuple[int, ...]) -> Tensor:
        """The composite path (class docstring), with the layer's checks of dtypes and shapes."""
        x, cast_values, bias, _, topology = self._checked_operands(x)
        return self._folded(x, bias, size, lambda rows: spmm_t(rows, cast_values, self._unfolded(topology)))

    def _fx_root_forward(self, input, *args):
        """The composite path on the layer's tensors, as ``torch.fx.symbolic_trace`` records it for
        the layer itself (batched input, ``output_padding``; the sizes are the input's proxies)."""
        if args:  # (also what the tracer passes for forward's output_size unless concrete_args fixes it)
            raise NotImplementedError(
                f"torch.fx.symbolic_trace of a {type(self).__name__} itself needs output_size=None, as "
                f"nn.{self._dense_class.__name__}'s does: symbolic_trace(layer, "
                "concrete_args={'output_size': None}); or trace a module that holds the layer"
            )
        kernel, stride, dilation = self._computed_geometry
        padding, output_padding = self._computed_padding, self._computed_output_padding
        lifted = self._computed_dims != self._dims  # a 1-D layer computes as a 2-D one of height 1
        x = input.unsqueeze(-2) if lifted else input
        # the positions the adjoint convolution gives beyond the input's (a geometry's constant, see _transposed)
        extension = [o // s for o, s in zip(output_padding, stride)]
        if any(extension):
            x = F.pad(x, [amount for e in reversed(extension) for amount in (0, e)])
        spatial = [x.shape[2 + d] - extension[d] for d in range(self._computed_dims)]  # the input's (proxies)
        smallest = _smallest_output_size(spatial, kernel, stride, padding, dilation)
        size = [low + o for low, o in zip(smallest, output_padding)]
        col = self.col if self.groups == 1 else self._unfolded_col(self.row, self.col)
        shape = (self.out_features, self._rows_width)
        y = self._folded(x, self.bias, size, lambda rows: tracing.fx_sparse_linear_transposed(
            rows, self.values, self.row, col, *shape
        ))  # fmt: skip
        return y.squeeze(-2) if lifted else y

    # ------------------------------------------------------------------ records for RigL

    # RigL scores |∂L/∂W|, W (in_channels, out_channels / groups · kh · kw). This layer is the adjoint
    # of a convolution c with that weight, and ∂L/∂W is c's weight gradient with the roles swapped:
    # c's input is the output gradient dy (its windows are the rows X), c's output gradient is the
    # input x (its positions are the rows dY). So the records are x, and dy padded as c pads it.

    def _record_of_input(self, x: Tensor) -> Tensor:
        """``x (N, in_channels, *spatial)`` (or unbatched), a copy."""
        x = x if x.dim() == self._computed_dims + 2 else x.unsqueeze(0)
        return x.clone(memory_format=torch.contiguous_format)

    def _record_of_output_gradient(self, dy: Tensor) -> Tensor:
        """``dy (N, out_channels, *spatial_out)`` (or unbatched) zero padded as ``c`` pads its input."""
        dy = dy if dy.dim() == self._computed_dims + 2 else dy.unsqueeze(0)
        return F.pad(dy, self._zero_padding()).contiguous()

    def _operands_of_records(self, input_record: Tensor, gradient_record: Tensor) -> tuple[Tensor, Tensor]:
        """``(X, dY)``: the padded output gradient, cut to the windows of the input's positions
        (``(N, out_channels, *padded)``, as a convolution's padded input), and the input as rows
        ``(N · positions, in_channels)``, row for row with ``X``'s windows."""
        kernel, stride, dilation = self._computed_geometry
        spans = [slice(0, (n - 1) * s + d * (k - 1) + 1)
                 for n, k, s, d in zip(input_record.shape[2:], kernel, stride, dilation)]  # fmt: skip
        return gradient_record[(..., *spans)], input_record.movedim(1, -1).reshape(-1, self.in_channels)

    # ------------------------------------------------------------------ conversion

    @classmethod
    def _random_like(cls, conv: nn.Module, sparsity: float) -> Self:
        """A layer of ``conv``'s geometry with a random topology (``sparsify(init="random")``)."""
        weight = conv.weight
        return cls(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                   conv.output_padding, conv.groups, conv.bias is not None, conv.dilation, sparsity=sparsity,
                   device=weight.device, dtype=weight.dtype)  # fmt: skip

    def _dense_arguments(self) -> dict:
        """The dense layer's constructor arguments for this layer's geometry (``densify``)."""
        return dict(in_channels=self.in_channels, out_channels=self.out_channels, kernel_size=self.kernel_size,
                    stride=self.stride, padding=self.padding, output_padding=self.output_padding, groups=self.groups,
                    bias=self.bias is not None, dilation=self.dilation)  # fmt: skip

    def extra_repr(self) -> str:
        parts = [f"{self.in_channels}, {self.out_channels}", f"kernel_size={self.kernel_size}", f"stride={self.stride}"]
        for name, default in (("padding", 0), ("output_padding", 0), ("dilation", 1)):
            if getattr(self, name) != (default,) * self._dims:
                parts.append(f"{name}={getattr(self, name)}")
        if self.groups != 1:
            parts.append(f"groups={self.groups}")
        parts.append(f"nnz={self.nnz}, sparsity={self.sparsity:.4f}, bias={self.bias is not None}")
        return ", ".join(parts)



_SparseConvTransposed.forward.__annotations__ = {"input": Tensor, "output_size": list[int] | None, "return": Tensor}


class SparseConvTranspose2d(_SparseConvTransposed):
    """A 2-D transposed convolution whose kernel stores only its ``nnz`` connections.

    Input ``(N, C_in, H, W)`` or ``(C_in, H, W)``, output ``(N, C_out, H_out, W_out)`` (or without
    ``N``), with ``nn.ConvTranspose2d``'s arguments, output size (``H_out = (H - 1) · stride - 2 ·
    padding + dilation · (kh - 1) + output_padding + 1``) and ``forward(input, output_size)``. The
    weight is the sparse ``(in_channels, out_channels / groups · kh · kw)`` matrix
    ``nn.ConvTranspose2d``'s ``(in_channels, out_channels / groups, kh, kw)`` weight is when
    flattened: connection ``(i, col)`` spreads input channel ``i`` into output channel ``col //
    (kh·kw)`` of its group at kernel tap ``divmod(col % (kh·kw), kw)``. So this is a
    :class:`SparseLinear` with ``out_features = in_channels`` and ``in_features = out_channels /
    groups · kh · kw`` (its ``bias`` has ``out_channels`` entries): ``row``, ``col``, ``values``,
    ``set_topology``, the state_dict and every :mod:`snack.dst` algorithm work on it unchanged,
    and :meth:`to_dense` gives the dense weight. Initialisation is ``nn.ConvTranspose2d``'s
    variance (whose fan-in is ``out_channels / groups · kh · kw``) with the sparse fan-in.

    It is the adjoint of the :class:`SparseConv2d` with the same weight (``out_channels ↔
    in_channels``): its forward is that convolution's input gradient and its backward that
    convolution's forward and weight gradient, so it computes with the same kernels:

    * on the CPU, float32 and float64, eagerly: the native direct kernels, nothing unfolded
      (except where the rows below are faster: few input positions for the connections, see
      :func:`snack.backends.cpu.conv.rows_are_faster`);
    * elsewhere (a GPU, other dtypes, ``torch.autocast``, ``torch.compile``, tracing, ``torch.func``
      transforms, a forced backend): each input position's ``C_in`` values times the weight
      (:func:`snack.ops.spmm_t`) give its ``C_out · kh · kw`` contributions, which ``F.fold`` sums
      into the output. Those columns are ``kh · kw / stride²`` times the output's size, for the
      call; a training step keeps only the input;
    * a layer holding every connection: ``F.conv_transpose2d``, unless a backend is forced.

    Args:
        in_channels, out_channels, kernel_size, stride, padding, output_padding, groups, dilation:
            as for ``nn.ConvTranspose2d`` (each an int or a pair; ``output_padding`` smaller than
            the stride or the dilation).
        bias: learn an additive bias per output channel.
        padding_mode: ``"zeros"`` only, as ``nn.ConvTranspose2d``.
        sparsity: fraction of zero connections in ``[0, 1)``, drawn uniformly at random.
        device, dtype: of the parameters.
    """

    _dense_class = nn.ConvTranspose2d
    _dims = 2
    _computed_dims = 2

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] = 0,
        output_padding: int | tuple[int, int] = 0,
        groups: int = 1,
        bias: bool = True,
        dilation: int | tuple[int, int] = 1,
        padding_mode: str = "zeros",
        *,
        sparsity: float = 0.9,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, output_padding, groups, bias,
                         dilation, padding_mode, sparsity=sparsity, device=device, dtype=dtype)  # fmt: skip

    def _direct(self, x: Tensor, values: Tensor, bias: Tensor | None, topology: Topology, size: tuple[int, int],
                training: bool) -> Tensor:  # fmt: skip
        """The native kernels' transposed convolution of contiguous-able ``x (N, in_channels, H_c,
        W_c)`` (``H_c × W_c``: the adjoint convolution's output) to ``(N, out_channels, *size)``."""
        geometry = direct.ConvGeometry(self._kernel2d, self._stride2d, self._dilation2d, self._zero_padding())

        def recompute(x: Tensor, values: Tensor, bias: Tensor | None) -> Tensor:
            return self._folded(x, bias, size, lambda rows: spmm_t(rows, values, self._unfolded(topology)))

        return direct.direct_conv_transpose2d(x.contiguous(), values, bias, self._unfolded(topology), geometry, size,
                                              recompute, training=training)  # fmt: skip

    def _folded(self, x: Tensor, bias: Tensor | None, size, times_weight) -> Tensor:
        """``y (N, out_channels, *size)`` of ``x (N, in_channels, H_c, W_c)``: each position's
        ``in_channels`` values times the weight (``times_weight``: rows ``(N · H_c · W_c,
        in_channels)`` → ``(N · H_c · W_c, out_channels · kh · kw)``) give its contributions, which
        ``F.fold`` adds into the output's windows (differentiable ops throughout; FX proxies too)."""
        n, height, width = x.shape[0], x.shape[2], x.shape[3]
        columns = times_weight(x.permute(0, 2, 3, 1).reshape(n * height * width, self.in_channels))
        columns = columns.view(n, height * width, self._rows_width).transpose(1, 2)
        y = F.fold(columns, size, self._kernel2d, dilation=self._dilation2d, padding=self._padding2d,
                   stride=self._stride2d)  # fmt: skip
        return y if bias is None else y + bias.view(1, -1, 1, 1)


def _smallest_output_size(spatial, kernel_size, stride, padding, dilation) -> tuple:
    """A transposed convolution's output size for an input of ``spatial`` sizes without output
    padding (``(n - 1) · stride - 2 · padding + dilation · (k - 1) + 1`` per dimension; ints or FX
    proxies)."""
    return tuple((n - 1) * s - 2 * p + d * (k - 1) + 1
                 for n, k, s, p, d in zip(spatial, kernel_size, stride, padding, dilation))  # fmt: skip


def _check_transposed_channels(in_channels, out_channels, geometry: dict, layer: str) -> None:
    """Raise unless the channels are positive ints that the groups divide, and the weight's
    ``out_channels · kh · kw`` columns (over all groups) are int32 indices."""
    _check_channels(in_channels, out_channels, geometry, layer)
    # (the same checks with the roles of the adjoint convolution: only its size bound can fail now)
    _check_channels(out_channels, in_channels, geometry, layer)
