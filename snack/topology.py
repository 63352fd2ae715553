"""The sparse format: sorted, unique COO coordinates of an ``out × in`` matrix.

A sparse weight is three flat tensors of length ``nnz``:

* ``row``, ``col`` — int32 coordinates, sorted by ``(row, col)``, no duplicates;
* ``values`` — the weights, owned by the layer as an ``nn.Parameter``.

:class:`Topology` wraps ``(row, col, shape)`` and derives, lazily and once per topology,
what the kernels need:

* ``rowptr``   ``(out + 1,)`` int32 — CSR row pointer: row ``r`` is ``[rowptr[r], rowptr[r+1])``;
* ``csc_perm`` ``(nnz,)``     int32 — positions of the non-zeros in column-major order, so that
  ``col[csc_perm]`` is sorted (the transposed SpMM walks the matrix by column without atomics);
* ``colptr``   ``(in + 1,)``  int32 — column pointer into ``csc_perm``.

The ops receive them together (:meth:`Topology.tensors`), except that a CPU topology's carry an
empty ``csc_perm`` unless it was asked for: no CPU kernel reads the column order (the transposed
SpMM walks rows there), and building it cost a sort at every rewire (36 ms at 4096², 90%) and
4 bytes per connection. The Triton kernels, which read it, derive it themselves where it is
missing (:func:`column_order`; they meet CPU tensors only under their interpreter).

A topology is immutable: changing the connections means building a new one, which is how
every cache gets cleared.

Nothing in this module allocates a tensor with ``out × in`` elements, except
:func:`coo_from_dense`, whose input already is one.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from typing import NamedTuple

import torch
from torch import Tensor

from snack.indexing import flat_nonzero, positions_where, segment_pointer
from snack.ranking import k_largest_positions, ordering_keys
from snack.sampling import sorted_sample

INDEX_DTYPE = torch.int32
# int32 coordinates and pointers: nnz and each dimension must stay below 2**31.
MAX_INDEX = 2**31 - 1

__all__ = [
    "Topology",
    "TopologyTensors",
    "check_sparsity",
    "column_order",
    "coo_from_dense",
    "coo_from_linear",
    "linear_positions",
    "random_coo",
    "validate_coo",
]


class TopologyTensors(NamedTuple):
    """The flat index tensors every sparse op receives (see module docstring for shapes;
    ``csc_perm`` may be empty on the CPU)."""

    row: Tensor
    col: Tensor
    rowptr: Tensor
    colptr: Tensor
    csc_perm: Tensor


def check_sparsity(sparsity: float, name: str = "sparsity") -> float:
    """Return ``sparsity`` as a float, or raise if it is not a number in ``[0, 1)``."""
    if isinstance(sparsity, bool) or not isinstance(sparsity, numbers.Real):  # NumPy floats too
        raise TypeError(f"{name} must be a float in [0, 1), got {type(sparsity).__name__} {sparsity!r}")
    if not (0.0 <= float(sparsity) < 1.0) or math.isnan(sparsity):
        raise ValueError(f"{name} must be in [0, 1), got {sparsity!r}")
    return float(sparsity)


def check_shape(out_features: int, in_features: int) -> None:
    for name, size in (("out_features", out_features), ("in_features", in_features)):
        if isinstance(size, bool) or not isinstance(size, numbers.Integral):  # NumPy ints too
            raise TypeError(f"{name} must be an int, got {type(size).__name__} {size!r}")
        if not 0 < size <= MAX_INDEX:
            raise ValueError(f"{name} must be in [1, {MAX_INDEX}], got {size}")


def check_shape_pair(shape, name: str = "shape") -> tuple[int, int]:
    """``shape`` as ``(out_features, in_features)`` ints, or raise if it is not two positive ints."""
    if not isinstance(shape, (tuple, list, torch.Size)) or len(shape) != 2:
        raise ValueError(f"{name} must be (out_features, in_features), got {shape!r}")
    check_shape(*shape)
    return int(shape[0]), int(shape[1])


def nnz_for_sparsity(out_features: int, in_features: int, sparsity: float) -> int:
    """Number of connections that a ``sparsity`` fraction of zeros leaves (at least 1)."""
    total = out_features * in_features
    nnz = max(1, min(total, round((1.0 - sparsity) * total)))
    if nnz > MAX_INDEX:
        raise ValueError(
            f"a {out_features}x{in_features} layer at sparsity {sparsity} would have {nnz} connections; snack's "
            f"int32 indices hold at most {MAX_INDEX}: raise the sparsity"
        )
    return nnz


def validate_coo(row: Tensor, col: Tensor, shape: tuple[int, int], *, require_sorted: bool = True) -> None:
    """Raise ``ValueError``/``TypeError`` unless ``row``/``col`` are valid unique coordinates.

    Args:
        row, col: ``(nnz,)`` integer tensors on the same device.
        shape: ``(out_features, in_features)``.
        require_sorted: also require the ``(row, col)`` order the format uses.
    """
    out_features, in_features = check_shape_pair(shape)
    for name, t in (("row", row), ("col", col)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
        if t.device.type == "meta":
            raise ValueError(f"{name} is on the meta device, which holds no coordinates")
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be an int32 or int64 tensor, got dtype {t.dtype}")
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D of shape (nnz,), got shape {tuple(t.shape)}")
    if row.numel() != col.numel():
        raise ValueError(f"row and col must have the same length, got {row.numel()} and {col.numel()}")
    if row.device != col.device:
        raise ValueError(f"row and col must be on the same device, got {row.device} and {col.device}")
    if row.numel() > MAX_INDEX:
        raise ValueError(f"nnz must be at most {MAX_INDEX}, got {row.numel()}")
    if row.numel() == 0:
        return
    for name, t, size in (("row", row, out_features), ("col", col, in_features)):
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{name} index {bad} is out of range for size {size} (expected 0 <= {name} < {size})")
    key = linear_positions(row, col, in_features)
    if not require_sorted:
        key = key.sort().values
    step = key[1:] - key[:-1]
    if bool((step == 0).any()):
        k = int((step == 0).nonzero()[0])
        raise ValueError(f"duplicate coordinate (row={int(row[k])}, col={int(col[k])}) at positions {k} and {k + 1}")
    if bool((step < 0).any()):
        k = int((step < 0).nonzero()[0])
        raise ValueError(
            f"coordinates must be sorted by (row, col); position {k + 1} "
            f"({int(row[k + 1])}, {int(col[k + 1])}) comes after ({int(row[k])}, {int(col[k])})"
        )


def sort_coo(row: Tensor, col: Tensor, in_features: int, *extra: Tensor) -> tuple[Tensor, ...]:
    """Sort coordinates by ``(row, col)``; ``extra`` tensors of length nnz are permuted alike."""
    order = torch.argsort(linear_positions(row, col, in_features))
    return (row[order].to(INDEX_DTYPE), col[order].to(INDEX_DTYPE), *(t[order] for t in extra))


def linear_positions(row: Tensor, col: Tensor, in_features: int) -> Tensor:
    """``(nnz,)`` int64 positions ``row · in_features + col`` of coordinates in the row-major
    flattened ``out × in`` matrix (sorted when the coordinates are)."""
    return row.to(torch.int64) * in_features + col.to(torch.int64)


def coo_from_linear(linear: Tensor, in_features: int) -> tuple[Tensor, Tensor]:
    """``(row, col)``, int32, of int64 row-major ``linear`` positions: the inverse of
    :func:`linear_positions`."""
    if linear.numel() and int(linear.max()) <= MAX_INDEX:
        linear = linear.to(INDEX_DTYPE)  # int32 division: 3.5x faster on the CPU (5 against 17 ms for 500k)
    return (linear // in_features).to(INDEX_DTYPE), (linear % in_features).to(INDEX_DTYPE)


# The most elements snack forms at once where it walks a layer's out × in positions in blocks
# (drawing a dense-ish topology, picking the largest weights, scoring RigL's growth): 4 MiB of
# float32, whatever the layer's size.
BLOCK_ELEMENTS = 1 << 20


def random_coo(
    out_features: int,
    in_features: int,
    sparsity: float,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """Uniformly random sorted coordinates with ``round((1 - sparsity) · out · in)`` non-zeros.

    Every set of that many positions is equally likely. Memory is O(nnz): at high sparsity the
    positions are sampled directly; below 50% sparsity the *excluded* positions are sampled and
    the kept ones enumerated in blocks of about a million elements, never the whole matrix.

    Returns:
        ``(row, col)``, each ``(nnz,)`` int32.
    """
    check_shape(out_features, in_features)
    sparsity = check_sparsity(sparsity)
    total = out_features * in_features
    k = nnz_for_sparsity(out_features, in_features, sparsity)
    if k <= total // 2:
        return coo_from_linear(sorted_sample(total, k, generator, device), in_features)

    excluded = sorted_sample(total, total - k, generator, device)
    rows_per_block = max(1, BLOCK_ELEMENTS // in_features)
    parts = []
    for first_row in range(0, out_features, rows_per_block):
        start = first_row * in_features
        stop = min(out_features, first_row + rows_per_block) * in_features
        lo, hi = torch.searchsorted(excluded, torch.tensor([start, stop], device=excluded.device)).tolist()
        keep = torch.ones(stop - start, dtype=torch.bool, device=device)
        keep[excluded[lo:hi] - start] = False
        parts.append(flat_nonzero(keep) + start)
    return coo_from_linear(torch.cat(parts), in_features)


def coo_from_dense(weight: Tensor, sparsity: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Sparse coordinates and values of a dense ``(out, in)`` weight.

    Args:
        weight: ``(out_features, in_features)`` floating tensor.
        sparsity: ``None`` keeps every non-zero; a float in ``[0, 1)`` keeps the
            ``round((1 - sparsity) · out · in)`` entries of largest magnitude (ties broken by
            position, deterministically).

    Returns:
        ``(row, col, values)``; ``values`` is a detached copy in ``weight``'s dtype.
    """
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        shape = tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(f"weight must be a 2-D tensor of shape (out_features, in_features), got {shape}")
    if not weight.is_floating_point():
        raise TypeError(f"weight must be a floating-point tensor, got dtype {weight.dtype}")
    out_features, in_features = weight.shape
    check_shape(out_features, in_features)
    flat = weight.detach().reshape(-1)
    if sparsity is None:
        linear = flat_nonzero(flat != 0)
    else:
        sparsity = check_sparsity(sparsity)
        k = nnz_for_sparsity(out_features, in_features, sparsity)
        linear = largest_magnitudes(flat, k)
    row, col = coo_from_linear(linear, in_features)
    return row, col, flat[linear].clone()


def largest_magnitudes(flat: Tensor, k: int, *, block: int = BLOCK_ELEMENTS) -> Tensor:
    """The sorted positions (int64 ``(k,)``) of the ``k`` largest ``|flat|`` of a 1-D floating
    tensor; among equal magnitudes the earlier position wins (what a stable descending sort
    picks), so the result is reproducible. NaN counts as the largest, as in ``torch.sort``.

    Memory is ``O(k + block)``, not ``O(flat.numel())``: a full sort of an 8000×8000 weight took
    about 6× the weight's memory on top of it and 15 s. Instead, the k-th largest magnitude is
    found digit by digit (a radix select): a non-negative float's bit pattern, read as an
    integer, orders as its value, so each pass counts the next 16 bits of the magnitudes that
    match the digits found so far (2 passes for float32, 4 for float64, 1 for 16-bit types), a
    block at a time. A last pass collects every position above that magnitude and the earliest
    positions equal to it.
    """
    n = flat.numel()
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, {n}], got {k}")
    if not flat.is_floating_point() or flat.element_size() not in (2, 4, 8):
        raise TypeError(f"largest_magnitudes needs a 16-, 32- or 64-bit floating tensor, got {flat.dtype}")
    if n <= block:  # one block: selected whole
        return k_largest_positions(ordering_keys(flat.abs()), k)
    bits = 8 * flat.element_size() - 1  # |x| has a zero sign bit

    def keys(start: int) -> Tensor:
        # the magnitudes' bit patterns as int64, ordered as the magnitudes
        return ordering_keys(flat[start:start + block].abs()).to(torch.int64)

    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=flat.device)
    # threshold: the k-th largest key, fixed `known` bits at a time; `ties`: how many keys equal to
    # it are kept (those above it number k - ties)
    threshold, known, ties = 0, 0, k
    while known < bits:
        width = min(16, bits - known)
        shift = bits - known - width
        counts = torch.zeros(1 << width, dtype=torch.int64, device=flat.device)
        for start in range(0, n, block):
            key = keys(start)
            if known:
                key = key[(key >> (shift + width)) == threshold]
            counts += torch.bincount((key >> shift) & ((1 << width) - 1), minlength=1 << width)
        at_or_above = counts.flip(0).cumsum(0)  # [j]: keys in the j + 1 highest digits
        j = int(torch.searchsorted(at_or_above, ties))  # the digit that holds the ties-th largest
        if j > 0:
            ties -= int(at_or_above[j - 1])
        threshold = (threshold << width) | ((1 << width) - 1 - j)
        known += width
    positions = []
    for start in range(0, n, block):
        key = keys(start)
        chosen = key > threshold
        if ties:
            equal = positions_where(key, "==", threshold)[:ties]
            chosen.index_fill_(0, equal, True)
            ties -= equal.numel()
        positions.append(flat_nonzero(chosen) + start)
    return torch.cat(positions)


class Topology:
    """Immutable sorted-COO coordinates of an ``out × in`` matrix with lazily derived data.

    Args:
        row, col: ``(nnz,)`` int32 coordinates sorted by ``(row, col)``, unique. They are held,
            not copied (as ``torch.sparse_coo_tensor`` holds its indices): changing them in place
            afterwards is undefined, since the kernels trust validated coordinates.
        shape: ``(out_features, in_features)``.
        validate: check the coordinates (one pass over them); pass ``False`` only for
            coordinates already checked (produced by this module, or validated by the caller, as
            ``SparseLinear`` does before installing them). int64 coordinates are accepted and
            converted.
    """

    __slots__ = ("row", "col", "shape", "_rowptr", "_csc_perm", "_colptr", "_tensors", "_built_by_no_grad_graph")

    def __init__(self, row: Tensor, col: Tensor, shape: tuple[int, int], *, validate: bool = True):
        shape = check_shape_pair(shape)
        if validate:
            with _outside_fake_mode():  # it reads values (e.g. FakeTensorProp running a layer)
                validate_coo(row, col, shape)
        # contiguous, as the native kernels need (no copy when they already are, as a layer's are)
        self.row = _outside_transient_modes(lambda: row.to(INDEX_DTYPE).contiguous())
        self.col = _outside_transient_modes(lambda: col.to(INDEX_DTYPE).contiguous())
        self.shape = shape
        self._rowptr: Tensor | None = None
        self._csc_perm: Tensor | None = None
        self._colptr: Tensor | None = None
        self._tensors: TopologyTensors | None = None
        self._built_by_no_grad_graph = False  # see built_by_no_grad_graph

    @classmethod
    def with_index_data(
        cls, row: Tensor, col: Tensor, shape: tuple[int, int], rowptr: Tensor, colptr: Tensor, csc_perm: Tensor
    ) -> Topology:
        """A topology whose derived data were built elsewhere (``row``/``col`` not validated here)."""
        topology = cls(row, col, shape, validate=False)
        topology._rowptr, topology._colptr, topology._csc_perm = rowptr, colptr, csc_perm
        return topology

    @property
    def nnz(self) -> int:
        return self.row.numel()

    @property
    def device(self) -> torch.device:
        return self.row.device

    @property
    def rowptr(self) -> Tensor:
        """``(out + 1,)`` int32 CSR row pointer (computed on first use)."""
        if self._rowptr is None:
            self._rowptr = _outside_transient_modes(lambda: _row_pointer(self.row, self.shape[0]))
        return self._rowptr

    @property
    def csc_perm(self) -> Tensor:
        """``(nnz,)`` int32 permutation into column-major order (computed on first use)."""
        if self._csc_perm is None:
            self._csc_perm = _outside_transient_modes(lambda: column_order(self.col, self.shape[1]))
        return self._csc_perm

    @property
    def colptr(self) -> Tensor:
        """``(in + 1,)`` int32 column pointer into :attr:`csc_perm` (computed on first use)."""
        if self._colptr is None:
            self._colptr = _outside_transient_modes(lambda: segment_pointer(self.col, self.shape[1]))
        return self._colptr

    def derived_so_far(self) -> list[Tensor]:
        """The derived index tensors built so far (for memory accounting), deriving nothing."""
        return [t for t in (self._rowptr, self._csc_perm, self._colptr) if t is not None]

    def tensors(self) -> TopologyTensors:
        """All index tensors the sparse ops take, deriving the missing ones; on the CPU an empty
        ``csc_perm`` unless it was built (module docstring)."""
        # built once (every layer call asks for them), and again for autograd after compiled code
        # built them without it (built_by_no_grad_graph)
        if self._tensors is None or (self._built_by_no_grad_graph and torch.is_grad_enabled()):
            if self._built_by_no_grad_graph:
                self._rowptr = self._colptr = self._csc_perm = None
            self._built_by_no_grad_graph = torch.compiler.is_compiling() and not torch.is_grad_enabled()
            if self._csc_perm is None and self.device.type == "cpu":
                csc_perm = _outside_transient_modes(lambda: torch.empty(0, dtype=INDEX_DTYPE, device=self.device))
            else:
                csc_perm = self.csc_perm
            self._tensors = TopologyTensors(self.row, self.col, self.rowptr, self.colptr, csc_perm)
        return self._tensors

    @property
    def built_by_no_grad_graph(self) -> bool:
        """Whether compiled code without autograd derived :meth:`tensors`: perhaps under
        ``torch.inference_mode``, where a graph's outputs are inference tensors, which a training
        step cannot save for its backward. (Dynamo can trace neither the mode nor
        ``Tensor.is_inference()``: grad mode stands for both.) :meth:`tensors` derives them again
        for autograd."""
        return self._built_by_no_grad_graph

    def to(self, device: torch.device | str) -> Topology:
        """The same coordinates on ``device`` (derived data is recomputed there on demand)."""
        return Topology(self.row.to(device), self.col.to(device), self.shape, validate=False)

    def __repr__(self) -> str:
        out_features, in_features = self.shape
        density = self.nnz / (out_features * in_features)
        return f"Topology(shape={self.shape}, nnz={self.nnz}, density={density:.4g}, device={self.device})"


def _outside_transient_modes(build) -> Tensor:
    """``build()``, as a normal tensor even inside ``torch.inference_mode``, a ``torch.func``
    transform or a ``FakeTensorMode``: the cache outlives the region. A later training step must
    be able to save it for backward (an inference tensor cannot be), a later transform must not
    meet a tensor wrapped for one that has ended (PyTorch fails an internal assert), and a later
    kernel needs real indices."""
    # (Dynamo cannot trace is_inference_mode_enabled(); a traced region is not in inference mode.)
    if torch.compiler.is_compiling():
        return build()
    with contextlib.ExitStack() as regions:
        if torch.is_inference_mode_enabled():
            regions.enter_context(torch.inference_mode(False))
        if torch._C._are_functorch_transforms_active():
            regions.enter_context(torch._C._DisableFuncTorch())
        regions.enter_context(_outside_fake_mode())
        return build()


def _outside_fake_mode() -> contextlib.AbstractContextManager:
    """A region computing with real tensors, also inside a ``FakeTensorMode`` (which shape
    propagation such as ``FakeTensorProp`` runs a layer in)."""
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None:
        return contextlib.nullcontext()
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def column_order(col: Tensor, in_features: int) -> Tensor:
    """``(nnz,)`` int32 ``csc_perm`` of sorted coordinates' ``col``: their positions in
    column-major order. Row-major order is already sorted by row, so a stable sort by column
    gives (col, row) order; of 16-bit columns where they fit (1.5x faster: 17 against 27 ms for
    1.7M)."""
    key = col.to(torch.int16) if in_features <= 1 << 15 else col
    return torch.sort(key, stable=True).indices.to(INDEX_DTYPE)


def _row_pointer(row: Tensor, out_features: int) -> Tensor:
    """``(out + 1,)`` int32 CSR row pointer of sorted ``row``: one binary search per row, not a
    count over every connection (0.4 against 4.3 ms for 1.7M connections on the CPU)."""
    rows = torch.arange(out_features + 1, dtype=INDEX_DTYPE, device=row.device)
    return torch.searchsorted(row, rows, out_int32=True)
