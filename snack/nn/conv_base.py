"""What :class:`snack.SparseConv2d` and :class:`snack.SparseConvTranspose2d` share: a convolution
as a :class:`SparseLinear` over the flattened kernel, its geometry, its groups, and its im2col
rows.

Both hold a weight whose rows (``out_features``) each read ``in_features = channels / groups · kh
· kw`` kernel entries: ``nn.Conv2d``'s ``(out_channels, in_channels / groups, kh, kw)``, or
``nn.ConvTranspose2d``'s ``(in_channels, out_channels / groups, kh, kw)`` (the transposed one is
the adjoint of the convolution with that weight). The kernels compute a grouped layer as an
ungrouped one over all ``groups · in_features`` columns (:meth:`_SparseConvNd._unfolded`), and
RigL scores either from windows of ``groups · in_features`` columns (:meth:`_SparseConvNd._im2col`).
"""

from __future__ import annotations

import contextlib
import math
import numbers
import warnings

import torch
from torch import Tensor, nn

from snack.nn import tracing
from snack.nn.layer import SparseLinear
from snack.topology import Topology, _outside_transient_modes, check_shape_pair

PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


class _SparseConvNd(SparseLinear):
    """A convolution's sparse weight as a :class:`SparseLinear` (see the module docstring).
    Subclasses set ``_dense_class``, ``_dims`` and the geometry attributes (``kernel_size``,
    ``stride``, ``padding``, ``dilation``, ``groups`` as ``nn.Conv2d`` holds them;
    :meth:`_set_geometry`), and give ``sparsify`` and ``densify`` ``_random_like(dense, sparsity)``
    (a layer of a dense one's geometry) and ``_dense_arguments()`` (the dense layer's)."""

    # the dense layer it replaces and its spatial dimensions
    _dense_class: type[nn.Module]
    _dims: int

    @classmethod
    def _weight_shape(cls) -> str:
        if cls._dims == 3:
            return "(out_channels, in_channels / groups, kd, kh, kw)"
        if cls._dims == 2:
            return "(out_channels, in_channels / groups, kh, kw)"
        return "(out_channels, in_channels / groups, kernel_size)"

    @classmethod
    def _checked_geometry(cls, kernel_size, stride, padding, dilation, groups, padding_mode) -> dict:
        return _checked_geometry(kernel_size, stride, padding, dilation, groups, padding_mode, cls._dims, cls.__name__)

    def _set_geometry(self, in_channels: int, geometry: dict) -> None:
        self.in_channels = in_channels
        self.__dict__.update(geometry)
        self._unfolded_cache: tuple[Topology, Topology] | None = None  # see _unfolded

    # The 2-D geometry the computation uses: a 1-D layer (``_dims = 1``) is a 2-D one of height 1.

    @property
    def _kernel2d(self) -> tuple[int, int]:
        return _as_2d(self.kernel_size, 1)

    @property
    def _stride2d(self) -> tuple[int, int]:
        return _as_2d(self.stride, 1)

    @property
    def _dilation2d(self) -> tuple[int, int]:
        return _as_2d(self.dilation, 1)

    @property
    def _padding2d(self) -> tuple[int, int] | str:
        return self.padding if isinstance(self.padding, str) else _as_2d(self.padding, 0)

    @property
    def _computed_geometry(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """``(kernel, stride, dilation)`` in the dimensions the layer computes in, those of the padded
        input RigL records (:meth:`_record_of_input`): 2-D here (a 1-D layer is a 2-D one of
        height 1), 3-D for :class:`snack.SparseConv3d`."""
        return self._kernel2d, self._stride2d, self._dilation2d

    def _output_size(self, height: int, width: int, padding: tuple[int, int, int, int]) -> tuple[int, int]:
        """``(H_out, W_out)`` of an input of ``height × width`` padded by ``padding`` (left, right,
        top, bottom)."""
        (kh, kw), (sh, sw), (dh, dw) = self._kernel2d, self._stride2d, self._dilation2d
        left, right, top, bottom = padding
        return ((height + top + bottom - dh * (kh - 1) - 1) // sh + 1,
                (width + left + right - dw * (kw - 1) - 1) // sw + 1)  # fmt: skip

    def _im2col(self, x: Tensor) -> tuple[Tensor, tuple]:
        """Padded ``x (N, C, Hp, Wp)`` → ``(rows (N · H_out · W_out, C · kh · kw), (N, H_out,
        W_out))``: each output position's window, in the flattened kernel's order (a copy).
        Written for FX proxies too (no branch on sizes)."""
        (kh, kw), (sh, sw), (dh, dw) = self._kernel2d, self._stride2d, self._dilation2d
        windows = x.unfold(2, dh * (kh - 1) + 1, sh).unfold(3, dw * (kw - 1) + 1, sw)  # (N, C, Ho, Wo, ·, ·)
        if (dh, dw) != (1, 1):
            windows = windows[..., ::dh, ::dw]
        sizes = (windows.shape[0], windows.shape[2], windows.shape[3])
        return windows.permute(0, 2, 3, 1, 4, 5).reshape(-1, self._rows_width), sizes

    # ------------------------------------------------------------------ groups

    @property
    def _rows_width(self) -> int:
        """Columns of the im2col rows and of :meth:`_unfolded` topologies: ``in_channels · kh · kw``."""
        return self.in_features * self.groups

    def _kernel_topology(self, topology: Topology) -> Topology:
        return self._unfolded(topology)

    def _unfolded(self, topology: Topology) -> Topology:
        """The layer's ``topology`` over all ``in_channels · kh · kw`` columns of the unfolded
        input, as the kernels compute it: itself for ``groups=1``; for a grouped layer each
        connection's ``col`` moved to its group's block (:meth:`_unfolded_col`), so the ungrouped
        kernels compute the grouped convolution. Built once per topology (the cache holds the
        last pair: a rewire or load makes a new topology)."""
        if self.groups == 1:
            return topology
        shape = (self.out_features, self._rows_width)
        if tracing.program_tracing():  # the program derives it from the row/col it holds, as the topology itself
            return tracing.traced_topology(topology.row, self._unfolded_col(topology.row, topology.col), shape)
        cached = self._unfolded_cache
        # (not one a graph made without autograd: Topology.built_by_no_grad_graph)
        if cached is not None and cached[0] is topology:
            if not (cached[1].built_by_no_grad_graph and torch.is_grad_enabled()):
                return cached[1]
        col = _outside_transient_modes(lambda: self._unfolded_col(topology.row, topology.col))
        unfolded = Topology(topology.row, col, shape, validate=False)  # sorted and unique as topology's
        # its index data now, as the layer's own topology has them: compiled code must find them
        # built (deriving them there broke the graph at every layer: 18 graphs for 2 layers)
        unfolded.tensors()
        self._unfolded_cache = (topology, unfolded)
        return unfolded

    def _derived_topology(self, row: Tensor, col: Tensor) -> Topology:
        topology = super()._derived_topology(row, col)
        self._unfolded(topology)  # built with it, for compiled code (see SparseLinear._derived_topology)
        return topology

    def _unfolded_col(self, row: Tensor, col: Tensor) -> Tensor:
        """``(nnz,)`` int32 columns among all ``in_channels · kh · kw``: output channel ``o`` is in
        group ``o // (out_channels / groups)``, whose block of ``in_features`` columns starts at
        ``group · in_features``. (Tensor ops only: FX proxies and traced programs record them.)"""
        return col + (row // (self.out_features // self.groups)) * self.in_features

    def index_tensors(self) -> list[Tensor]:
        cached = self._unfolded_cache
        unfolded = [] if cached is None else [cached[1].col, *cached[1].derived_so_far()]
        return super().index_tensors() + unfolded

    def _apply(self, fn, recurse=True):
        self._unfolded_cache = None  # of the old tensors (a move would keep them alive)
        return super()._apply(fn, recurse)

    def __getstate__(self):
        state = super().__getstate__()
        state["_unfolded_cache"] = None  # rebuilt on demand, as the topology
        return state

    def __setstate__(self, state):
        state.setdefault("_unfolded_cache", None)  # pickled before groups were supported
        super().__setstate__(state)

    @property
    def _window_channels(self) -> int:
        """Channels of the tensor whose windows the rows are: ``in_channels`` (a transposed
        convolution's: its ``out_channels``)."""
        return self._rows_width // math.prod(self.kernel_size)

    # ------------------------------------------------------------------ rows for RigL

    def _rows_of_record(self, record: Tensor) -> Tensor:
        """The im2col rows ``(N · H_out · W_out, in_features)`` of a padded input ``record``; rows
        as they are (records of calls on inputs of several sizes, joined as rows)."""
        return record if record.dim() == 2 else self._im2col(record)[0]

    def _output_of_rows(self, rows: Tensor, x: Tensor, padding: tuple[int, int, int, int] = (0, 0, 0, 0)) -> Tensor:
        """Output rows ``(N · H_out · W_out, out_channels)`` (:meth:`_rows_of_output`) → ``(N,
        out_channels, H_out, W_out)`` (a view), for the input ``x (N, C, H, W)`` they came from,
        padded by ``padding`` (none: a record, already padded)."""
        height, width = self._output_size(*x.shape[-2:], padding)
        return rows.view(x.shape[0], height, width, self.out_features).permute(0, 3, 1, 2)


    # ------------------------------------------------------------------ conversion

    def to_dense(self) -> Tensor:
        """The dense weight, of the dense layer's shape (:meth:`_weight_shape`; differentiable in ``values``)."""
        return super().to_dense().view(self.out_features, -1, *self.kernel_size)

    def _no_weight_message(self) -> str:
        return (
            f"{type(self).__name__} has no dense weight: it holds `values` at (`row`, `col`) of the flattened kernel; "
            f"`to_dense()` builds the {self._weight_shape()} weight, snack.densify(model) turns the layers back into "
            f"nn.{self._dense_class.__name__}"
        )

def _as_2d(sizes: tuple[int, ...], height: int) -> tuple[int, int]:
    """A geometry pair of 2-D ``sizes``, or of 1-D ones with ``height`` in front."""
    return sizes if len(sizes) == 2 else (height, sizes[0])


def _checked_geometry(kernel_size, stride, padding, dilation, groups, padding_mode, dims: int, layer: str) -> dict:
    """``nn.Conv2d``'s (``dims=2``), ``nn.Conv1d``'s (1) or ``nn.Conv3d``'s (3) geometry arguments, checked, as the
    layer's attributes (tuples of ``dims`` ints; ``padding`` may be ``"valid"`` or ``"same"``;
    ``groups`` an int, whose fit to the channels :func:`_check_channels` checks)."""
    if isinstance(groups, bool) or not isinstance(groups, numbers.Integral) or groups < 1:
        raise ValueError(f"{layer}: groups must be a positive int, got {groups!r}")
    if padding_mode not in PADDING_MODES:
        raise ValueError(f"{layer}: padding_mode must be one of {PADDING_MODES}, got {padding_mode!r}")
    kernel_size = _ints(kernel_size, "kernel_size", 1, dims, layer)
    stride = _ints(stride, "stride", 1, dims, layer)
    dilation = _ints(dilation, "dilation", 1, dims, layer)
    if isinstance(padding, str):
        if padding not in ("valid", "same"):
            raise ValueError(f"{layer}: padding must be an int, {_tuple_of(dims)}, 'valid' or 'same', got {padding!r}")
        if padding == "same" and stride != (1,) * dims:
            raise ValueError(f"{layer}: padding='same' needs stride 1 (as nn.Conv{dims}d), got stride={stride}")
    else:
        padding = _ints(padding, "padding", 0, dims, layer)
    return dict(kernel_size=kernel_size, stride=stride, padding=padding, dilation=dilation, groups=int(groups),
                padding_mode=padding_mode)  # fmt: skip


def _no_tracer_warnings() -> contextlib.AbstractContextManager:
    """Under ``torch.jit.trace``, silence its warning that the input checks (which only raise, for
    the example input) are not in the trace; they need not be. Elsewhere nothing (a
    ``catch_warnings`` per call would cost every eager forward)."""
    return contextlib.nullcontext() if torch._C._get_tracing_state() is None else _ignoring_tracer_warnings()


@contextlib.contextmanager
def _ignoring_tracer_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        yield


def _ints(value, name: str, minimum: int, count: int, layer: str) -> tuple[int, ...]:
    """``value`` (an int, or ``count`` of them) as a tuple of ``count`` ints, each at least ``minimum``."""
    values = (value,) * count if not isinstance(value, (tuple, list, torch.Size)) else tuple(value)
    if len(values) != count or not all(
        isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= minimum for v in values
    ):
        bound = "positive" if minimum == 1 else "non-negative"
        raise ValueError(f"{layer}: {name} must be a {bound} int or {_tuple_of(count)} of them, got {value!r}")
    return tuple(int(v) for v in values)


def _tuple_of(count: int) -> str:
    return "a pair" if count == 2 else f"a tuple of {count}"


def _check_channels(in_channels, out_channels, geometry: dict, layer: str) -> None:
    """Raise unless the channels are positive ints that ``geometry``'s groups divide, and the
    unfolded input's ``in_channels · kh · kw`` columns are int32 indices."""
    try:
        check_shape_pair((out_channels, in_channels))
    except (TypeError, ValueError):
        raise ValueError(
            f"{layer}: in_channels and out_channels must be positive ints, got {in_channels!r} and {out_channels!r}"
        ) from None
    groups = geometry["groups"]
    if in_channels % groups or out_channels % groups:
        raise ValueError(
            f"{layer}: groups must divide in_channels and out_channels, got groups={groups} with in_channels="
            f"{in_channels} and out_channels={out_channels}"
        )
    try:
        check_shape_pair((out_channels, in_channels * math.prod(geometry["kernel_size"])))
    except ValueError as error:
        raise ValueError(f"{layer}: in_channels · kernel taps is too large ({error})") from None


def _channels_of_weight(shape, geometry: dict, argument: str, layer: str) -> int:
    """``in_channels`` of a weight of ``shape`` ``(out_channels, in_channels / groups, *kernel)``,
    checked (:func:`_check_channels`), the error naming ``argument``."""
    out_channels, group_channels = shape[0], shape[1]
    try:
        check_shape_pair((out_channels, group_channels))
    except (TypeError, ValueError):
        raise ValueError(
            f"{argument}: a weight's first two sizes (out_channels, in_channels / groups) must be positive ints, "
            f"got {tuple(shape)}"
        ) from None
    in_channels = int(group_channels) * geometry["groups"]
    _check_channels(in_channels, out_channels, geometry, layer)
    return in_channels
