"""3-D convolutions computed by the 2-D direct kernels: what :class:`snack.SparseConv3d` and
:class:`snack.SparseConvTranspose3d` share.

On the CPU the 2-D direct kernels (``snack/backends/cpu/conv_kernels.cpp``, depthwise layers
``depthwise_kernels.cpp``) run on the padded input laid out as one 2-D plane: at stride 1 its
planes end to end, ``(N, C, Dp · Hp, Wp)``, where kernel tap ``(i, j, l)`` reads row ``i · dd · Hp
+ j · dh`` and column ``l · dw`` from output position ``(od · Hp + oh, ow)``. So the layer is a
2-D convolution of a tall kernel (``(kd - 1) · dd · Hp + (kh - 1) · dh + 1`` rows) holding its
connections at those taps (:meth:`_Convolution3d._flattened`). With strides, every stride phase of
every dimension becomes a block of rows of its own (:class:`_PlaneLayout`), so that each tap is
again one 2-D tap and the 2-D convolution runs at stride 1, unpadded: the 2-D kernels then lay
nothing out (at stride 2 their own phase split of this tall plane cost more than their
multiply-adds). The output rows and columns that straddle two planes are computed and dropped: ``(kh - 1)
· dh`` of every ``Hp`` rows at stride 1 (2 of 18 for a 3×3×3 kernel on 16³ inputs), as a 2-D
convolution's flat walk drops ``(kw - 1) · dw`` columns of every row.

A transposed convolution is the adjoint of the convolution with its weight: it runs the adjoint
steps, its input laid out as that convolution's output plane (:meth:`_PlaneLayout.output_plane_of`),
the 2-D transposed kernels, and the plane's input part taken out (:class:`_FromPlane`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from snack.indexing import native_for
from snack.topology import INDEX_DTYPE, Topology, _outside_transient_modes

# the largest int32 column of a flattened kernel (its width must fit the native kernels' indices)
_INT32_MAX = 2**31 - 1


class _Convolution3d:
    """The 3-D geometry and the plane's caches of :class:`snack.SparseConv3d` and
    :class:`snack.SparseConvTranspose3d` (mixed in before their :class:`~snack.nn.conv_base._SparseConvNd`
    base): the weight's taps are ``kernel_size``'s ``(kd, kh, kw)``, its rows are ``out_features``
    and the windows' channels ``_window_channels``."""

    def _set_geometry(self, in_channels: int, geometry: dict) -> None:
        super()._set_geometry(in_channels, geometry)
        self._flattened_cache: tuple | None = None  # see _flattened
        self._layout_cache: tuple | None = None  # (the shapes it is for, a _PlaneLayout): see _plane_layout

    @property
    def _computed_geometry(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        return self.kernel_size, self.stride, self.dilation

    def _output_size(self, *padded: int) -> tuple[int, int, int]:
        """``(D_out, H_out, W_out)`` of a padded input of sizes ``(Dp, Hp, Wp)``."""
        return _convolved_size(padded, self.kernel_size, self.stride, self.dilation)

    def _plane_layout(self, key: tuple, batch: int, channels: int, padded: tuple[int, int, int]) -> _PlaneLayout:
        """The :class:`_PlaneLayout` of a padded input ``(batch, channels, *padded)``, cached under
        ``key`` (the call's shapes). (A small layer's step paid 10 µs for building it, and 75 µs for
        indexing the phases.)"""
        cached = self._layout_cache
        if cached is not None and cached[0] == key:
            return cached[1]
        layout = _PlaneLayout(self.kernel_size, self.stride, self.dilation, batch, channels, padded)
        self._layout_cache = (key, layout)
        return layout

    def _flattened(self, topology: Topology, layout: _PlaneLayout, depthwise: bool) -> tuple | None:
        """``(kernel, order)``: the 2-D kernel of ``layout.kernel`` taps that computes the layer on
        ``layout``'s plane, and the order of its connections among the layer's (``None``: the
        same). Tap ``(i, j, l)`` of window channel ``c`` (a convolution's input channel, a transposed
        one's output channel) becomes column ``(c · kernel_height + row_offset(i, j, l)) ·
        kernel_width + column_offset(l)`` (over all window channels, a grouped layer's connections
        in their groups' blocks; one channel for the depthwise kernels). With a
        stride the offsets do not grow with the tap (the phases interleave), and the kernel's
        connections are sorted anew. ``None`` past int32. Built once per topology and layout."""
        key = (layout.key, depthwise)
        cached = self._flattened_cache
        if cached is not None and cached[0] is topology and cached[1] == key:
            return cached[2]
        kernel_height, kernel_width = layout.kernel
        width = (1 if depthwise else self._window_channels) * kernel_height * kernel_width
        if width > _INT32_MAX:
            return None
        kernel = topology if depthwise else self._unfolded(topology)
        taps = math.prod(self.kernel_size)

        def build() -> tuple[Tensor, Tensor, Tensor | None]:
            col = kernel.col.long()
            channel, tap = col.div(taps, rounding_mode="floor"), col.remainder(taps)
            offset = torch.tensor(layout.tap_offsets, device=col.device)[tap]
            flat_col = channel * (kernel_height * kernel_width) + offset
            positions = kernel.row.long() * width + flat_col
            if bool((positions[1:] > positions[:-1]).all()):
                return kernel.row, flat_col.to(INDEX_DTYPE), None
            order = positions.argsort()
            return kernel.row[order], flat_col[order].to(INDEX_DTYPE), order

        row, col, order = _outside_transient_modes(build)
        flattened = (Topology(row, col, (self.out_features, width), validate=False), order)
        self._flattened_cache = (topology, key, flattened)
        return flattened

    def index_tensors(self) -> list[Tensor]:
        cached = self._flattened_cache
        if cached is None:
            return super().index_tensors()
        kernel, order = cached[2]
        flattened = [kernel.col, *kernel.derived_so_far(), *([] if order is None else [kernel.row, order])]
        return super().index_tensors() + flattened

    def _apply(self, fn, recurse=True):
        self._flattened_cache = None  # of the old tensors
        return super()._apply(fn, recurse)

    def __getstate__(self):
        state = super().__getstate__()
        state["_flattened_cache"] = state["_layout_cache"] = None  # rebuilt on demand
        return state

    # ------------------------------------------------------------------ im2col

    def _im2col(self, x: Tensor) -> tuple[Tensor, tuple]:
        """Padded ``x (N, C, Dp, Hp, Wp)`` → ``(rows (N · D_out · H_out · W_out, C · kd · kh · kw),
        (N, D_out, H_out, W_out))``: each output position's window, in the flattened kernel's
        order (a copy). Written for FX proxies too (no branch on sizes)."""
        windows = x
        for dim, (k, s, d) in enumerate(zip(self.kernel_size, self.stride, self.dilation), start=2):
            windows = windows.unfold(dim, d * (k - 1) + 1, s)  # (N, C, Do, Ho, Wo, ·, ·, ·)
        if self.dilation != (1, 1, 1):
            dd, dh, dw = self.dilation
            windows = windows[..., ::dd, ::dh, ::dw]
        sizes = (windows.shape[0], windows.shape[2], windows.shape[3], windows.shape[4])
        return windows.permute(0, 2, 3, 4, 1, 5, 6, 7).reshape(-1, self._rows_width), sizes

    # ------------------------------------------------------------------ rows for RigL

    def _output_of_rows(self, rows: Tensor, x: Tensor, padding: tuple[int, ...] = (0,) * 6) -> Tensor:
        """Output rows ``(N · D_out · H_out · W_out, out_channels)`` → ``(N, out_channels, D_out,
        H_out, W_out)`` (a view), for the padded input ``x (N, C, Dp, Hp, Wp)`` they came from."""
        left, right, top, bottom, front, back = padding
        depth, height, width = x.shape[-3:]
        sizes = self._output_size(depth + front + back, height + top + bottom, width + left + right)
        return rows.view(x.shape[0], *sizes, self.out_features).movedim(-1, 1)


def _convolved_size(padded: tuple[int, ...], kernel_size: tuple[int, ...], stride: tuple[int, ...],
                    dilation: tuple[int, ...]) -> tuple[int, ...]:  # fmt: skip
    """A convolution's output size for a padded input of sizes ``padded``."""
    return tuple((size - d * (k - 1) - 1) // s + 1 for size, k, s, d in zip(padded, kernel_size, stride, dilation))


class _PlaneLayout:
    """How a 3-D convolution of ``kernel_size``, ``stride`` and ``dilation`` lays its padded input
    ``(N, C, Dp, Hp, Wp)`` (``batch``, ``channels``, ``padded``) out as one 2-D plane that the 2-D
    kernels convolve at stride 1, unpadded (so they lay nothing out).

    Along each dimension of stride ``s`` a padded position ``p`` goes to phase ``p % s``, place
    ``p // s`` (``places`` per phase: ``Wp`` and ``Hp`` rounded up to a multiple of the stride, the
    depth to ``planes`` per phase, zero planes after the input, as many as the last output plane's
    windows need). The plane's row is ``(((ω · sh + ψ) · sd + φ) · planes + q) · Uh + u`` for W, H and
    D phases ``ω, ψ, φ``, depth place ``q`` and height place ``u`` (``Uh`` places per H phase), its
    column the width place ``v``: every phase is a block of rows, outermost. Kernel tap ``(i, j,
    l)`` (reading depth ``od · sd + i · dd``, ...) then reads row ``od · Uh + oh`` + a row offset of
    its own, column ``ow`` + a column offset: one 2-D tap, whatever the strides. Output row ``od ·
    Uh + oh`` is the 3-D output's ``(od, oh)``; the rows and columns between are computed and
    dropped (``Uh - H_out`` of every ``Uh`` rows, ``Uw - W_out`` of ``Uw`` columns: the windows'
    overhang, as a 2-D convolution's flat walk drops). At stride 1 the layout is the padded input
    itself, its planes end to end."""

    def __init__(self, kernel_size: tuple[int, int, int], stride: tuple[int, int, int],
                 dilation: tuple[int, int, int], batch: int, channels: int, padded: tuple[int, int, int]):  # fmt: skip
        self.stride, self.batch, self.channels = stride, batch, channels
        self.padded = padded
        self.output = _convolved_size(padded, kernel_size, stride, dilation)
        # per dimension, each tap's (phase, place)
        per_dim = [[(t * d % s, t * d // s) for t in range(k)] for k, s, d in zip(kernel_size, stride, dilation)]
        (sd, sh, sw), (_, height, width) = self.stride, padded
        self.places_h, self.places_w = -(-height // sh), -(-width // sw)
        column_offsets = [place for _, place in per_dim[2]]
        used_rows = self.output[0] * self.places_h
        planes = -(-padded[0] // sd)
        while True:  # enough planes per phase for the last output plane's windows (one or two more)
            # row offset of tap (i, j, l), in the order of the layer's taps (i · kh + j) · kw + l
            row_offsets = [((ω * sh + ψ) * sd + φ) * planes * self.places_h + q * self.places_h + u
                           for φ, q in per_dim[0] for ψ, u in per_dim[1] for ω, _ in per_dim[2]]  # fmt: skip
            kernel_height = max(row_offsets) + 1
            if sw * sh * sd * planes * self.places_h - kernel_height + 1 >= used_rows:
                break
            planes += 1
        self.planes = planes
        kernel_width = max(column_offsets) + 1
        self.kernel = (kernel_height, kernel_width)
        # each tap's position in the 2-D kernel of kernel_height × kernel_width
        self.tap_offsets = [row * kernel_width + column_offsets[tap % len(column_offsets)]
                            for tap, row in enumerate(row_offsets)]  # fmt: skip
        self.rows = sw * sh * sd * planes * self.places_h
        self.output_rows = self.rows - kernel_height + 1
        self.output_columns = self.places_w - kernel_width + 1
        self.key = (planes, self.places_h, self.places_w)
        self._copies: dict = {}  # see phase_copies

    def blocks_by_phase(self) -> tuple[int, ...]:
        """The plane's sizes split by phase: ``(N, C, sw, sh, sd, planes, Uh, Uw)``."""
        (sd, sh, sw) = self.stride
        return (self.batch, self.channels, sw, sh, sd, self.planes, self.places_h, self.places_w)

    def plane_of(self, x: Tensor, zero_padding: tuple[int, ...]) -> Tensor:
        """The plane ``(N, C, rows, Uw)`` of ``x (N, C, D, H, W)`` zero padded by ``zero_padding``
        (``F.pad``'s order: none for an input padded already in another mode), and by the zeros the
        layout adds after it: one pass over ``x`` (:class:`_ToPlane`; padding and then permuting
        the phases took two)."""
        left, _, top, _, front, _ = zero_padding
        return _ToPlane.apply(x, self, (front, top, left))

    def phase_copies(self, sizes: tuple[int, ...], before: tuple[int, int, int]) -> list[tuple[tuple, tuple]]:
        """Where the plane holds a contiguous input of ``sizes (D, H, W)`` padded by ``before``
        zeros in front, on top and on the left: ``(input view, plane view)`` pairs of
        ``(size, stride, storage offset)``, one per stride phase that holds input positions (the
        phases partition the input). ``as_strided`` views, computed once per layout: indexing
        with the eight slices of each phase cost 11 µs a phase."""
        key = (tuple(sizes), before)
        if key not in self._copies:
            per_dim = []
            for size, stride, first in zip(sizes, self.stride, before):
                pieces = []
                for phase in range(stride):
                    start = first + (phase - first) % stride  # the first padded position of this phase inside
                    if start - first < size:
                        places = slice(start // stride, start // stride + len(range(start - first, size, stride)))
                        pieces.append((phase, slice(start - first, size, stride), places))
                per_dim.append(pieces)
            x = torch.empty((self.batch, self.channels, *sizes), device="meta")
            blocks = torch.empty(self.blocks_by_phase(), device="meta")
            whole = slice(None)
            views = [(x[whole, whole, d, h, w], blocks[whole, whole, ω, ψ, φ, q, u, v])
                     for φ, d, q in per_dim[0] for ψ, h, u in per_dim[1] for ω, w, v in per_dim[2]]  # fmt: skip
            self._copies[key] = [tuple((t.size(), t.stride(), t.storage_offset()) for t in pair) for pair in views]
        return self._copies[key]

    def volume_of(self, plane: Tensor) -> Tensor:
        """The inverse of :meth:`plane_of`: the padded volume ``(N, C, sd · planes, sh · Uh, sw · Uw)``."""
        (sd, sh, sw) = self.stride
        by_phase = plane.view(self.blocks_by_phase()).permute(0, 1, 5, 4, 6, 3, 7, 2)  # (N, C, planes, sd, ...)
        return by_phase.reshape(self.batch, self.channels, self.planes * sd, self.places_h * sh, self.places_w * sw)

    def output_of(self, y: Tensor) -> Tensor:
        """The 3-D output ``(N, O, D_out, H_out, W_out)`` (a view) of the 2-D kernel's ``y (N, O,
        output_rows, output_columns)``."""
        out_depth, out_height, out_width = self.output
        y = y[:, :, : out_depth * self.places_h, :out_width]
        return y.unflatten(2, (out_depth, self.places_h))[:, :, :, :out_height]

    def output_plane_of(self, y: Tensor) -> Tensor:
        """The inverse of :meth:`output_of` for an output ``y (N, O, ≥ D_out, ≥ H_out, ≥ W_out)``,
        ``(N, O, output_rows, output_columns)``, zeros where the 2-D kernel's output is dropped: one
        copy, differentiable (a copy into a view of zeros; padding twice took two)."""
        out_depth, out_height, out_width = self.output
        plane = y.new_zeros(*y.shape[:2], self.output_rows, self.output_columns)
        rows = plane[:, :, : out_depth * self.places_h].unflatten(2, (out_depth, self.places_h))
        rows[:, :, :, :out_height, :out_width].copy_(y[:, :, :out_depth, :out_height, :out_width])
        return plane


class _ToPlane(torch.autograd.Function):
    """``x (N, C, D, H, W)`` → its :class:`_PlaneLayout` plane: zeros, and each stride phase of
    ``x`` copied to its block. The backward gathers the phases back (:class:`_FromPlane`); each is
    the other's derivative, so both differentiate to any order."""

    @staticmethod
    def forward(ctx, x: Tensor, layout: _PlaneLayout, before: tuple[int, int, int]) -> Tensor:
        ctx.layout, ctx.before, ctx.sizes = layout, before, x.shape[-3:]
        if _native(x):  # one pass, each plane element written once (plane_kernels.cpp)
            return torch.ops.snack_cpu.volume_to_plane(
                x, layout.rows, layout.places_w, layout.stride, layout.planes, layout.places_h, before
            )
        plane = x.new_zeros(layout.batch, layout.channels, layout.rows, layout.places_w)
        x = x.contiguous()
        for (size, stride, offset), target in layout.phase_copies(ctx.sizes, before):
            plane.as_strided(*target).copy_(x.as_strided(size, stride, x.storage_offset() + offset))
        return plane

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _FromPlane.apply(grad, ctx.layout, ctx.before, ctx.sizes), None, None


class _FromPlane(torch.autograd.Function):
    """The input ``(N, C, *sizes)`` part of a :class:`_PlaneLayout` plane (the adjoint of
    :class:`_ToPlane`: the padding dropped)."""

    @staticmethod
    def forward(ctx, plane: Tensor, layout: _PlaneLayout, before: tuple[int, int, int], sizes) -> Tensor:
        ctx.layout, ctx.before = layout, before
        if _native(plane):
            return torch.ops.snack_cpu.plane_to_volume(
                plane, sizes, layout.stride, layout.planes, layout.places_h, before
            )
        x = plane.new_empty(layout.batch, layout.channels, *sizes)  # every element is in one phase
        plane = plane.contiguous()
        for source, (size, stride, offset) in layout.phase_copies(sizes, before):
            x.as_strided(*source).copy_(plane.as_strided(size, stride, plane.storage_offset() + offset))
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _ToPlane.apply(grad, ctx.layout, ctx.before), None, None, None


def _native(tensor: Tensor) -> bool:
    """Whether the native layout kernels take ``tensor``: float32 or float64 on the CPU, with the
    native backend loaded and not forced off (elsewhere the torch copies, the same values)."""
    return tensor.dtype in (torch.float32, torch.float64) and native_for(tensor)


def _in_kernel_order(values: Tensor, order: Tensor) -> Tensor:
    """``values`` (the layer's order) in the flattened kernel's ``order``."""
    return _KernelOrder.apply(values, order)


def _in_layer_order(kernel_values: Tensor, order: Tensor) -> Tensor:
    """The inverse of :func:`_in_kernel_order`, by differentiable ops."""
    return torch.zeros_like(kernel_values).index_copy(0, order, kernel_values)


class _KernelOrder(torch.autograd.Function):
    """``values[order]`` that saves ``values``: a backward after ``values`` changed in place (a
    rewire, a clamp) then raises, as every other path of the layers does (``index_select`` alone
    saves only the index)."""

    @staticmethod
    def forward(ctx, values: Tensor, order: Tensor) -> Tensor:
        ctx.save_for_backward(values, order)
        return values.index_select(0, order)

    @staticmethod
    def backward(ctx, grad: Tensor):
        _, order = ctx.saved_tensors  # (reading them runs autograd's version check)
        return _in_layer_order(grad, order), None
