"""Index primitives of topology work on large position sets: native on the CPU, torch elsewhere.

Topology updates and construction compact masks into positions, find free positions by rank,
count connections per column, and merge a rewiring's kept and grown connections, over arrays as
long as the layer's connections. On the CPU, ``torch.nonzero`` took ~7 ns per entry,
``torch.searchsorted`` ~60 ns per query once the list outgrows the caches and ``torch.bincount``
3 ns per entry: a SET update of a 4096² layer at 90% spent 120 of its 250 ms in them, and its
rewiring took eleven more passes of torch calls to build the new coordinates. The native kernels
(``snack/backends/cpu/index_ops.cpp``) do the same work in one or two passes in order. They run
for CPU tensors when the native CPU backend loads; on other devices, while compiling, or where
the kernels could not be built, these functions are the torch calls they replace, with the same
results. A backend forced by :func:`snack.use_backend` other than ``"cpu"`` gets the torch calls too.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "flat_nonzero", "inactive_positions", "matching_positions", "merge_connections", "native_for", "positions_where",
    "segment_pointer", "take_or_fill",
]


def flat_nonzero(mask: Tensor) -> Tensor:
    """``(count,)`` int64 positions of the true entries of a ``(n,)`` bool ``mask``, increasing:
    ``mask.nonzero().squeeze(1)``."""
    if native_for(mask):
        return torch.ops.snack_cpu.flat_nonzero(mask)
    return mask.nonzero().squeeze(1)


def positions_where(keys: Tensor, comparison: str, bar: int | Tensor) -> Tensor:
    """``(count,)`` int64 positions, increasing, where the ``(n,)`` integer ``keys`` compare
    with ``bar`` as ``comparison`` says: ``flat_nonzero(keys >= bar)`` without the mask between.

    Args:
        comparison: ``">="``, ``">"``, ``"<="``, ``"<"`` or ``"=="``.
        bar: an int or a 0-d integer tensor, within the range of ``keys``' dtype.
    """
    compare = _COMPARISONS.get(comparison)
    if compare is None:
        raise ValueError(f"comparison must be one of {sorted(_COMPARISONS)}, got {comparison!r}")
    if keys.dtype in _INTEGER_DTYPES:
        info = torch.iinfo(keys.dtype)
        if not info.min <= int(bar) <= info.max:  # (torch would wrap it around silently)
            raise ValueError(f"bar {int(bar)} is outside the range of the keys' dtype {keys.dtype}")
        if native_for(keys):
            return torch.ops.snack_cpu.positions_where(keys, comparison, int(bar))
    return flat_nonzero(compare(keys, bar))


_COMPARISONS = {">=": torch.ge, ">": torch.gt, "<=": torch.le, "<": torch.lt, "==": torch.eq}


def inactive_positions(row: Tensor, col: Tensor, in_features: int, ranks: Tensor) -> Tensor:
    """The free positions (held by no connection) of the given ranks: random growth's draws as
    positions.

    Args:
        row, col: ``(nnz,)`` int32 coordinates, sorted by ``(row, col)`` and unique (a topology's).
        in_features: the width of a row.
        ranks: ``(k,)`` int64, non-decreasing, from 0, each below the number of free positions
            (a larger one gives a position past the last row).

    Returns:
        ``(k,)`` int64: the ``ranks[q]``-th free position (linear ``r · in + c``, from 0). On the
        CPU this is one merge-like pass over the coordinates (O(nnz + k)).

    Raises:
        RuntimeError: ranks that decrease or start below 0 (not checked in compiled code).
    """
    if native_for(row, col, ranks):
        return torch.ops.snack_cpu.inactive_positions(row, col, in_features, ranks)
    if _readable(ranks):
        _check_increasing("inactive_positions", "ranks", ranks, strictly=False)
        if ranks.numel() and int(ranks[0]) < 0:
            raise RuntimeError(f"inactive_positions: ranks must be at least 0, got {int(ranks[0])}")
    from snack.topology import linear_positions  # (snack.topology imports this module)

    # the j-th connection has linear[j] - j free positions below it; the r-th free position lies
    # above exactly the connections with at most r free ones below them
    free_below = linear_positions(row, col, in_features) - torch.arange(row.numel(), device=row.device)
    return ranks + torch.searchsorted(free_below, ranks, right=True)


def segment_pointer(index: Tensor, size: int) -> Tensor:
    """``(size + 1,)`` int32 pointer array of an ``(n,)`` int32 ``index`` with entries in
    ``[0, size)``: the entries equal to ``i`` number ``ptr[i + 1] - ptr[i]`` (a CSC column pointer
    from the columns of the connections)."""
    if native_for(index):
        return torch.ops.snack_cpu.segment_pointer(index, size)
    # counted with index_add_, not bincount, whose output size depends on the data: compiled code
    # derives a layer's pointers on its first call, and bincount broke the graph there
    counts = torch.zeros(size, dtype=torch.int32, device=index.device).index_add_(0, index, torch.ones_like(index))
    ptr = torch.zeros(size + 1, dtype=torch.int32, device=index.device)
    ptr[1:] = counts.cumsum(0)
    return ptr


def merge_connections(
    row: Tensor, col: Tensor, keep: Tensor, grow: Tensor, shape: tuple[int, int]
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The coordinates after a rewiring: the kept connections and the grown positions merged in
    row-major order.

    Args:
        row, col: ``(nnz,)`` int32 coordinates, sorted by ``(row, col)`` and unique (a topology's).
        keep: ``(nnz,)`` bool, which connections stay.
        grow: ``(k,)`` int64 linear positions ``r · in + c`` to add, increasing, in
            ``[0, out · in)``.
        shape: ``(out, in)``.

    Returns:
        ``(row', col', src, grown_slots)``: the ``(n,)`` int32 new coordinates (``n`` = kept +
        ``k``), sorted; ``(n,)`` int64 ``src``, each new connection's position in the old
        ones (``-1`` for a grown one); ``(k,)`` int64 ``grown_slots``, where ``grow[j]`` went.

    Raises:
        ValueError: a grow position is a connection that stays.
        RuntimeError: grow positions that do not increase or lie outside ``[0, out · in)`` (not
            checked in compiled code).
    """
    out_features, in_features = shape
    if native_for(row, col, keep, grow):
        return torch.ops.snack_cpu.merge_connections(row, col, keep, grow, out_features, in_features)
    if _readable(grow):
        _check_increasing("merge_connections", "grow positions", grow, strictly=True)
        if grow.numel() and not (int(grow[0]) >= 0 and int(grow[-1]) < out_features * in_features):
            raise RuntimeError(f"merge_connections: grow positions must be in [0, {out_features * in_features})")
    from snack.topology import coo_from_linear, linear_positions  # (snack.topology imports this module)

    kept = flat_nonzero(keep)
    kept_row, kept_col = row.index_select(0, kept), col.index_select(0, kept)
    kept_linear = linear_positions(kept_row, kept_col, in_features)
    # each grown position goes after the kept ones below it and the grown ones before it
    below = torch.searchsorted(kept_linear, grow)
    if kept.numel():
        clash = kept_linear.index_select(0, below.clamp(max=kept.numel() - 1)) == grow
        if bool(clash.any()):
            position = int(grow[flat_nonzero(clash)[0]])
            raise ValueError(
                f"grow position {position} is a connection that stays "
                f"(row {position // in_features}, column {position % in_features})"
            )
    grown_slots = below + torch.arange(grow.numel(), device=grow.device)
    grown = torch.zeros(kept.numel() + grow.numel(), dtype=torch.bool, device=grow.device)
    kept_slots = flat_nonzero(~grown.index_fill_(0, grown_slots, True))
    grown_row, grown_col = coo_from_linear(grow, in_features)
    new_row = row.new_empty(grown.shape).index_copy_(0, kept_slots, kept_row).index_copy_(0, grown_slots, grown_row)
    new_col = col.new_empty(grown.shape).index_copy_(0, kept_slots, kept_col).index_copy_(0, grown_slots, grown_col)
    src = grow.new_full(grown.shape, -1).index_copy_(0, kept_slots, kept)
    return new_row, new_col, src, grown_slots


def matching_positions(row: Tensor, col: Tensor, other_row: Tensor, other_col: Tensor) -> Tensor:
    """``(m,)`` int64: where each connection of the ``(m,)`` int32 topology ``other_row``/``other_col``
    lies in the ``(n,)`` int32 topology ``row``/``col``, or ``-1`` where that holds no such
    connection. Both sorted by ``(row, col)`` and unique (topologies': not checked, other input
    gives wrong positions). What an averaged copy's values carry over to the model's topology
    (:func:`snack.align_topology`), as :func:`take_or_fill`'s ``src``."""
    if native_for(row, col, other_row, other_col):
        return torch.ops.snack_cpu.matching_positions(row, col, other_row, other_col)
    keys, wanted = _ordered_keys(row, col), _ordered_keys(other_row, other_col)
    if keys.numel() == 0:
        return wanted.new_full(wanted.shape, -1)
    at = torch.searchsorted(keys, wanted).clamp_(max=keys.numel() - 1)
    return torch.where(keys.index_select(0, at) == wanted, at, -1)


def _ordered_keys(row: Tensor, col: Tensor) -> Tensor:
    """``(n,)`` int64 keys in the order of ``(row, col)`` for any int32 coordinates."""
    return row.to(torch.int64) * 2**32 + (col.to(torch.int64) & 0xFFFFFFFF)


def take_or_fill(values: Tensor, src: Tensor, fill: float) -> Tensor:
    """``(n,)``: ``values[src[i]]``, or ``fill`` where ``src[i]`` is ``-1``, for ``(m,)``
    ``values`` of any dtype and ``(n,)`` int64 ``src`` in ``[-1, m)`` (what
    :func:`merge_connections` returns): a parameter or its optimizer state carried over to a
    rewiring's connections. An entry of ``src`` outside ``[-1, m)`` raises ``IndexError`` (not
    checked in compiled code)."""
    if native_for(values, src):
        return torch.ops.snack_cpu.take_or_fill(values, src, fill)
    if _readable(src):
        outside = flat_nonzero((src < -1) | (src >= values.numel()))
        if outside.numel():
            first = int(outside[0])
            raise IndexError(f"take_or_fill: src[{first}] = {int(src[first])} is outside [-1, {values.numel()})")
    if values.numel() == 0:  # (index_select cannot take a clamped -1 from nothing)
        return values.new_full(src.shape, fill)
    # the new entries read entry 0, then are overwritten: one gather, no masked index
    return values.index_select(0, src.clamp(min=0)).index_fill_(0, flat_nonzero(src < 0), fill)


def _check_increasing(function: str, name: str, tensor: Tensor, *, strictly: bool) -> None:
    """Raises ``RuntimeError`` (as the native kernels do) at the first entry of the ``(n,)``
    ``tensor`` that is not above (``strictly``) or at least its predecessor."""
    decrease = flat_nonzero(tensor[1:] <= tensor[:-1] if strictly else tensor[1:] < tensor[:-1])
    if decrease.numel():
        at = int(decrease[0]) + 1
        rule = "increase" if strictly else "be non-decreasing"
        raise RuntimeError(
            f"{function}: {name} must {rule}, got {int(tensor[at - 1])} before {int(tensor[at])} at position {at}"
        )


def _readable(tensor: Tensor) -> bool:
    """Whether ``tensor``'s entries can be read to check them: not while compiling or under fake
    tensors (there the torch path runs unchecked, as the custom ops do)."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None and tensor.device.type != "meta"


_INTEGER_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})


def native_for(*tensors: Tensor) -> bool:
    """Whether the native kernels take these tensors: CPU ones, outside compilation and fake
    tensor modes (which need ops they can trace), when the native CPU backend loads (building it
    on first use; where it cannot, the torch calls run) and no other backend is forced
    (``use_backend("reference")`` runs no native code; under ``"triton"`` the CPU runs what a GPU
    would)."""
    if any(tensor.device.type != "cpu" for tensor in tensors) or not _readable(tensors[0]):
        return False
    from snack import backends  # (imports snack.topology, which imports this module)

    if backends.forced_backend() not in (None, "cpu"):
        return False
    try:
        backends.get_backend("cpu")
    except backends.BackendUnavailableError:
        return False
    return True
