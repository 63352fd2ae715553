"""Order statistics without sorting: the positions of the ``k`` largest or smallest keys.

Picking connections (the weakest to drop, the largest gradients to grow, the largest weights of
a dense matrix) must be reproducible, so equal keys go to the lower position: what a stable sort
would pick. A sort costs O(n log n) for an answer O(n) work finds: a selection of the ``k``-th
key (``torch.topk``, unsorted) and comparisons (1.7M float32: 240 ms for a stable sort on this
project's CPU, about 30 ms this way). (Not ``torch.kthvalue``: 30% slower here, and on CUDA it
runs one thread block per tensor, reported 20x slower than a sort: pytorch/pytorch#75599.)

Floats are ranked through integer keys (:func:`ordering_keys`): a non-negative IEEE 754 float's
bit pattern, read as an integer, orders as its value, and NaN's patterns lie above inf's, so
one comparison of integers ranks NaN above every number, as ``torch.sort`` does.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from snack.indexing import flat_nonzero, positions_where

__all__ = ["k_largest_positions", "k_smallest_positions", "kth_largest", "ordering_keys"]

_INTEGER_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def ordering_keys(nonnegative: Tensor) -> Tensor:
    """Integer keys (the same width: int16, int32 or int64) ordered as the non-negative floats
    ``nonnegative`` are, every NaN equal and above inf. Works in place: pass a tensor made for
    this (e.g. ``x.abs()``), which becomes the keys."""
    integer = _INTEGER_OF_SIZE.get(nonnegative.element_size())
    if not nonnegative.is_floating_point() or integer is None:
        raise TypeError(f"ordering_keys needs a 16-, 32- or 64-bit floating tensor, got {nonnegative.dtype}")
    nan_key = int(torch.tensor(float("inf"), dtype=nonnegative.dtype).view(integer)) + 1
    return nonnegative.view(integer).clamp_max_(nan_key)  # NaN payloads differ: one key for all


def k_largest_positions(keys: Tensor, k: int) -> Tensor:
    """Positions (int64, sorted) of the ``k`` largest of the 1-D ``keys`` (integers, e.g. from
    :func:`ordering_keys`, or floats without NaN); equal keys go to the lower position. ``k``
    beyond the length gives every position."""
    return _k_extreme_positions(keys, k, largest=True)


def k_smallest_positions(keys: Tensor, k: int) -> Tensor:
    """Positions (int64, sorted) of the ``k`` smallest of the 1-D ``keys`` (as for
    :func:`k_largest_positions`); equal keys go to the lower position."""
    return _k_extreme_positions(keys, k, largest=False)


def _k_extreme_positions(keys: Tensor, k: int, *, largest: bool) -> Tensor:
    n = keys.numel()
    if k >= n:
        return torch.arange(n, device=keys.device)
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=keys.device)
    kth = kth_largest(keys, k if largest else n - k + 1)
    # Without ties at the k-th key (always, for distinct keys) the keys reaching it are the answer:
    # one pass, where the mask, its count, the ties and the mask's positions took four (the drop of
    # 503K of 1.7M weights' keys: 14.3 against 19.7 ms, interleaved).
    reaching = positions_where(keys, ">=" if largest else "<=", kth)
    if reaching.numel() == k:
        return reaching
    chosen = keys > kth if largest else keys < kth
    ties = positions_where(keys, "==", kth)[: k - int(chosen.sum())]  # the lowest positions
    chosen.index_fill_(0, ties, True)
    return flat_nonzero(chosen)


def kth_largest(keys: Tensor, rank: int) -> Tensor:
    """The ``rank``-th largest of the 1-D ``keys`` (``1 <= rank <= n``; integers, or floats
    without NaN), a 0-d tensor. Selected from the shorter end: it is the
    ``(n - rank + 1)``-th smallest. A long input is first narrowed to the keys beyond a bar
    read off a sample (:func:`_narrowed`), which halved the time (32 -> 16 ms for 1.9M keys)."""
    n = keys.numel()
    from_bottom = n - rank + 1
    if n > _NARROW_ABOVE:
        if rank <= from_bottom:
            kept = _narrowed(keys, rank, largest=True)
            if kept is not None:
                return kth_largest(kept, rank)  # every key above the bar was kept
        else:
            kept = _narrowed(keys, from_bottom, largest=False)
            if kept is not None:
                return kth_largest(kept, kept.numel() - from_bottom + 1)  # every key below it was
    if rank <= from_bottom:
        return torch.topk(keys, rank, sorted=False).values.min()
    return torch.topk(keys, from_bottom, largest=False, sorted=False).values.max()


# Selections from more keys than this first narrow them by a sample of _SAMPLE keys.
_NARROW_ABOVE = 1 << 17
_SAMPLE = 1 << 16


def _narrowed(keys: Tensor, count: int, *, largest: bool) -> Tensor | None:
    """The keys at or beyond (above when ``largest``, else below) a bar that at least ``count``
    of them reach, about 5% more than ``count`` (plus 64 sample strides), so that the
    ``count``-th one is among them; ``None`` where that would not shrink them by a quarter (many
    equal keys, or a sample that misjudged them). The bar is the matching key of an evenly
    strided sample, with a margin."""
    n = keys.numel()
    sample = keys[:: n // _SAMPLE]
    in_sample = min(sample.numel(), math.ceil(count * sample.numel() / n * 1.05) + 64)
    if largest:
        bar = torch.topk(sample, in_sample, sorted=False).values.min()
        beyond = positions_where(keys, ">=", bar)
    else:
        bar = torch.topk(sample, in_sample, largest=False, sorted=False).values.max()
        beyond = positions_where(keys, "<=", bar)
    if beyond.numel() < count or beyond.numel() > 0.75 * n:
        return None
    return keys.index_select(0, beyond)  # (2x as fast as keys[beyond] on the CPU)
