"""Index primitives of topology work on large position sets: native on the CPU, torch elsewhere.

Topology updates and construction compact masks into positions, locate sorted positions in
sorted lists and count connections per column, over arrays as long as the layer's connections.
On the CPU, ``torch.nonzero`` took ~7 ns per entry, ``torch.searchsorted`` ~60 ns per query once
the list outgrows the caches and ``torch.bincount`` 3 ns per entry: a SET update of a 4096² layer
at 90% spent 120 of its 250 ms in them. The native kernels (``snack/backends/cpu/index_ops.cpp``)
do the same work in one or two passes in order. They run for CPU tensors when the native CPU
backend loads; on other devices, while compiling, or where the kernels could not be built, these
functions are the torch calls they replace, with the same results.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["flat_nonzero", "positions_where", "segment_pointer", "sorted_searchsorted"]


def flat_nonzero(mask: Tensor) -> Tensor:
    """``(count,)`` int64 positions of the true entries of a ``(n,)`` bool ``mask``, increasing:
    ``mask.nonzero().squeeze(1)``."""
    if _native_for(mask):
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
        if _native_for(keys):
            return torch.ops.snack_cpu.positions_where(keys, comparison, int(bar))
    return flat_nonzero(compare(keys, bar))


_COMPARISONS = {">=": torch.ge, ">": torch.gt, "<=": torch.le, "<": torch.lt, "==": torch.eq}


def sorted_searchsorted(sorted_sequence: Tensor, queries: Tensor, *, right: bool = False) -> Tensor:
    """``torch.searchsorted(sorted_sequence, queries, right=right)`` for non-decreasing ``queries``.

    Args:
        sorted_sequence: ``(n,)`` non-decreasing.
        queries: ``(k,)`` non-decreasing, of ``sorted_sequence``'s dtype.
        right: count the entries equal to a query as below it.

    Returns:
        ``(k,)`` int64: for each query, how many entries of ``sorted_sequence`` lie below it.
        On the CPU with int64 inputs this is one merge-like pass (O(n + k)); queries out of order
        raise ``RuntimeError`` there.
    """
    if sorted_sequence.dtype == queries.dtype == torch.int64 and _native_for(sorted_sequence, queries):
        return torch.ops.snack_cpu.sorted_searchsorted(sorted_sequence, queries, right)
    return torch.searchsorted(sorted_sequence, queries, right=right)


def segment_pointer(index: Tensor, size: int) -> Tensor:
    """``(size + 1,)`` int32 pointer array of an ``(n,)`` int32 ``index`` with entries in
    ``[0, size)``: the entries equal to ``i`` number ``ptr[i + 1] - ptr[i]`` (a CSC column pointer
    from the columns of the connections)."""
    if _native_for(index):
        return torch.ops.snack_cpu.segment_pointer(index, size)
    ptr = torch.zeros(size + 1, dtype=torch.int32, device=index.device)
    ptr[1:] = torch.bincount(index, minlength=size).cumsum(0)
    return ptr


_INTEGER_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})


def _native_for(*tensors: Tensor) -> bool:
    """Whether the native kernels take these tensors: CPU ones, outside compilation and fake
    tensor modes (which need ops they can trace), when the native CPU backend loads (building it
    on first use; where it cannot, the torch calls run)."""
    if any(tensor.device.type != "cpu" for tensor in tensors) or torch.compiler.is_compiling():
        return False
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        return False
    from snack import backends  # (imports snack.topology, which imports this module)

    try:
        backends.get_backend("cpu")
    except backends.BackendUnavailableError:
        return False
    return True
