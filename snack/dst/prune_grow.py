"""Drop and grow primitives: which connections of one layer to remove, which positions to add.

Positions are *linear* indices ``r · in_features + c`` (int64). Nothing here allocates an
``out × in`` tensor: random growth samples positions, gradient growth scores blocks of rows.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from snack.topology import BLOCK_ELEMENTS, Topology, linear_positions

__all__ = ["gradient_grow", "linear_index", "magnitude_drop", "random_grow"]

# Largest number of candidate positions drawn at once by random_grow.
_MAX_DRAW = 1 << 22


def linear_index(topology: Topology) -> Tensor:
    """``(nnz,)`` int64 linear positions of the connections, sorted (the format is row-major)."""
    return linear_positions(topology.row, topology.col, topology.shape[1])


def magnitude_drop(values: Tensor, k: int, *, split_sign: bool = False) -> Tensor:
    """Positions (into ``values``, int64, sorted) of the ``k`` connections to drop.

    Args:
        values: ``(nnz,)`` weights.
        k: how many to drop (``0 <= k <= nnz``). With ``split_sign`` it is split between signs
            in proportion to how many weights have each sign.
        split_sign: SET's original rule — drop the smallest positive weights and the largest
            (closest to zero) negative weights separately, so neither sign is wiped out.
            Otherwise drop the ``k`` smallest ``|w|``.

    Ties are broken by position (stable sort), so the choice is reproducible.
    """
    values = values.detach()
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=values.device)
    if not split_sign:
        return torch.sort(values.abs(), stable=True).indices[:k].sort().values
    # NaN counts as positive, and sorts last there: dropped last, as without split_sign
    negative_mask = values < 0
    positive = (~negative_mask).nonzero().squeeze(1)
    negative = negative_mask.nonzero().squeeze(1)
    k_pos = min(positive.numel(), round(k * positive.numel() / values.numel()))
    k_neg = min(negative.numel(), k - k_pos)
    k_pos = k - k_neg  # if one sign is short, the other gives the rest
    drop_pos = positive[torch.sort(values[positive], stable=True).indices[:k_pos]]
    drop_neg = negative[torch.sort(values[negative], stable=True, descending=True).indices[:k_neg]]
    return torch.cat([drop_pos, drop_neg]).sort().values


def random_grow(topology: Topology, k: int, generator: torch.Generator) -> Tensor:
    """``k`` distinct positions drawn uniformly among the positions inactive in ``topology``.

    Candidates are drawn uniformly over all ``out · in`` positions (on the CPU ``generator``),
    active ones rejected by binary search in the sorted active positions, duplicates removed,
    until ``k`` remain; then a uniformly random ``k``-subset is kept. When ``k`` is more than
    half the inactive positions, rejection would spend most of its draws finding the last few
    (a coupon collector's tail): the inactive positions are then listed from the gaps between
    active ones (fewer than ``2k``) and a random ``k`` of them kept. Memory is O(nnz + k).
    Returns ``(k,)`` int64, sorted, on the topology's device.
    """
    out_features, in_features = topology.shape
    total = out_features * in_features
    inactive = total - topology.nnz
    if k > inactive:
        raise ValueError(f"cannot grow {k} connections: only {inactive} positions are inactive")
    active = linear_index(topology).cpu()
    if 2 * k > inactive:
        candidates = _inactive_positions(active, total)
        keep = torch.randperm(inactive, generator=generator)[:k]
        return candidates[keep].sort().values.to(topology.device)
    found = torch.empty(0, dtype=torch.int64)
    while found.numel() < k:
        missing = k - found.numel()
        # draw enough that about `missing` survive rejection (acceptance rate inactive/total)
        n_draw = min(_MAX_DRAW, math.ceil(missing * total / inactive * 1.25) + 16)
        draw = torch.randint(0, total, (n_draw,), generator=generator)
        if active.numel():
            at = torch.searchsorted(active, draw).clamp_(max=active.numel() - 1)
            draw = draw[active[at] != draw]
        found = torch.unique(torch.cat([found, draw]))
    if found.numel() > k:
        # the distinct accepted draws are an exchangeable subset of the inactive positions,
        # so a uniformly random k-subset of them is a uniform k-subset of the inactive set
        found = found[torch.randperm(found.numel(), generator=generator)[:k]].sort().values
    return found.to(topology.device)


def _inactive_positions(active: Tensor, total: int) -> Tensor:
    """``(total - nnz,)`` int64: every position in ``[0, total)`` not in the sorted ``active``,
    in order, listed gap by gap (O(nnz + output), no ``total``-sized tensor)."""
    starts = torch.cat([active.new_zeros(1), active + 1])  # each gap begins after an active position
    lengths = torch.cat([active, active.new_full((1,), total)]) - starts
    offsets = torch.cumsum(lengths, 0) - lengths  # where each gap begins in the output
    gap = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    return starts[gap] + torch.arange(gap.numel()) - offsets[gap]


@torch.no_grad()
def gradient_grow(x: Tensor, dy: Tensor, topology: Topology, k: int, *, block_elements: int = BLOCK_ELEMENTS) -> Tensor:
    """The ``k`` inactive positions with the largest ``|∂L/∂W|`` (RigL's grow criterion).

    ``∂L/∂W[r, c] = Σ_b dy[b, r] · x[b, c]``. It is formed one block of rows at a time
    (``rows · in <= block_elements``, at least one row), active positions of the block are
    masked out, and a running top-``k`` is kept across blocks (once ``k`` are kept, only scores
    reaching the ``k``-th best join it), so at most two blocks plus ``k`` scores exist at once:
    the ``out × in`` gradient only for a layer that fits in one block (4 MB of float32 scores by
    default).

    Args:
        x: ``(B, in)`` layer inputs of the batch.
        dy: ``(B, out)`` gradients of the loss with respect to the layer outputs. ``x`` and
            ``dy`` in float16 or bfloat16 are scored in float32.
        topology: the layer's current connections (excluded from growth).
        k: how many positions to grow, at most the number of inactive positions.
        block_elements: how many scores one block may hold (a block has at least one row).

    Returns:
        ``(k,)`` int64 linear positions, sorted.
    """
    out_features, in_features = topology.shape
    if k > out_features * in_features - topology.nnz:
        raise ValueError(f"cannot grow {k} connections: only {out_features * in_features - topology.nnz} are inactive")
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=topology.device)
    rowptr = topology.rowptr.tolist()
    row, col = topology.row.to(torch.int64), topology.col.to(torch.int64)
    # 16-bit records are scored in float32: float16 sums overflow at 65504 (inf scores, arbitrary
    # picks) and bfloat16 rounds close scores into ties
    # (x once, dy a block of rows at a time: the copy adds B·in elements, not B·(in + out))
    score_dtype = torch.promote_types(x.dtype, torch.float32)
    x, dy_t = x.to(score_dtype), dy.t()
    rows_per_block = max(1, block_elements // in_features)
    best_scores = x.new_empty(0)
    best_index = torch.empty(0, dtype=torch.int64, device=x.device)
    for first in range(0, out_features, rows_per_block):
        last = min(out_features, first + rows_per_block)
        scores = (dy_t[first:last].to(score_dtype) @ x).abs_().view(-1)  # (rows · in,)
        lo, hi = rowptr[first], rowptr[last]
        scores[(row[lo:hi] - first) * in_features + col[lo:hi]] = -1.0  # below every |grad|
        if best_scores.numel() == k:
            # only scores reaching the k-th best so far can enter: a topk of every block took 5.7x
            # as long (a 20000² layer at 99.99%, batch 8, growing 12000: 6.7 -> 1.2 s)
            # (NaN included, and counted above every score for the k-th best: topk ranks it first)
            kth_best = best_scores.nan_to_num(nan=float("inf")).min()
            block_index = ((scores >= kth_best) | scores.isnan()).nonzero().squeeze(1)
            block_scores = scores[block_index]
        else:
            block_scores, block_index = scores.topk(min(k, scores.numel()))
        best_scores = torch.cat([best_scores, block_scores])
        best_index = torch.cat([best_index, block_index + first * in_features])
        if best_scores.numel() > k:
            best_scores, keep = best_scores.topk(k)
            best_index = best_index[keep]
    return best_index.sort().values
