"""Drop and grow primitives: which connections of one layer to remove, which positions to add.

Positions are *linear* indices ``r · in_features + c`` (int64). Nothing here allocates an
``out × in`` tensor: random growth samples positions, gradient growth scores blocks of rows.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from snack.indexing import flat_nonzero, inactive_positions, native_for, positions_where
from snack.ranking import k_largest_positions, k_smallest_positions, kth_largest, ordering_keys
from snack.sampling import sorted_sample
from snack.topology import BLOCK_ELEMENTS, Topology, linear_positions

if TYPE_CHECKING:
    from snack.nn.conv_base import _SparseConvNd

__all__ = ["gradient_grow", "gradient_grow_rows", "linear_index", "magnitude_drop", "random_grow"]


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
        return k_smallest_positions(ordering_keys(values.abs()), k)
    # NaN counts as positive, and sorts last there: dropped last, as without split_sign
    negative_mask = values < 0
    positive = flat_nonzero(~negative_mask)
    negative = flat_nonzero(negative_mask)
    k_pos = min(positive.numel(), round(k * positive.numel() / values.numel()))
    k_neg = min(negative.numel(), k - k_pos)
    k_pos = k - k_neg  # if one sign is short, the other gives the rest
    # (abs of the non-negative ones only clears a NaN's sign bit; the negative ones nearest 0 are
    # the smallest of -w)
    drop_pos = positive[k_smallest_positions(ordering_keys(values[positive].abs()), k_pos)]
    drop_neg = negative[k_smallest_positions(ordering_keys(-values[negative]), k_neg)]
    return torch.cat([drop_pos, drop_neg]).sort().values


def random_grow(topology: Topology, k: int, generator: torch.Generator) -> Tensor:
    """``k`` distinct positions drawn uniformly among the positions inactive in ``topology``.

    Draws ``k`` distinct ranks among the inactive positions (:func:`snack.sampling.sorted_sample`,
    on the CPU ``generator``) and maps rank ``r`` to the ``r``-th inactive position: ``r`` plus
    the number of active positions below it (:func:`snack.indexing.inactive_positions`). Memory
    is O(nnz + k). Returns ``(k,)`` int64, sorted, on the topology's device.
    """
    out_features, in_features = topology.shape
    inactive = out_features * in_features - topology.nnz
    if k > inactive:
        raise ValueError(f"cannot grow {k} connections: only {inactive} positions are inactive")
    ranks = sorted_sample(inactive, k, generator).to(topology.device)
    return inactive_positions(topology.row, topology.col, in_features, ranks)


@torch.no_grad()
def gradient_grow(
    x: Tensor, dy: Tensor, topology: Topology, k: int, *, block_elements: int = BLOCK_ELEMENTS,
    convolution: _SparseConvNd | None = None, head: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """The ``k`` inactive positions with the largest ``|∂L/∂W|`` (RigL's grow criterion).

    ``∂L/∂W[r, c] = Σ_b dy[b, r] · x[b, c]``. It is formed one block of rows at a time
    (``rows · in <= block_elements``, at least one row) and its active positions are masked out.
    Only scores at or above a bar enter the candidates: first a bar read off a sample of evenly
    strided rows (scored beforehand, a block's worth and a quarter of the rows at most; none for
    a small layer of a few blocks), with a margin below the score it predicts for the ``k``-th
    best; when ``2k`` candidates gather they are cut back to the best ``k``, whose worst then
    becomes the bar. At the end the best ``k`` candidates are the answer, unless fewer than ``k``
    reached the sampled bar (it was too high): then the blocks are scored again without it. So at
    most one block plus ``2k`` candidates exist at once: the ``out × in`` gradient only for a
    layer that fits in one block (4 MB of float32 scores by default). On the CPU, for a batch up
    to 128, a native kernel scores a block a few rows at a time and keeps only the scores that
    reach the bar (for a 4096² layer at batch 32: 1.75x faster at 90%, 2.1x at 99% on an AVX2
    host, 1.4x on an AVX-512 one; its sums may differ from torch's matrix product in the last
    bit). Equal scores go to the lower position; NaN ranks above every number.

    A convolution's ``∂L/∂W`` is scored from its padded input instead of its im2col rows
    (``convolution=``): each block is the weight gradient of a block of output channels, by
    torch's convolution backward, never the rows (``kh·kw`` times the input's size). A grouped
    convolution's output channels are scored against their group's input channels only, from
    its padded input or its rows (``in_channels · kh · kw`` wide, all groups). A transposed
    convolution (:class:`snack.SparseConvTranspose2d`, ...) is the adjoint of a convolution with its
    weight, whose weight gradient it shares with the roles swapped: ``x`` is its padded output
    gradient (or that one's rows) and ``dy`` its input's rows (``(N · H · W, in_channels)``), as
    the recorded batches hold them.

    Args:
        x: ``(B, in)`` layer inputs of the batch; with ``convolution``, its padded input ``(N, C,
            Hp, Wp)`` (a :class:`snack.SparseConv3d`'s ``(N, C, Dp, Hp, Wp)``; as
            :meth:`snack.dst.DynamicSparsity.recorded_as_kept` gives it) or its
            im2col rows ``(N · H_out · W_out, C · kh · kw)`` (as :meth:`recorded_batch` does); a
            :class:`snack.SparseEmbedding`'s ids ``(N,)`` (integers), whose table's gradient is
            formed a block of rows at a time from them and ``dy`` (with ``head``, empty ones ``(0,)``
            where the table served only as the head).
        dy: ``(B, out)`` gradients of the loss with respect to the layer outputs (an embedding's:
            ``(N, embedding_dim)``; a convolution's:
            ``(N · H_out · W_out, out)``, positions in row-major order). ``x`` and ``dy`` in
            float16 or bfloat16 are scored in float32.
        topology: the layer's current connections (excluded from growth).
        k: how many positions to grow, at most the number of inactive positions.
        block_elements: how many scores one block may hold (a block has at least one row).
        convolution: the sparse convolution (:class:`snack.SparseConv2d`, ``SparseConv1d``,
            ``SparseConv3d``, ``SparseConvTranspose2d``, ``SparseConvTranspose1d`` or
            ``SparseConvTranspose3d``) whose padded input or rows ``x`` are (its kernel size,
            stride, dilation and groups).
        head: for an embedding whose table is also an output layer (:class:`snack.SparseTiedHead`,
            :meth:`snack.SparseEmbedding.attend`), that use's inputs and logits' gradients
            ``(hidden (B, embedding_dim), dlogits (B, num_embeddings))``: ``dlogitsᵀ·hidden`` adds
            to the lookups' gradient, block by block
            (:meth:`snack.dst.DynamicSparsity.recorded_head_batch`).

    Returns:
        ``(k,)`` int64 linear positions, sorted.
    """
    out_features, in_features = topology.shape
    if k > out_features * in_features - topology.nnz:
        raise ValueError(f"cannot grow {k} connections: only {out_features * in_features - topology.nnz} are inactive")
    if not (x.is_floating_point() or x.is_complex()):
        return _grow_from_ids(x, dy, topology, k, block_elements, head)
    if head is not None:
        raise ValueError("gradient_grow: head= is for an embedding's table (x its ids), got x of floating dtype")
    _check_batch("gradient_grow", x, in_features, convolution)
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=topology.device)
    return _best_k_scores(_batch_scores(x, dy, topology, convolution), k, block_elements)


@torch.no_grad()
def gradient_grow_rows(
    x: Tensor, dy: Tensor, topology: Topology, counts: Tensor, *, block_elements: int = BLOCK_ELEMENTS,
    convolution: _SparseConvNd | None = None,
) -> Tensor:
    """Per row ``r``, the ``counts[r]`` inactive positions of that row with the largest ``|∂L/∂W|``:
    :func:`gradient_grow` with a quota per row instead of one for the layer (what keeps each row's
    connection count, :class:`snack.dst.SRigL`).

    The gradient is formed a block of rows at a time as in :func:`gradient_grow` (by the same
    products; a convolution's from its padded input with ``convolution=``), and each row's quota is
    taken from its block: the ``counts[r]``-th largest key of the row (``torch.topk`` along rows), the
    keys above it, then the first of those equal to it. On the CPU, for a batch up to 128, the native
    kernel of :func:`gradient_grow` forms the scores a few rows at a time and picks each row's in
    place (its sums may differ from torch's product in the last bit). Equal scores go to the lower
    position; NaN ranks above every number.

    Args:
        x, dy, convolution, block_elements: as for :func:`gradient_grow` (not an embedding's ids).
        topology: the layer's current connections (excluded from growth).
        counts: ``(out_features,)`` integers, ``0 <= counts[r] <=`` the inactive positions of row ``r``.

    Returns:
        ``(counts.sum(),)`` int64 linear positions, sorted.
    """
    out_features, in_features = topology.shape
    if not x.is_floating_point():
        raise TypeError(f"gradient_grow_rows: x must be a floating tensor (not an embedding's ids), got {x.dtype}")
    _check_batch("gradient_grow_rows", x, in_features, convolution)
    if not isinstance(counts, Tensor) or counts.shape != (out_features,) or counts.is_floating_point():
        shown = type(counts).__name__
        if isinstance(counts, Tensor):
            shown = f"{counts.dtype} of shape {tuple(counts.shape)}"
        raise ValueError(f"gradient_grow_rows: counts must be ({out_features},) integers, one per row, got {shown}")
    counts = counts.to(device=topology.device, dtype=torch.int64)
    inactive = in_features - topology.rowptr.to(torch.int64).diff()
    if bool(((counts < 0) | (counts > inactive)).any()):
        row = int(flat_nonzero((counts < 0) | (counts > inactive))[0])
        raise ValueError(
            f"gradient_grow_rows: counts[{row}] is {int(counts[row])}, but row {row} has {int(inactive[row])} inactive "
            "positions (each count must be from 0 to its row's)"
        )
    scores = _batch_scores(x, dy, topology, convolution)
    if scores.native:  # the scores and each row's pick in one kernel (grow_scores.cpp)
        return torch.ops.snack_cpu.gradient_scores_top_rows(
            scores.dy_t, scores.x, topology.rowptr, topology.col.contiguous(), counts.contiguous(), 0, out_features
        )
    rows_per_block = max(1, block_elements // in_features)
    parts = [torch.empty(0, dtype=torch.int64, device=topology.device)]
    for first in range(0, out_features, rows_per_block):
        last = min(out_features, first + rows_per_block)
        quota = counts[first:last]
        most = int(quota.max())
        if most == 0:
            continue
        keys = scores.of_rows(first, last).view(last - first, in_features)  # active positions: -1
        # the quota-th largest key of each row (its first for a quota of 0, which takes nothing)
        bar = keys.topk(most, dim=1).values.gather(1, (quota - 1).clamp_min(0).unsqueeze(1))
        above = keys > bar
        at_bar = keys == bar
        # (a quota never exceeds the row's inactive positions, so the bar is an inactive key, >= 0)
        chosen = above | (at_bar & (at_bar.cumsum(1) <= (quota - above.sum(1)).unsqueeze(1)))
        chosen &= (quota > 0).unsqueeze(1)
        parts.append(flat_nonzero(chosen.view(-1)) + first * in_features)
    return torch.cat(parts)


def _check_batch(caller: str, x: Tensor, in_features: int, convolution: _SparseConvNd | None) -> None:
    """Raise unless ``x`` is a layer's ``(B, in)`` rows, or with ``convolution`` its rows or padded input."""
    width = in_features if convolution is None else convolution._rows_width
    padded_dims = None if convolution is None else 2 + len(convolution._computed_geometry[0])
    if not (x.dim() == 2 and x.shape[1] == width or x.dim() == padded_dims):
        raise ValueError(
            f"{caller}: x must be (B, {width}) rows, or a convolution's padded input (N, C, Hp, Wp; a 3-D one's "
            f"(N, C, Dp, Hp, Wp)) with convolution= the layer; got x of shape {tuple(x.shape)} and "
            f"convolution={convolution!r}"
            + (" (a convolution's rows need convolution= the layer)" if convolution is None and x.dim() == 2 else "")
        )
    if x.dim() > 2 and x.shape[1] != convolution._window_channels:
        raise ValueError(f"{caller}: x must have {convolution._window_channels} channels, got {tuple(x.shape)}")


def _batch_scores(x: Tensor, dy: Tensor, topology: Topology, convolution: _SparseConvNd | None) -> _GradientScores:
    """The scores of a batch ``x`` (rows, or with ``convolution`` a padded input) and ``dy`` that
    :func:`_check_batch` accepted."""
    if x.dim() == 2:
        return _GradientScores(x, dy, topology, 1 if convolution is None else convolution.groups)
    return _ConvolutionScores(x, dy, topology, convolution)


def _grow_from_ids(
    ids: Tensor, dy: Tensor, topology: Topology, k: int, block_elements: int, head: tuple[Tensor, Tensor] | None
) -> Tensor:
    """:func:`gradient_grow` of an embedding, from its ids ``(N,)`` and output gradient ``dy (N,
    embedding_dim)``, and its use as an output layer's ``head``."""
    num_embeddings, embedding_dim = topology.shape
    if ids.dim() != 1 or dy.shape != (ids.shape[0], embedding_dim):
        raise ValueError(
            f"gradient_grow: an embedding's ids must be (N,) and dy (N, {embedding_dim}); got ids of shape "
            f"{tuple(ids.shape)} and dy of shape {tuple(dy.shape)}"
        )
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_embeddings):
        raise ValueError(f"gradient_grow: ids must be in [0, {num_embeddings - 1}]")
    if head is not None:
        hidden, dlogits = _checked_head(head, topology)
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=topology.device)
    if head is None:
        return _best_k_scores(_EmbeddingScores(ids, dy, topology), k, block_elements)
    if ids.numel() == 0:  # the table served only as the head: a linear layer's scores
        return _best_k_scores(_GradientScores(hidden, dlogits, topology), k, block_elements)
    parts = [_EmbeddingScores(ids, dy, topology), _GradientScores(hidden, dlogits, topology, allow_native=False)]
    return _best_k_scores(_SummedScores(parts), k, block_elements)


def _checked_head(head, topology: Topology) -> tuple[Tensor, Tensor]:
    """``gradient_grow``'s ``head``, ``(hidden (B, embedding_dim), dlogits (B, num_embeddings))``."""
    num_embeddings, embedding_dim = topology.shape
    if not (isinstance(head, (tuple, list)) and len(head) == 2 and all(isinstance(t, Tensor) for t in head)):
        raise TypeError(f"gradient_grow: head must be a pair of tensors (hidden, dlogits), got {head!r}")
    hidden, dlogits = head
    if hidden.dim() != 2 or hidden.shape[1] != embedding_dim or dlogits.shape != (hidden.shape[0], num_embeddings):
        raise ValueError(
            f"gradient_grow: head must be (hidden (B, {embedding_dim}), dlogits (B, {num_embeddings})); got shapes "
            f"{tuple(hidden.shape)} and {tuple(dlogits.shape)}"
        )
    if not (hidden.is_floating_point() and dlogits.is_floating_point()):
        raise TypeError(f"gradient_grow: head must be floating tensors, got {hidden.dtype} and {dlogits.dtype}")
    return hidden, dlogits


def _best_k_scores(scores: _GradientScores, k: int, block_elements: int) -> Tensor:
    """The ``k`` best positions of ``scores``, a block of rows at a time (see :func:`gradient_grow`)."""
    rows_per_block = max(1, block_elements // scores.topology.shape[1])
    sampled_bar = _sampled_bar(scores, k, rows_per_block)
    if sampled_bar is not None:
        best = _best_above(scores, k, rows_per_block, sampled_bar)
        if best is not None:
            return best
    return _best_above(scores, k, rows_per_block, 0)  # every inactive score (keys >= 0) may enter


# Largest batch whose scores the native kernel forms (torch.ops.snack_cpu.gradient_scores_above):
# MKL's matrix product was as fast at 128 and faster from 192 (4096², 90% and 99%), and keeps those.
_NATIVE_MAX_BATCH = 128


class _GradientScores:
    """``|∂L/∂W|`` of chosen rows as ordering keys (:func:`snack.ranking.ordering_keys`), the
    active positions -1 (below every score).

    On the CPU, for a batch up to ``_NATIVE_MAX_BATCH``, :meth:`above` runs the native kernel
    (``snack/backends/cpu/grow_scores.cpp``), which forms a few rows of scores at a time and keeps
    only those reaching the bar. Its sums may differ from torch's matrix product in the last bit
    (another summation order).

    With ``groups > 1`` (a grouped convolution's rows ``x (B, groups · in)``) output row ``r``
    is scored against the ``in`` columns of its group, ``r // (out / groups)``. ``allow_native=False``
    for a part of :class:`_SummedScores`, which forms the parts' gradients, never the kernel's
    scores (its contiguous copies would be wasted)."""

    def __init__(self, x: Tensor, dy: Tensor, topology: Topology, groups: int = 1, *, allow_native: bool = True):
        # 16-bit records are scored in float32: float16 sums overflow at 65504 (inf scores,
        # arbitrary picks) and bfloat16 rounds close scores into ties (x once, dy a few rows at a
        # time: the copy adds B·in elements, not B·(in + out))
        self.dtype = torch.promote_types(x.dtype, torch.float32)
        self.x, self.dy_t = x.to(self.dtype), dy.t()
        self.topology, self.groups = topology, groups
        self.native = allow_native and groups == 1 and x.shape[0] <= _NATIVE_MAX_BATCH and native_for(x, dy)
        if self.native:  # (contiguous copies: B·(in + out) elements)
            self.x, self.dy_t = self.x.contiguous(), self.dy_t.to(self.dtype).contiguous()

    def above(self, first: int, last: int, bar: int | Tensor, strict: bool) -> tuple[Tensor, Tensor]:
        """``(keys, positions)`` of the free positions of rows ``first .. last - 1`` whose key is at
        or above ``bar`` (above it if ``strict``), positions (int64, linear) increasing."""
        if self.native:
            return torch.ops.snack_cpu.gradient_scores_above(
                self.dy_t, self.x, self.topology.rowptr, self.topology.col.contiguous(), first, last, int(bar), strict
            )
        keys = self.of_rows(first, last)
        entering = positions_where(keys, ">" if strict else ">=", bar)
        return keys.index_select(0, entering), entering + first * self.topology.shape[1]

    @functools.cached_property
    def _rowptr(self) -> list[int]:
        """The row pointer as a list: :meth:`of_rows`' block bounds, read once rather than with two
        ``.item()`` per block (and not at all on the native path)."""
        return self.topology.rowptr.tolist()

    def of_rows(self, first: int, last: int) -> Tensor:
        """``((last - first) · in,)`` keys of rows ``first .. last - 1``."""
        keys = self._keys(slice(first, last))
        lo, hi = self._rowptr[first], self._rowptr[last]
        row, col = self.topology.row[lo:hi].to(torch.int64), self.topology.col[lo:hi]
        keys.index_fill_(0, (row - first) * self.topology.shape[1] + col, -1)
        return keys

    def of_strided_rows(self, stride: int) -> Tensor:
        """``(rows · in,)`` keys of rows ``0, stride, 2·stride, ...``."""
        keys = self._keys(slice(None, None, stride))
        # their connections, row by row through the row pointer (testing every connection's row
        # took 40 ms at 1.7M connections)
        rowptr = self.topology.rowptr.to(torch.int64)
        first, counts = rowptr[:-1:stride], rowptr[1::stride] - rowptr[:-1:stride]
        sample_row = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
        starts = first - (torch.cumsum(counts, 0) - counts)  # entry i of sampled row r is starts[r] + i
        entries = starts[sample_row] + torch.arange(sample_row.numel(), device=counts.device)
        keys.index_fill_(0, sample_row * self.topology.shape[1] + self.topology.col.index_select(0, entries), -1)
        return keys

    def _keys(self, rows: slice) -> Tensor:
        """The flattened keys of ``|∂L/∂W|`` of ``rows`` (a slice of the output features)."""
        return ordering_keys(self._gradient(rows).abs_().view(-1))

    def _gradient(self, rows: slice) -> Tensor:
        """``∂L/∂W`` of ``rows`` (a slice of the output features), ``(rows, in)``, a new tensor."""
        in_features = self.topology.shape[1]
        parts = []
        for piece, first, last in _group_pieces(rows, self.topology.shape[0], self.groups):
            # (contiguous rows of dyᵀ: the product took twice as long from strided ones)
            dy_t = self.dy_t[piece].to(self.dtype).contiguous()  # (rows, B)
            x = self.x[:, first * in_features : last * in_features]  # (B, groups of the piece · in)
            if last - first == 1:
                parts.append(dy_t @ x)
            else:  # whole groups, each its rows against its columns
                x = x.view(x.shape[0], last - first, in_features).transpose(0, 1)
                parts.append(torch.bmm(dy_t.view(last - first, -1, dy_t.shape[1]), x).view(-1, in_features))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class _ConvolutionScores(_GradientScores):
    """:class:`_GradientScores` of a convolution from its padded input ``x (N, C, Hp, Wp)`` (3-D:
    ``(N, C, Dp, Hp, Wp)``): a block of rows is the weight gradient of a block of output channels,
    by torch's convolution backward (oneDNN on the CPU), ``(rows, C / groups, *kernel)``, the rows'
    order of ``in_features``."""

    def __init__(
        self,
        x: Tensor,
        dy: Tensor,
        topology: Topology,
        convolution: _SparseConvNd,
    ):
        self.dtype = torch.promote_types(x.dtype, torch.float32)
        self.x = x.to(self.dtype)
        self.dy = convolution._output_of_rows(dy, x).to(self.dtype)  # (N, out, H_out, W_out)
        self.topology, self.groups = topology, convolution.groups
        self.native = False
        self.geometry = convolution._computed_geometry

    def _gradient(self, rows: slice) -> Tensor:
        kernel, stride, dilation = self.geometry
        weight_gradient = torch.nn.grad.conv3d_weight if len(kernel) == 3 else torch.nn.grad.conv2d_weight
        channels = self.x.shape[1] // self.groups  # of one group
        parts = []
        for piece, first, last in _group_pieces(rows, self.topology.shape[0], self.groups):
            dy = self.dy[:, piece]
            weight_size = (dy.shape[1], channels, *kernel)
            x = self.x[:, first * channels : last * channels]
            parts.append(weight_gradient(x, weight_size, dy, stride, 0, dilation, last - first))
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(-1, self.topology.shape[1])


class _EmbeddingScores(_GradientScores):
    """:class:`_GradientScores` of an embedding's table from the ids ``(N,)`` looked up and their
    output gradient ``dy (N, embedding_dim)``: row ``t`` of ``∂L/∂E`` is the sum of the ``dy`` rows
    of the positions holding ``t`` (zero for ids not looked up). A block of rows sums the ``dy``
    rows of its ids only, never a one-hot ``(N, num_embeddings)`` matrix."""

    def __init__(self, ids: Tensor, dy: Tensor, topology: Topology):
        self.dtype = torch.promote_types(dy.dtype, torch.float32)
        self.ids, self.dy = ids.to(torch.int64), dy.to(self.dtype)
        self.topology, self.groups, self.native = topology, 1, False

    def _gradient(self, rows: slice) -> Tensor:
        start, stop, step = rows.indices(self.topology.shape[0])
        offset = self.ids - start
        # the ids among rows start, start + step, ... (before stop), and their place in the block
        taken = (offset >= 0) & (self.ids < stop) & (offset % step == 0)
        block = self.dy.new_zeros(len(range(start, stop, step)), self.dy.shape[1])
        return block.index_add_(0, offset[taken] // step, self.dy[taken])


class _SummedScores(_GradientScores):
    """:class:`_GradientScores` of a weight with several uses, each scored by one of ``parts``
    (on the same topology): ``∂L/∂W`` is the sum of theirs (a tied embedding's lookups and head)."""

    def __init__(self, parts: list[_GradientScores]):
        self.parts = parts
        self.dtype = functools.reduce(torch.promote_types, [part.dtype for part in parts])
        self.topology, self.groups, self.native = parts[0].topology, 1, False

    def _gradient(self, rows: slice) -> Tensor:
        gradient = self.parts[0]._gradient(rows).to(self.dtype)
        for part in self.parts[1:]:
            gradient += part._gradient(rows)
        return gradient


def _group_pieces(rows: slice, out_features: int, groups: int) -> list[tuple[slice, int, int]]:
    """``rows`` (a slice of the output features) cut where ``groups`` equal groups of them meet,
    as ``(rows, first group, last group + 1)`` in order: rows of one group, or (a slice of step 1)
    a run of whole groups, which one grouped product scores. One piece for ``groups=1``."""
    per_group = out_features // groups
    start, stop, step = rows.indices(out_features)
    pieces = []
    while start < stop:
        group = start // per_group
        whole = stop // per_group  # the groups before it end inside the slice
        if step == 1 and start == group * per_group and whole > group + 1:
            pieces.append((slice(start, whole * per_group), group, whole))
            start = whole * per_group
        else:
            end = min(stop, (group + 1) * per_group)
            pieces.append((slice(start, end, step), group, group + 1))
            start += -(-(end - start) // step) * step  # the slice's first row at or past end
    return pieces


# A layer of fewer scores is ranked without a sampled bar unless it spans 4 blocks: the sample's
# extra calls cost more than ranking all its scores (batch 32: 256×100 took 1.0 ms without one,
# 1.5 ms with; at 90%, 512×512 6.9 ms without, 4.9 ms with, 768×3072 38 ms without, 21 ms with,
# benchmarks/gradient_grow.txt).
_SAMPLE_FROM_SCORES = 1 << 16


def _sampled_bar(scores: _GradientScores, k: int, rows_per_block: int) -> Tensor | None:
    """A key that somewhat more than ``k`` of all the scores reach, predicted from evenly strided
    rows (a block's worth, a quarter of the rows at most): the one that 110% of the sample's share
    of ``k``, plus 64, reach. ``None`` for a small layer of a few blocks (no gain)."""
    out_features, in_features = scores.topology.shape
    blocks = -(-out_features // rows_per_block)  # ceil
    if blocks < 4 and out_features * in_features < _SAMPLE_FROM_SCORES:
        return None
    sample = scores.of_strided_rows(max(4, blocks))  # (the sample fits in one block)
    inactive = out_features * in_features - scores.topology.nnz
    in_sample = int((sample >= 0).sum())
    rank = min(in_sample, int(1.1 * k * in_sample / inactive) + 64)
    return kth_largest(sample, rank) if rank >= 1 else None


def _best_above(scores: _GradientScores, k: int, rows_per_block: int, bar) -> Tensor | None:
    """The ``k`` best positions (:func:`gradient_grow`) among the scores at or above ``bar``;
    ``None`` if fewer than ``k`` reach it."""
    out_features = scores.topology.shape[0]
    # candidates, in increasing position (blocks come in order, and cuts keep it), in lists of
    # pieces joined when cut (joining at every block copied them again and again)
    keys: list[Tensor] = []
    positions: list[Tensor] = []
    held, strict = 0, False
    for first in range(0, out_features, rows_per_block):
        # after a cut the bar is a kept score, and a later equal one loses to it (a lower position)
        block_keys, block_positions = scores.above(first, min(out_features, first + rows_per_block), bar, strict)
        keys.append(block_keys)
        positions.append(block_positions)
        held += block_positions.numel()
        if held >= 2 * k:
            best_keys, best_positions = _best_k(keys, positions, k)
            keys, positions = [best_keys], [best_positions]
            held, bar, strict = k, best_keys.min(), True
    if held < k:
        return None
    return _best_k(keys, positions, k)[1]


def _best_k(keys: list[Tensor], positions: list[Tensor], k: int) -> tuple[Tensor, Tensor]:
    """``(keys, positions)`` of the ``k`` best candidates (largest key, then lowest position)
    among pieces in increasing position."""
    keys_joined, positions_joined = torch.cat(keys), torch.cat(positions)
    best = k_largest_positions(keys_joined, k)
    return keys_joined.index_select(0, best), positions_joined.index_select(0, best)
