"""The bag reductions of :class:`snack.SparseEmbeddingBag`, in plain torch ops.

A bag layer looks up its ids' table rows ``(N, embedding_dim)`` as :class:`snack.SparseEmbedding`
does (touching only their connections), then reduces each bag of them to one row, as
``nn.EmbeddingBag`` does: ``sum`` (optionally weighted per id), ``mean`` or ``max``. These
functions do the second part. They work on activations (``N`` and ``bags`` rows), never on the
table, and need no data-dependent shapes, so ``torch.compile`` and ``torch.export`` trace them.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["MODES", "bag_of_each_id", "bag_weights", "embedding_bags"]

MODES = ("sum", "mean", "max")


def bag_of_each_id(input: Tensor, offsets: Tensor | None, include_last_offset: bool) -> tuple[Tensor, int]:
    """``(bag (N,) int64, bags)``: the bag of each id of ``input`` and the number of bags.

    ``input (B, L)`` is ``B`` bags of ``L`` ids (``offsets`` is ``None``); ``input (N,)`` is cut
    into bags at ``offsets (B,)`` (bag ``b`` holds ids ``offsets[b] .. offsets[b+1] - 1``, the
    last one to the end), or ``offsets (B + 1,)`` with ``include_last_offset`` (the last entry is
    ``N``). Offsets are expected checked (start at 0, non-decreasing, at most ``N``).
    """
    if input.dim() == 2:
        bags, length = input.shape
        return torch.arange(bags, device=input.device).unsqueeze(1).expand(bags, length).reshape(-1), bags
    starts = (offsets[:-1] if include_last_offset else offsets).long()
    count = input.shape[0]
    # id n is in the last bag that starts at or before it: the number of bags after the first
    # that start at or before n (empty bags start where the next does, and count too). A mark at
    # each start, summed up: O(N + B), where a binary search per id (bucketize) took 7x as long.
    marks = torch.zeros(count + 1, dtype=torch.int64, device=input.device)
    marks.index_add_(0, starts[1:], torch.ones_like(starts[1:]))
    return marks[:count].cumsum(0), starts.shape[0]


def bag_weights(
    ids: Tensor, bag: Tensor, bags: int, mode: str, per_sample_weights: Tensor | None, padding_idx: int | None,
    dtype: torch.dtype,
) -> Tensor:
    """``(N,)``: the weight of each id's row in its bag's sum (``mode`` ``"sum"`` or ``"mean"``):
    its ``per_sample_weights`` entry (else 1), 0 for ``padding_idx``, over the bag's size (its ids
    other than ``padding_idx``) for a mean. :func:`snack.embedding_ops.embedding_bag` then sums
    each bag as :func:`embedding_bags` reduces it."""
    weights = per_sample_weights if per_sample_weights is not None else torch.ones_like(ids, dtype=dtype)
    if padding_idx is not None:
        weights = torch.where(ids == padding_idx, 0, weights)
    if mode == "mean":  # (no per_sample_weights: each weight is 1 or 0)
        sizes = weights.new_zeros(bags).index_add(0, bag, weights)
        weights = weights / sizes.clamp(min=1).index_select(0, bag)
    return weights


def embedding_bags(
    rows: Tensor,
    ids: Tensor,
    bag: Tensor,
    bags: int,
    mode: str,
    per_sample_weights: Tensor | None = None,
    padding_idx: int | None = None,
) -> Tensor:
    """``(bags, embedding_dim)``: the looked-up ``rows (N, embedding_dim)`` of ``ids (N,)`` reduced
    per ``bag (N,)`` by ``mode``, as ``torch.nn.functional.embedding_bag`` reduces them.

    ``sum`` adds the rows (each times its ``per_sample_weights (N,)`` entry, if given), ``mean``
    divides that sum by the bag's size, ``max`` takes each feature's largest entry. Ids equal to
    ``padding_idx`` are left out (nor counted in a mean); a bag with no other id gives zeros, as an
    empty bag does. The gradient reaches ``rows`` (and ``per_sample_weights``) by autograd: for
    ``max``, each bag's largest entries' (of equal ones, the first id's, as torch's).
    """
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.unsqueeze(-1)
    if padding_idx is not None:  # into one more bag, dropped below
        bag = torch.where(ids == padding_idx, bags, bag)
    shape = (bags + 1, rows.shape[1])
    if mode == "max":
        reduced = _bag_maxima(rows, bag, shape)
    else:
        reduced = rows.new_zeros(shape).index_add(0, bag, rows)
        if mode == "mean":
            sizes = rows.new_zeros(bags + 1).index_add(0, bag, rows.new_ones(bag.shape))
            reduced = reduced / sizes.clamp(min=1).unsqueeze(-1)
    return reduced[:bags]


def _bag_maxima(rows: Tensor, bag: Tensor, shape: tuple[int, int]) -> Tensor:
    """``shape``: each bag's feature-wise maximum of its ``rows (N, width)``, taken from the first
    of its ids that holds it (an empty bag's: 0), so that the gradient goes to that one entry.

    ``F.embedding_bag`` breaks ties so, and a sparse table ties often: every id lacking a
    connection at a feature holds 0 there. ``scatter_reduce``'s own gradient would split among
    the tied entries, and RigL, which scores missing connections by their gradient, would see
    other scores than on the dense table."""
    count = rows.shape[0]
    index = bag.unsqueeze(-1).expand(rows.shape)
    with torch.no_grad():  # which entry: an index, not differentiated
        candidates = rows.detach()
        # include_self=False: a bag's peak is the max of its rows alone; an empty bag keeps its 0
        peak = candidates.new_zeros(shape).scatter_reduce(0, index, candidates, "amax", include_self=False)
        position = torch.arange(count, device=rows.device).unsqueeze(-1).expand(rows.shape)
        at_peak = torch.where(candidates == peak.gather(0, index), position, count)
        first = torch.full(shape, count, device=rows.device).scatter_reduce(0, index, at_peak, "amin")
    # row `count`, appended, is the zero row of an empty bag
    return torch.cat([rows, rows.new_zeros(1, shape[1])]).gather(0, first)
