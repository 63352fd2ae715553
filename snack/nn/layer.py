"""``SparseLinear``, a truly sparse drop-in for ``nn.Linear``."""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from snack.backends.derived import held
from snack.func import transforms_active
from snack.nn import locking, tracing
from snack.ops import _sparse_linear, autocast_inputs
from snack.topology import (
    Topology,
    check_shape,
    check_shape_pair,
    check_sparsity,
    coo_from_dense,
    linear_positions,
    nnz_for_sparsity,
    random_coo,
    sort_coo,
    validate_coo,
)

__all__ = ["SparseLinear"]

# state_dict format: 2 stores _extra_state as a tensor (1: a dict)
_STATE_VERSION = 2

# why a layer with forward pre-hooks is not converted (from_dense refuses it, sparsify leaves it dense)
PRE_HOOKS_REASON = (
    "it has forward pre-hooks, which may recompute .weight at each forward (torch.nn.utils.prune, weight_norm, "
    "spectral_norm), so .weight may be stale, and a sparse layer would not carry them"
)


class SparseLinear(nn.Module):
    """``y = x · Wᵀ + b`` with a sparse ``W`` that stores only its ``nnz`` connections.

    Input ``(*, in_features)``, output ``(*, out_features)``, like ``nn.Linear``. The weight is
    kept in sorted COO form: buffers ``row``, ``col`` (``(nnz,)`` int32) and the parameter
    ``values`` (``(nnz,)``). Forward and backward run the sparse ops of :mod:`snack.ops`; no
    ``out × in`` tensor is built unless :meth:`to_dense` is called.

    Initialisation keeps the output variance of a dense ``nn.Linear`` under its default init:
    ``nn.Linear`` draws ``W ~ U(-1/√in, 1/√in)``, so ``Var(y) = Var(x)/3``. Each sparse row has on
    average ``fan_in = nnz / out_features`` inputs, so ``values ~ U(-1/√fan_in, 1/√fan_in)``
    gives the same ``Var(y)``. The bias is drawn as in ``nn.Linear``: ``U(-1/√in, 1/√in)``.

    Args:
        in_features, out_features: sizes of each input and output sample.
        bias: learn an additive bias.
        sparsity: fraction of zero connections in ``[0, 1)``; the topology is drawn uniformly at
            random with ``round((1 - sparsity) · out · in)`` connections (at least one).
        device, dtype: of the parameters (indices are always int32 on ``device``).

    On the meta device (``device="meta"``, or inside ``with torch.device("meta")``) the layer
    holds its ``nnz`` connections' shapes but no topology yet: ``to_empty(device=...)`` then
    :meth:`reset_parameters` draws it (or ``load_state_dict`` loads one), as large models are
    built without allocating twice. Until then it refuses to compute.

    Use :meth:`from_dense` to keep the non-zeros (or largest weights) of an existing layer, and
    :meth:`from_coo` for explicit coordinates.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        sparsity: float = 0.9,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        check_shape(out_features, in_features)
        in_features, out_features = int(in_features), int(out_features)
        if not isinstance(bias, bool) and bias not in (0, 1):
            # SparseLinear(in, out, 0.5) reads as a sparsity, but would be bias=0.5 at sparsity 0.9
            raise TypeError(
                f"SparseLinear: bias must be a bool, got {type(bias).__name__} {bias!r}; the sparsity is "
                "keyword-only: SparseLinear(in_features, out_features, sparsity=...)"
            )
        sparsity = check_sparsity(sparsity)
        if dtype is not None and not dtype.is_floating_point:
            raise TypeError(f"{type(self).__name__}: dtype must be a floating dtype, got {dtype}")
        device = torch.empty(0, device=device).device  # (a `with torch.device(...)` context's too)
        on_meta = device.type == "meta"
        if on_meta:  # no data to draw into: reset_parameters() draws it after to_empty()
            nnz = self._random_nnz(out_features, in_features, sparsity)
            row, col = (torch.empty(nnz, dtype=torch.int32, device=device) for _ in range(2))
        else:
            row, col = self._random_topology(out_features, in_features, sparsity, device)
        values = torch.empty(row.numel(), device=device, dtype=dtype)
        bias_tensor = torch.empty(out_features, device=device, dtype=dtype) if bias else None
        self._init_state(in_features, out_features, row, col, values, bias_tensor)
        if on_meta:
            self._undrawn_sparsity = sparsity
        self.reset_parameters()

    def _init_state(self, in_features, out_features, row, col, values, bias) -> None:
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("row", row)
        self.register_buffer("col", col)
        self.values = nn.Parameter(values)
        self.bias = nn.Parameter(bias) if bias is not None else None
        # Built on first use, not here: compiled code trusts a cached topology whose row/col are
        # the same tensors, and DDP's first broadcast (rank 0's topology) changes them in place
        # between here and that use. Rewires and loads build it, for compiled code, at once.
        self._topology: Topology | None = None
        self._topology_key: tuple | None = None  # what _topology was built from (see topology)
        # the sparsity of a layer built on the meta device, whose topology reset_parameters() draws
        # once it is materialised (to_empty); None once it has one
        self._undrawn_sparsity: float | None = None

    # ------------------------------------------------------------------ constructors

    @classmethod
    def _from_parts(cls, in_features, out_features, row, col, values, bias) -> SparseLinear:
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._init_state(in_features, out_features, row, col, values, bias)
        return layer

    @classmethod
    def from_dense(
        cls, linear_or_weight: nn.Linear | Tensor, *, sparsity: float | None = None, bias: Tensor | None = None
    ) -> SparseLinear:
        """A sparse layer holding the non-zeros of a dense layer or weight.

        Args:
            linear_or_weight: an ``nn.Linear`` (its weight and bias are used) or an
                ``(out_features, in_features)`` weight tensor.
            sparsity: ``None`` keeps every non-zero; a float in ``[0, 1)`` keeps the
                largest-magnitude ``round((1 - sparsity) · out · in)`` weights.
            bias: ``(out_features,)`` bias, only with a weight tensor.

        The result lives on the weight's device and dtype; parameters are copies.
        """
        if isinstance(linear_or_weight, nn.Linear):
            if bias is not None:
                raise ValueError("bias must not be given with an nn.Linear; its own bias is used")
            if linear_or_weight._forward_pre_hooks:
                raise ValueError(
                    f"linear_or_weight: {PRE_HOOKS_REASON}; remove them first (e.g. prune.remove(linear, 'weight'))"
                )
            weight, bias = linear_or_weight.weight, linear_or_weight.bias
        elif isinstance(linear_or_weight, Tensor):
            weight = linear_or_weight
        else:
            raise TypeError(f"linear_or_weight must be an nn.Linear or a Tensor, got {type(linear_or_weight).__name__}")
        _reject_meta(weight.device)
        row, col, values = coo_from_dense(weight, sparsity)
        out_features, in_features = weight.shape
        bias = _copied_bias(bias, out_features, weight.dtype)
        return cls._from_parts(in_features, out_features, row, col, values, bias)

    @classmethod
    def from_coo(
        cls,
        row: Tensor,
        col: Tensor,
        values: Tensor,
        shape: tuple[int, int],
        *,
        bias: Tensor | None = None,
    ) -> SparseLinear:
        """A sparse layer from explicit coordinates.

        Args:
            row, col: ``(nnz,)`` integer coordinates, in any order, without duplicates.
            values: ``(nnz,)`` floating weights matching ``row``/``col``.
            shape: ``(out_features, in_features)``.
            bias: optional ``(out_features,)`` bias.
        """
        out_features, in_features = check_shape_pair(shape)
        for tensor in (row, col, values):
            if isinstance(tensor, Tensor):
                _reject_meta(tensor.device)
        validate_coo(row, col, (out_features, in_features), require_sorted=False)
        _check_values(values, row)
        row, col, values = sort_coo(row, col, in_features, values.detach().clone())
        bias = _copied_bias(bias, out_features, values.dtype)
        return cls._from_parts(in_features, out_features, row, col, values, bias)

    def reset_parameters(self) -> None:
        """Re-draw ``values`` and ``bias`` with the variance-preserving rule (class docstring).

        A layer built on the meta device and materialised since (``to_empty``) first draws its
        topology: ``nnz`` uniformly random connections, as the constructor draws them elsewhere.
        (Otherwise the topology is kept.)"""
        if self._undrawn_sparsity is not None and self.row.device.type != "meta":
            shape = (self.out_features, self.in_features)
            row, col = self._random_topology(*shape, self._undrawn_sparsity, self.row.device)
            self._copy_topology_in(row, col)
        fan_in = max(1.0, self.nnz / self.out_features)
        with torch.no_grad():
            self.values.uniform_(-1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
            if self.bias is not None:
                bound = 1 / math.sqrt(self.in_features)
                self.bias.uniform_(-bound, bound)

    def _random_nnz(self, out_features: int, in_features: int, sparsity: float) -> int:
        """How many connections :meth:`_random_topology` draws (what a layer built on the meta
        device holds room for)."""
        return nnz_for_sparsity(out_features, in_features, sparsity)

    def _random_topology(
        self, out_features: int, in_features: int, sparsity: float, device: torch.device
    ) -> tuple[Tensor, Tensor]:
        """``(row, col)`` of the constructor's uniformly random topology (drawn by
        :meth:`reset_parameters` for a layer built on the meta device)."""
        return random_coo(out_features, in_features, sparsity, device=device)

    # ------------------------------------------------------------------ topology

    @property
    def nnz(self) -> int:
        """Number of stored connections (the length of ``row``, ``col`` and ``values``)."""
        return self.row.numel()

    @property
    def sparsity(self) -> float:
        """Actual fraction of zero connections."""
        return 1.0 - self.nnz / (self.out_features * self.in_features)

    @property
    def topology(self) -> Topology:
        """The current coordinates with their cached derived data.

        The cache follows ``row`` and ``col``: it is rebuilt, and the coordinates validated,
        whenever they are other tensors or were changed in place since it was built (a buffer
        copy by DDP, ``AveragedModel``, ``torch.func.functional_call``, ``copy_`` of another
        layer's buffers), so a layer always computes with its own coordinates, or raises
        ``ValueError`` if they are not valid. (Inference tensors carry no version counter: one
        changed in place under ``torch.inference_mode`` is not noticed.)
        """
        # the key before the topology: a rebuild in another thread stores them in the other order,
        # so a new key is never paired with an old topology
        key, cached = self._topology_key, self._topology
        row, col = self.row, self.col
        if cached is None and self._undrawn_sparsity is not None:
            self._refuse_undrawn_topology()
        if tracing.program_tracing():
            # The program calls snack::topology_index_data, which derives the index data from the
            # row/col it is run with, cached on their identity and version: right for whatever
            # row/col the program holds (a snapshot of this cache went stale, e.g. after
            # AveragedModel copied buffers in place), fast from the second call (deriving them in
            # the graph sorted the columns on every call: 38 against 0.6 ms eager at 4096², B=1),
            # and the two traces torch.jit.trace compares record the same op.
            return tracing.traced_topology(row, col, (self.out_features, self.in_features))
        if torch.compiler.is_compiling():
            # Dynamo cannot trace is_inference() or version counters: compiled code follows other
            # row/col tensors (functional_call) and the explicit resets (set_topology,
            # load_state_dict, .to()), not in-place changes of the buffers
            if cached is None or cached.row is not row or cached.col is not col:
                cached = self._topology = Topology(row, col, (self.out_features, self.in_features), validate=False)
                self._topology_key = None  # eager code rebuilds and validates its own
            return cached
        if cached is not None and _built_from(key, row, col):
            return cached
        if _is_batched(row) or _is_batched(col):
            raise ValueError(
                "SparseLinear: vmap over a layer's topology (row/col) is not supported; an ensemble's members "
                "must share one topology: vmap over the parameters only and pass the buffers unbatched "
                "(in_dims=None), e.g. torch.func.stack_module_state's params with one member's buffers"
            )
        with locking.STATE_LOCK:  # rebuilds see the current row/col, one at a time: none stores a stale topology
            key, cached, row, col = self._topology_key, self._topology, self.row, self.col
            if cached is None or not _built_from(key, row, col):
                try:
                    cached = Topology(row, col, (self.out_features, self.in_features))
                except (ValueError, TypeError) as error:
                    raise type(error)(
                        f"{self._sizes_repr()}: its row/col buffers are not a valid "
                        f"topology ({error}); they were changed or replaced (after to_empty() they hold uninitialised "
                        "memory: load a state_dict or call set_topology)"
                    ) from error
                self._topology = cached
                self._topology_key = _buffers_key(row, col)
            return cached

    def _sizes_repr(self) -> str:
        """The layer as its constructor's sizes, for messages: ``SparseLinear(in, out)``."""
        return f"{type(self).__name__}({self.in_features}, {self.out_features})"

    @property
    def growth_topology(self) -> Topology:
        """The topology whose inactive positions growth may take: :attr:`topology`, and for a
        :class:`SparseEmbedding` with ``padding_idx`` its padding row as if full (a connection
        there would never train). DST algorithms grow among its inactive positions
        (:func:`snack.dst.random_grow`, :func:`snack.dst.gradient_grow`)."""
        topology = self.topology
        rows = self._ungrowable_rows()
        if not rows:
            return topology
        device, width = topology.row.device, self.in_features
        rows_parts, col_parts, done = [], [], 0
        for r in sorted(rows):  # each row's connections replaced by every position of it
            first, last = topology.rowptr[r : r + 2].tolist()
            rows_parts += [topology.row[done:first], torch.full((width,), r, dtype=torch.int32, device=device)]
            col_parts += [topology.col[done:first], torch.arange(width, dtype=torch.int32, device=device)]
            done = last
        rows_parts.append(topology.row[done:])
        col_parts.append(topology.col[done:])
        return Topology(torch.cat(rows_parts), torch.cat(col_parts), topology.shape, validate=False)

    def _ungrowable_rows(self) -> tuple[int, ...]:
        """Rows no connection may grow into (a :class:`SparseEmbedding`'s padding row)."""
        return ()

    def _growable_count(self) -> int:
        """How many positions growth may take: the inactive ones of :attr:`growth_topology`,
        counted from the row pointer rather than by building it."""
        free = self.out_features * self.in_features - self.nnz
        rows = self._ungrowable_rows()
        if rows:
            rowptr = self.topology.rowptr
            free -= sum(self.in_features - int(rowptr[r + 1] - rowptr[r]) for r in rows)
        return free

    def _refuse_undrawn_topology(self) -> None:
        where = "on the meta device" if self.row.device.type == "meta" else "materialised by to_empty()"
        raise RuntimeError(
            f"{self._sizes_repr()} was built on the meta device and has no "
            f"topology yet ({where}): after model.to_empty(device=...), call reset_parameters() to draw one (e.g. "
            "model.apply(lambda m: m.reset_parameters() if hasattr(m, 'reset_parameters') else None)) or "
            "load_state_dict() a saved one"
        )

    def index_tensors(self) -> list[Tensor]:
        """Every index tensor the layer holds now, for memory accounting: ``row``, ``col``, what
        its topology has derived so far (pointers, column order) and what backends have cached
        from those (e.g. the CPU's 16-bit columns, once a batch-1 forward ran)."""
        derived = self._topology.derived_so_far() if self._topology is not None else []
        return [self.row, self.col, *derived, *held(self.row, self.col, *derived)]

    def indices(self) -> Tensor:
        """``(2, nnz)`` int64 tensor of ``[row; col]``, as ``torch.sparse_coo_tensor`` takes them."""
        return torch.stack([self.row, self.col]).long()

    @torch.no_grad()
    def set_topology(self, row: Tensor, col: Tensor, values: Tensor | None = None) -> None:
        """Replace the connections (used by dynamic sparse training).

        Args:
            row, col: ``(nnz',)`` sorted unique coordinates; ``nnz'`` may differ from ``nnz``.
            values: ``(nnz',)`` new weights; zeros when ``None``.

        The ``values`` Parameter object is kept (its data is replaced) so optimizers still hold
        it; its ``.grad`` is cleared, as it belonged to the old connections. Optimizer state is
        not touched here: per-element state (momentum, Adam's moments) then still has the old
        connections' order and size, and an optimizer step with it fails or mixes connections.
        With an optimizer, rewire through :func:`snack.dst.rewire` (which remaps that state), or
        clear the state of ``values`` (``optimizer.state.pop(layer.values, None)``).
        ``row``, ``col`` and ``values`` are copied, and
        are normal tensors even when this is called under ``torch.inference_mode`` (the layer
        must still train). On bad input nothing changes.
        """
        with torch.inference_mode(False):
            self._commit_topology(self._prepare_topology(row, col, values))

    def _prepare_topology(
        self, row: Tensor, col: Tensor, values: Tensor | None, *, made_for_it: bool = False
    ) -> _NewTopology:
        """Check a new topology and make every tensor :meth:`_commit_topology` needs (the
        allocations that may fail), changing nothing. ``made_for_it=True``: the caller
        (:func:`snack.dst.rewire`) made ``row``/``col``/``values`` for this, valid by
        construction (int32, sorted, unique, in range) and aliasing nothing: they are neither
        validated again nor copied."""
        if not made_for_it:
            validate_coo(row, col, (self.out_features, self.in_features))
        if row.device != self.values.device:
            raise ValueError(f"row/col must be on the layer's device {self.values.device}, got {row.device}")
        if values is None:
            values = self.values.new_zeros(row.numel())
        _check_values(values, row)
        if values.dtype != self.values.dtype or values.device != self.values.device:
            raise ValueError(
                f"values must be {self.values.dtype} on {self.values.device}, got {values.dtype} on {values.device}"
            )
        row, col = row.to(torch.int32, copy=not made_for_it), col.to(torch.int32, copy=not made_for_it)
        values = values.detach() if made_for_it else values.detach().clone()
        return _NewTopology(row, col, values, _data_swap(self.values, values), self._derived_topology(row, col))

    def _derived_topology(self, row: Tensor, col: Tensor) -> Topology:
        """The topology of validated ``row``/``col`` with all its index data derived: what a
        forward would build, built ahead by whatever installs them, so that compiled code finds
        it cached (deriving it there broke the graph at every layer, and each layer's recompiles
        soon hit Dynamo's limit)."""
        topology = Topology(row, col, (self.out_features, self.in_features), validate=False)
        topology.tensors()
        return topology

    def _commit_topology(self, new: _NewTopology) -> None:
        """Install a prepared topology: only reference swaps, nothing that allocates, so a
        multi-layer update (snack.dst) cannot stop half-way."""
        with locking.STATE_LOCK:  # forwards in other threads see all of the change or none (_consistent_state)
            self.row, self.col = new.row, new.col
            _replace_data(self.values, new.values, new.swap)
            self._topology, self._topology_key = new.topology, _buffers_key(new.row, new.col)
            self._undrawn_sparsity = None

    def _apply(self, fn, recurse=True):
        # .to()/.cuda() replace buffers: derived index data must follow (eager code would notice
        # on its own, traced code would not)
        row, col = self.row, self.col
        module = super()._apply(fn, recurse)
        if self.row.dtype != torch.int32:
            # nn.Module.type(dtype) casts integer buffers too (float16 would even round them):
            # the coordinates stay int32, on the device fn chose
            self.row, self.col = row.to(self.row.device), col.to(self.col.device)
        if self.row is not row or self.col is not col:  # kept by .float(), .to(its own device)
            self._topology = None
        return module

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name != "weight":
                raise
        raise AttributeError(self._no_weight_message())

    def _no_weight_message(self) -> str:
        """Why reading ``.weight`` fails, for code written for ``nn.Linear`` (loggers,
        ``nn.TransformerEncoderLayer``'s eval fast path)."""
        return (
            "SparseLinear has no dense weight: it holds `values` at (`row`, `col`); `to_dense()` builds the "
            "(out_features, in_features) weight, snack.densify(model) turns the layers back into nn.Linear. "
            "(nn.TransformerEncoderLayer reads .weight in its eval fast path: "
            "torch.backends.mha.set_fastpath_enabled(False) turns it off.)"
        )

    # ------------------------------------------------------------------ forward

    def forward(self, input: Tensor) -> Tensor:
        """``input (*, in_features)`` → ``(*, out_features)`` (a 1-D input gives a 1-D output), in
        the layer's dtype: the input must have it (as for ``nn.Linear``; cast it, or the layer with
        ``.to(dtype)``), except inside ``torch.autocast``, which casts both."""
        if tracing.fx_symbolic_tracing():
            return self._fx_forward(input)
        if not isinstance(input, Tensor):
            raise TypeError(f"SparseLinear expects a Tensor input, got {type(input).__name__}")
        if input.dim() == 0 or self._width_differs(input):
            raise ValueError(
                f"SparseLinear(in_features={self.in_features}): input must have shape (*, {self.in_features}), "
                f"got {tuple(input.shape)}"
            )
        return self._product(input)

    def _product(self, input: Tensor) -> Tensor:
        """``input (*, width)`` times the weight, plus the bias: the forward of an input of the
        width :meth:`_kernel_topology` takes (checked by the caller)."""
        x, cast_values, bias, values, topology = self._checked_operands(input)
        return _sparse_linear(x, cast_values, self._kernel_topology(topology), bias, values)

    def _checked_operands(self, input: Tensor) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Topology]:
        """``(x, cast values, bias, values, topology)`` for a forward of ``input``: one consistent
        state of the layer (:meth:`_consistent_state`), ``x``, ``values`` and ``bias`` as
        ``torch.autocast`` casts them (:func:`autocast_inputs`); raises where the input's device or
        dtype, or the parameters' shapes, do not fit."""
        values, bias, topology = self._consistent_state()
        if input.device != values.device:
            raise ValueError(f"{type(self).__name__}: input is on {input.device} but the layer is on {values.device}")
        if torch._C._get_tracing_state() is None and (  # torch.jit.trace sees nnz as a tensor: a TracerWarning
            values.shape != (topology.nnz,) or (bias is not None and bias.shape != (self._bias_features,))
        ):
            # parameters put in by assignment or torch.func.functional_call: the kernels trust shapes
            raise ValueError(
                f"{type(self).__name__}: values must have shape ({topology.nnz},) (one per connection) and bias "
                f"({self._bias_features},), got {tuple(values.shape)} and "
                f"{None if bias is None else tuple(bias.shape)}"
            )
        x, cast_values, bias = autocast_inputs(input, values, bias)
        if x.dtype != cast_values.dtype:
            under = " under autocast" if cast_values is not values else ""
            # a layer of integer (or complex) values is nothing the kernels compute: suggest none
            or_the_layer = f" or the layer (layer.to({x.dtype}))" if x.dtype.is_floating_point else ""
            raise TypeError(
                f"{type(self).__name__}: input dtype {x.dtype} does not match the layer's {cast_values.dtype}{under}; "
                f"cast the input (x.to({cast_values.dtype})){or_the_layer}"
            )
        return x, cast_values, bias, values, topology

    @property
    def _bias_features(self) -> int:
        """Length of the bias: ``out_features`` (a transposed convolution's: its output channels)."""
        return self.out_features

    @property
    def _rows_width(self) -> int:
        """Width of the rows the kernels multiply: ``in_features`` (a convolution's im2col rows:
        ``in_channels · kh · kw``, :meth:`_rows_of_record`)."""
        return self.in_features

    def _kernel_topology(self, topology: Topology) -> Topology:
        """The topology the kernels compute with, of the layer's ``topology``: itself (a grouped
        convolution's spans all its input channels, :class:`SparseConv2d`)."""
        return topology

    def _width_differs(self, input: Tensor) -> bool:
        if torch._C._get_tracing_state() is None:
            return input.shape[-1] != self.in_features
        # torch.jit.trace records the width as a tensor, and warns that this check (which only
        # raises, for the example input) is not in the trace; it need not be
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            return bool(input.shape[-1] != self.in_features)

    def _fx_forward(self, input, *args):
        """The forward ``torch.fx.symbolic_trace`` records: one call of this layer's ``forward``,
        which the program reaches through the layer itself (a ``get_attr`` node), so it computes
        with the layer's connections of the moment, after rewires too. (The tracer has run the
        layer's hooks, and records them around that call, as for any module it enters.) The traced
        root, or a layer the root does not hold, records one call on its tensors instead."""
        # the tracer: the input's, or (a buffer, a tensor made in forward) the values', which
        # tracing turns into a Proxy (a get_attr node, left unused then)
        proxy = input if isinstance(input, torch.fx.Proxy) else self.values
        layer = tracing.fx_module_reference(self, proxy.tracer if isinstance(proxy, torch.fx.Proxy) else None)
        if layer is not None:
            return tracing.fx_layer_forward(layer, input, *args)
        return self._fx_root_forward(input, *args)

    def _fx_root_forward(self, input):
        """What ``torch.fx.symbolic_trace`` records for a layer it cannot reach by a path (the root):
        one call on the layer's tensors."""
        shape = (self.out_features, self.in_features)
        return tracing.fx_sparse_linear(input, self.values, self.bias, self.row, self.col, *shape)

    # ------------------------------------------------------------------ rows for RigL

    def _register_recording_hook(self, hook) -> RemovableHandle:
        """Register ``hook(layer, args, kwargs, output)`` where RigL records a call's input and
        output: a forward hook, run first (before any user hook rescales the output or changes it
        in place). A bag layer records its lookups instead (:class:`SparseEmbeddingBag`)."""
        return self.register_forward_hook(hook, with_kwargs=True, prepend=True)

    def _record_of_input(self, x: Tensor) -> Tensor:
        """What RigL keeps of an input ``x (*, in_features)``, a copy: here its rows ``(N,
        in_features)``, which the layer multiplies by the weight (a convolution keeps less)."""
        return x.reshape(-1, self.in_features).clone()

    def _rows_of_record(self, record: Tensor) -> Tensor:
        """The rows ``(N, in_features)`` of an input :meth:`_record_of_input` kept (here the record
        itself): ``dYᵀ·rows`` is the weight gradient."""
        return record

    def _rows_of_output(self, y: Tensor) -> Tensor:
        """An output (or its gradient) ``(*, out_features)`` → ``(N, out_features)``, row for row
        with :meth:`_rows_of_record`."""
        return y.reshape(-1, self.out_features)

    def _record_of_output_gradient(self, dy: Tensor) -> Tensor:
        """What RigL keeps of an output's gradient: its rows (:meth:`_rows_of_output`)."""
        return self._rows_of_output(dy)

    @property
    def _output_width(self) -> int:
        """Width of the output's rows (:meth:`_rows_of_output`): ``out_features`` (an embedding's:
        its ``embedding_dim``)."""
        return self.out_features

    def _empty_records(self, values: Tensor) -> tuple[Tensor, Tensor]:
        """``(X, dY)`` of no rows, as :meth:`_operands_of_records` gives them, on ``values``' device
        and dtype (what a rank that recorded nothing contributes)."""
        return values.new_empty(0, self._rows_width), values.new_empty(0, self.out_features)

    def _random_initial_values(self, count: int, generator: torch.Generator) -> Tensor:
        """``(count,)`` float64 draws of the layer's initial distribution, ``U(-1/√fan_in,
        1/√fan_in)`` with ``fan_in = nnz / out_features`` (class docstring), from ``generator``: the
        values of connections grown with ``grow_init="random"``."""
        bound = 1.0 / math.sqrt(max(1.0, self.nnz / self.out_features))
        return (torch.rand(count, generator=generator, dtype=torch.float64) * 2 - 1) * bound

    def _operands_of_records(self, input_record: Tensor, gradient_record: Tensor) -> tuple[Tensor, Tensor]:
        """``(X, dY)`` as :func:`snack.dst.gradient_grow` scores them, of one call's records
        (:meth:`_record_of_input`, :meth:`_record_of_output_gradient`): here the records themselves
        (a transposed convolution's swap roles)."""
        return input_record, gradient_record

    def _consistent_state(self) -> tuple[Tensor, Tensor | None, Topology]:
        """``(values, bias, topology)`` of one complete state of the layer, for a forward.

        Another thread may rewire the layer meanwhile (a DST step, ``set_topology``, a
        ``load_state_dict`` of another nnz; they hold the same lock): a forward sees the
        connections from before or after, never a mix (it saw a mix, and spurious validation
        errors). Without autograd, ``values`` comes as a detached alias, which keeps the
        snapshot's storage alive when a rewire replaces the Parameter's data (the kernel read
        freed memory: wrong outputs, or a segfault). With autograd, the graph needs the Parameter
        itself: a layer is trained in the thread that rewires it. Compiled and traced code skip
        this (Dynamo cannot trace a lock).
        """
        if torch.compiler.is_compiling() or torch._C._get_tracing_state() is not None:
            return self.values, self.bias, self.topology
        with locking.STATE_LOCK:
            values = self.values
            # the cached topology when it is current (what the topology property would return,
            # without its checks for compiling and tracing, made above)
            key, topology, buffers = self._topology_key, self._topology, self._buffers
            if topology is None or not _built_from(key, buffers["row"], buffers["col"]):
                topology = self.topology
            if not torch.is_grad_enabled() and not transforms_active():
                values = values.detach()
        return values, self.bias, topology

    # ------------------------------------------------------------------ conversion

    def to_dense(self) -> Tensor:
        """The ``(out_features, in_features)`` dense weight (differentiable in ``values``)."""
        dense = self.values.new_zeros(self.out_features * self.in_features)
        # in place: an out-of-place index_put would hold a second dense copy at its peak
        return dense.index_put_((self._flat_index(),), self.values).view(self.out_features, self.in_features)

    def _write_dense_into(self, weight: Tensor) -> None:
        """Write the dense weight into ``weight`` in place: zeros, and ``values`` at the
        connections (``weight`` is contiguous, of ``to_dense()``'s shape or size)."""
        with torch.no_grad():
            weight.zero_().view(-1).index_put_((self._flat_index(),), self.values)

    def _flat_index(self) -> Tensor:
        """``(nnz,)`` int64: each connection's position in the row-major flattened weight."""
        return linear_positions(self.row, self.col, self.in_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, nnz={self.nnz}, "
            f"sparsity={self.sparsity:.4f}, bias={self.bias is not None}"
        )

    # ------------------------------------------------------------------ serialisation

    def get_extra_state(self) -> Tensor:
        """``[format version, out_features, in_features]`` as an int64 tensor (a tensor, so that
        tensor-only formats such as safetensors can hold the state_dict)."""
        return torch.tensor([_STATE_VERSION, self.out_features, self.in_features], dtype=torch.int64)

    def set_extra_state(self, state) -> None:
        pass  # checked in _load_from_state_dict, before anything changes

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        """Load a topology of any nnz: resize ``row``/``col``/``values`` first, then let
        ``nn.Module`` copy. ``row``, ``col`` and ``values`` load together or not at all (some of them
        without the others is an error, also with ``strict=False``); ``_extra_state`` (the shape
        check) is optional. On any error the layer is left untouched. Under
        ``torch.inference_mode`` the new tensors are still normal ones (the layer must train),
        except in a layer built there, whose inference tensors only load in inference mode (as
        ``nn.Linear``'s: they take no in-place copy outside it)."""
        inference_layer = any(p is not None and p.is_inference() for p in (self.values, self.bias))
        if inference_layer and not torch.is_inference_mode_enabled():
            error_msgs.append(
                f"While loading SparseLinear {prefix or '(root)'}: its parameters are inference tensors (it was built "
                "under torch.inference_mode), which can only be loaded under torch.inference_mode"
            )
            return
        with torch.inference_mode(inference_layer):
            self._load_topology(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def _load_topology(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        keys = {name: prefix + name for name in ("row", "col", "values", "_extra_state")}
        missing = [keys[name] for name in ("row", "col", "values") if keys[name] not in state_dict]
        if len(missing) == 3:  # none of the topology: nn.Module reports it and loads the bias
            return super()._load_from_state_dict(
                state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
            )
        if missing:  # part of a topology is not one: an error even with strict=False, where
            # missing keys pass silently (a loader that feeds one shard of a checkpoint at a time
            # left the layer unloaded without a word)
            missing_keys.extend(missing)
            present = [key for key in (keys["row"], keys["col"], keys["values"]) if key not in missing]
            error_msgs.append(
                f"While loading SparseLinear {prefix or '(root)'}: the state_dict holds {', '.join(present)} but not "
                f"{', '.join(missing)}; a layer's row, col and values load together (merge a sharded checkpoint "
                "before loading it)"
            )
            return
        if keys["_extra_state"] not in state_dict:  # optional: nn.Module must not call it missing
            state_dict = {**state_dict, keys["_extra_state"]: self.get_extra_state()}
        try:
            row, col, values = self._checked_state(state_dict, keys, prefix + "bias")
        except (ValueError, TypeError) as error:
            error_msgs.append(f"While loading SparseLinear {prefix or '(root)'}: {error}")
            return
        self._install_loaded_topology(row, col, values, local_metadata)
        # row/col now match; nn.Module copies them again (cheap) and copies values and bias
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        if self.row.dtype != torch.int32:  # load_state_dict(assign=True) put the state_dict's own tensors
            self.row, self.col = self.row.to(torch.int32), self.col.to(torch.int32)

    def _checked_state(self, state_dict, keys: dict[str, str], bias_key: str) -> tuple[Tensor, Tensor, Tensor]:
        """``(row, col, values)`` of a state_dict entry, checked to fit this layer (shape,
        coordinates, and that nn.Module's copies of values and bias will succeed: once row/col
        change, nothing may fail). Raises ``ValueError``/``TypeError``, changing nothing."""
        expected_shape = (self.out_features, self.in_features)
        saved_shape = _saved_shape(state_dict[keys["_extra_state"]])
        if saved_shape != expected_shape:
            raise ValueError(f"the state_dict is of a {saved_shape} layer, this layer is {expected_shape}")
        row, col, values = state_dict[keys["row"]], state_dict[keys["col"]], state_dict[keys["values"]]
        validate_coo(row, col, expected_shape)
        _check_values(values, row)
        copies = [("values", values, self.values)]
        if self.bias is not None and bias_key in state_dict:
            _check_bias(state_dict[bias_key], self._bias_features)
            copies.append(("bias", state_dict[bias_key], self.bias))
        for name, source, target in copies:
            try:
                source.to(device=target.device, dtype=target.dtype)
            except (RuntimeError, NotImplementedError) as error:
                raise ValueError(f"{name} cannot be copied into the layer ({target.dtype} on {target.device}): {error}")
        return row, col, values

    def _install_loaded_topology(self, row: Tensor, col: Tensor, values: Tensor, local_metadata: dict) -> None:
        """Make ``row``/``col`` (checked) the layer's, and give ``values`` their size, before
        ``nn.Module`` copies the state in."""
        if row.numel() == self.nnz and self._buffers_writable_in_place(local_metadata):
            # the same nnz: row/col are copied in place, as nn.Module copies every buffer and
            # parameter (values, bias below), so whatever holds them follows the load (a traced
            # or FX module); a forward in another thread meanwhile may read some new values or
            # coordinates (the README's Limits)
            row = row.to(device=self.row.device, dtype=torch.int32)
            col = col.to(device=self.col.device, dtype=torch.int32)
            self._copy_topology_in(row, col)
        else:
            # another nnz: new tensors, the values filled before a forward in another thread can
            # see them, swapped under the lock (held only for that: nn.Module's copies and load
            # hooks run without it)
            values = values.detach().to(self.values, copy=True)
            # assign=True: nn.Module then puts in the state_dict's own tensors, on their device (a
            # layer on the meta device, which cannot derive index data, takes real ones so)
            assigned = local_metadata.get("assign_to_params_buffers", False)
            device = row.device if assigned else self.row.device
            row = row.to(device=device, dtype=torch.int32, copy=True)
            col = col.to(device=device, dtype=torch.int32, copy=True)
            self._commit_topology(
                _NewTopology(row, col, values, _data_swap(self.values, values), self._derived_topology(row, col))
            )

    @torch.no_grad()
    def _copy_topology_in(self, row: Tensor, col: Tensor) -> None:
        """Copy valid ``row``/``col`` (int32, on the layer's device, ``nnz`` each) into the
        layer's buffers, whose identity whatever holds them keeps (a traced program, DDP), and
        build their index data at once (compiled code finds it cached)."""
        with locking.STATE_LOCK:  # a topology rebuild (which validates) sees all of row/col or none
            self.row.copy_(row)
            self.col.copy_(col)
            self._topology = self._derived_topology(self.row, self.col)
            self._topology_key = _buffers_key(self.row, self.col)
            self._undrawn_sparsity = None

    def _buffers_writable_in_place(self, local_metadata: dict) -> bool:
        """Whether a load may copy into ``row``/``col``: not when ``nn.Module`` assigns the
        state_dict's own tensors (``assign=True``: it replaces ``values`` too), nor into buffers a
        copy cannot fill (inference tensors outside inference mode, expanded ones, ``row`` and
        ``col`` in one storage)."""
        row, col = self.row, self.col
        return not (
            local_metadata.get("assign_to_params_buffers", False)
            or row.is_inference() or col.is_inference()
            or not (row.is_contiguous() and col.is_contiguous())
            or row.untyped_storage().data_ptr() == col.untyped_storage().data_ptr() and row.numel() > 0
        )

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_topology"] = state["_topology_key"] = None  # derived data is rebuilt on demand
        return state

    def __setstate__(self, state):
        state.setdefault("_topology_key", None)  # pickled before the key existed
        state.setdefault("_undrawn_sparsity", None)
        super().__setstate__(state)



# torch.fx.symbolic_trace of a layer as the root annotates the program's input with forward's
# annotations; as strings (this module's `from __future__ import annotations`) they made the
# GraphModule's code hold `_Tensor_ = 'Tensor'`, and pickling it failed
SparseLinear.forward.__annotations__ = {"input": Tensor, "return": Tensor}


def _is_batched(tensor: Tensor) -> bool:
    """Whether ``tensor`` is vmapped (a ``torch.func.vmap`` BatchedTensor)."""
    return torch._C._functorch.is_batchedtensor(tensor)


def _reject_meta(device: torch.device) -> None:
    """Raise for the meta device in ``from_dense`` and ``from_coo``: they keep the largest weights
    or the given coordinates, data that a meta tensor does not hold."""
    if device.type == "meta":
        raise NotImplementedError(
            "from_dense/from_coo cannot take meta tensors: they keep the largest weights or the given "
            "coordinates, which a meta tensor does not hold. On the meta device build the layer with its "
            "constructor, or sparsify(model, init='random'): to_empty() and reset_parameters() then draw its "
            "topology; or sparsify the model after materialising it."
        )


def _saved_shape(extra) -> tuple[int, ...]:
    """The layer shape an ``_extra_state`` entry records: ``[version, out, in]`` (format 2) or a
    ``{"version": 1, "shape": ...}`` dict (format 1)."""
    if isinstance(extra, Tensor) and extra.device.type == "meta":
        raise ValueError("_extra_state is on the meta device: a state_dict loaded with map_location='meta' holds no data")
    if isinstance(extra, Tensor) and extra.shape == (3,):
        if int(extra[0]) != _STATE_VERSION:
            raise ValueError(
                f"_extra_state is of format version {int(extra[0])}; this snack reads versions 1 and {_STATE_VERSION}"
            )
        return tuple(int(v) for v in extra[1:])
    if isinstance(extra, dict) and "shape" in extra:
        return tuple(extra["shape"])
    raise ValueError(f"_extra_state must be [version, out_features, in_features], got {extra!r}")


def _version(tensor: Tensor) -> int | None:
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor has no version counter
        return None


def _buffers_key(row: Tensor, col: Tensor) -> tuple:
    """``(row, col, their version counters)``: what a cached topology was built from."""
    return row, col, _version(row), _version(col)


def _built_from(key: tuple | None, row: Tensor, col: Tensor) -> bool:
    """Whether ``key`` names these very ``row``/``col`` tensors, unchanged in place since."""
    return key is not None and key[0] is row and key[1] is col and key[2:] == (_version(row), _version(col))


class _NewTopology(NamedTuple):
    """A checked topology, ready for :meth:`SparseLinear._commit_topology`."""

    row: Tensor  # (nnz',) int32
    col: Tensor  # (nnz',) int32
    values: Tensor  # (nnz',) the layer's dtype and device
    swap: Tensor | None  # what _replace_data assigns first (see _data_swap)
    topology: Topology  # of row/col, its index data derived (compiled code then finds them cached)


def _data_swap(param: nn.Parameter, data: Tensor) -> Tensor | None:
    """What :func:`_replace_data` must assign to ``param.data`` before ``data``: ``None`` when
    the shape stays, else an empty tensor of another dtype.

    Autograd caches one gradient accumulator per leaf, holding the leaf's shape, for as long as
    any earlier graph is alive (e.g. the previous step's ``loss``); the next backward would then
    reject a gradient of the new size. Assigning ``.data`` of another dtype drops that cache
    (``VariableHooks::set_data``), hence the detour (made ahead, so the swap itself allocates nothing).
    """
    if data.shape == param.shape:
        return None
    return data.new_empty(0, dtype=torch.float32 if data.dtype == torch.float64 else torch.float64)


def _replace_data(param: nn.Parameter, data: Tensor, swap: Tensor | None) -> None:
    """Give ``param`` new data, possibly of another size, keeping the Parameter object (which
    optimizers hold) and dropping its now meaningless ``.grad``. ``swap``: :func:`_data_swap`'s."""
    # a Parameter made under inference mode has no version counter (nor a graph to protect), and
    # keeps none when given normal data
    counted = not param.is_inference()
    with torch.no_grad():
        if swap is not None:
            param.data = swap
        param.data = data
    # assigning .data keeps the version counter: bump it, so a graph recorded with the old
    # connections fails its saved-tensor check instead of back-propagating into the new ones
    if counted:
        torch.autograd.graph.increment_version(param)
    param.grad = None


def _copied_bias(bias: Tensor | None, out_features: int, dtype: torch.dtype) -> Tensor | None:
    """A detached copy of ``bias`` in ``dtype``, checked to be ``(out_features,)``."""
    if bias is None:
        return None
    _check_bias(bias, out_features)
    return bias.detach().clone().to(dtype)


def _check_bias(bias, out_features: int) -> None:
    if not isinstance(bias, Tensor) or bias.shape != (out_features,):
        got = tuple(bias.shape) if isinstance(bias, Tensor) else type(bias).__name__
        raise ValueError(f"bias must be a tensor of shape ({out_features},), got {got}")


def _check_values(values: Tensor, row: Tensor) -> None:
    if not isinstance(values, Tensor):
        raise TypeError(f"values must be a Tensor, got {type(values).__name__}")
    if not values.is_floating_point():
        raise TypeError(f"values must be floating point, got dtype {values.dtype}")
    if values.shape != (row.numel(),):
        raise ValueError(f"values must have shape ({row.numel()},) to match row/col, got {tuple(values.shape)}")
