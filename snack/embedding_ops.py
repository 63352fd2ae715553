"""The custom ops of a sparse embedding lookup (:class:`snack.SparseEmbedding`).

The table ``E`` is ``(num_embeddings, embedding_dim)`` in the row-major sorted COO form of every
snack layer: token ``t``'s embedding is row ``t``, its connections ``rowptr[t] .. rowptr[t+1]``.

| op | formula |
|---|---|
| ``embedding_lookup`` | ``Y[n, col[p]] = values[p]`` for each connection ``p`` of row ``indices[n]``, else 0 |
| ``embedding_values_grad`` | ``dvalues[p] = Σ_{n: indices[n] = row[p]} dY[n, col[p]]`` |
| ``embedding_bag`` | ``Y[b] = Σ_{n: bag[n] = b} weights[n] · E[indices[n]]`` (a sum or mean of a bag) |
| ``embedding_bag_values_grad`` | ``dvalues[p] = Σ_{n: indices[n] = row[p]} weights[n] · dY[bag[n], col[p]]`` |

Both touch only the connections of the tokens looked up (``N · embedding_dim · density`` of
them): never the ``(num_embeddings, embedding_dim)`` table nor a gradient of its size, which
``nn.Embedding``'s backward forms. On the CPU native kernels run them
(``snack/backends/cpu/embedding_kernels.cpp``: one pass over each row's connections, the
backward a thread per table row); elsewhere (and under ``use_backend("reference")``) torch's index
ops do, the same on every device. Both compile (``torch.compile``: the output's shape is known
without running them) and export.
"""

from __future__ import annotations

import torch
from torch import Tensor

from snack.indexing import native_for

__all__ = [
    "embedding_bag", "embedding_bag_values_grad", "embedding_lookup", "embedding_lookup_for_transforms",
    "embedding_values_grad", "table_of_rows_looked_up", "without_padding_gradient",
]


def _connections_of(indices: Tensor, rowptr: Tensor) -> tuple[Tensor, Tensor]:
    """``(token (M,), position (M,))``, int64: for every connection of every looked-up row, the
    index ``n`` of the token (into ``indices (N,)``) and the connection's position in
    ``values``; tokens in order, each row's connections in column order."""
    starts = rowptr.index_select(0, indices).long()
    counts = rowptr.index_select(0, indices + 1).long() - starts
    token = torch.repeat_interleave(torch.arange(indices.numel(), device=indices.device), counts)
    # connection i (counted over all tokens) of token n is the (i - first[n])-th of its row
    first = torch.cumsum(counts, 0) - counts
    position = (starts - first).index_select(0, token) + torch.arange(token.numel(), device=indices.device)
    return token, position


def _output_positions(token: Tensor, position: Tensor, col: Tensor, embedding_dim: int) -> Tensor:
    """``(M,)`` int64: where each connection lands in the flattened ``(N, embedding_dim)`` output."""
    return token * embedding_dim + col.index_select(0, position).long()


@torch.library.custom_op("snack::embedding_lookup", mutates_args=())
def embedding_lookup(
    values: Tensor, row: Tensor, col: Tensor, rowptr: Tensor, indices: Tensor, embedding_dim: int
) -> Tensor:
    """``(N, embedding_dim)``: the rows ``indices (N,)`` (int64, each in range) of the sparse
    table of ``values``, ``row``, ``col`` (``(nnz,)``) and its ``rowptr (num_embeddings + 1,)``,
    zeros off its connections. (``row`` is read only by the ONNX translation: the kernels walk
    ``rowptr``.)"""
    if native_for(values, rowptr, col, indices):
        return torch.ops.snack_cpu.embedding_lookup(values, rowptr, col, indices, embedding_dim)
    output = values.new_zeros(indices.numel() * embedding_dim)
    token, position = _connections_of(indices, rowptr)
    output.index_put_((_output_positions(token, position, col, embedding_dim),), values.index_select(0, position))
    return output.view(indices.numel(), embedding_dim)


@embedding_lookup.register_fake
def _(values, row, col, rowptr, indices, embedding_dim):
    return values.new_empty(indices.shape[0], embedding_dim)


@torch.library.custom_op("snack::embedding_values_grad", mutates_args=())
def embedding_values_grad(grad: Tensor, row: Tensor, col: Tensor, rowptr: Tensor, indices: Tensor) -> Tensor:
    """``(nnz,)``: the gradient of the loss with respect to ``values`` given the lookup's output
    gradient ``grad (N, embedding_dim)``: each connection's sum over the tokens of its row (zero
    for rows not looked up)."""
    if native_for(grad, rowptr, col, indices):
        return torch.ops.snack_cpu.embedding_values_grad(grad, rowptr, col, indices)
    token, position = _connections_of(indices, rowptr)
    picked = grad.reshape(-1).index_select(0, _output_positions(token, position, col, grad.shape[1]))
    return grad.new_zeros(col.shape[0]).index_add_(0, position, picked)


@embedding_values_grad.register_fake
def _(grad, row, col, rowptr, indices):
    return grad.new_empty(col.shape[0])


def _setup_context(ctx, inputs, output) -> None:
    _, row, col, rowptr, indices, _ = inputs
    ctx.save_for_backward(row, col, rowptr, indices)


def _backward(ctx, grad: Tensor):
    row, col, rowptr, indices = ctx.saved_tensors
    dvalues = embedding_values_grad(grad.contiguous(), row, col, rowptr, indices) if ctx.needs_input_grad[0] else None
    return dvalues, None, None, None, None, None


embedding_lookup.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("snack::embedding_bag", mutates_args=())
def embedding_bag(
    values: Tensor, row: Tensor, col: Tensor, rowptr: Tensor, indices: Tensor, bag: Tensor, weights: Tensor,
    bags: int, embedding_dim: int,
) -> Tensor:
    """``(bags, embedding_dim)``: each bag's sum of its ids' table rows, each times its weight:
    ``Y[b] = Σ_{n: bag[n] = b} weights[n] · E[indices[n]]``, ``indices (N,)`` int64 in range,
    ``bag (N,)`` int64 non-decreasing in ``[0, bags)`` (each bag's ids consecutive), ``weights
    (N,)`` in ``values``' dtype (a mean's ``1 / size``, 0 for a padding id). The native kernel sums
    a bag as it reads its ids' connections; elsewhere the rows are looked up, then added."""
    if native_for(values, rowptr, col, indices, bag, weights):
        return torch.ops.snack_cpu.embedding_bag(values, rowptr, col, indices, bag, weights, bags, embedding_dim)
    rows = embedding_lookup(values, row, col, rowptr, indices, embedding_dim)
    return rows.new_zeros(bags, embedding_dim).index_add_(0, bag, rows * weights.unsqueeze(-1))


@embedding_bag.register_fake
def _(values, row, col, rowptr, indices, bag, weights, bags, embedding_dim):
    return values.new_empty(bags, embedding_dim)


@torch.library.custom_op("snack::embedding_bag_values_grad", mutates_args=())
def embedding_bag_values_grad(
    grad: Tensor, row: Tensor, col: Tensor, rowptr: Tensor, indices: Tensor, bag: Tensor, weights: Tensor
) -> Tensor:
    """``(nnz,)``: the gradient with respect to ``values`` of :func:`embedding_bag` given its output
    gradient ``grad (bags, embedding_dim)``."""
    if native_for(grad, rowptr, col, indices, bag, weights):
        return torch.ops.snack_cpu.embedding_bag_values_grad(grad, rowptr, col, indices, bag, weights)
    return embedding_values_grad(grad.index_select(0, bag) * weights.unsqueeze(-1), row, col, rowptr, indices)


@embedding_bag_values_grad.register_fake
def _(grad, row, col, rowptr, indices, bag, weights):
    return grad.new_empty(col.shape[0])


def _bag_setup_context(ctx, inputs, output) -> None:
    values, row, col, rowptr, indices, bag, weights, _, embedding_dim = inputs
    ctx.embedding_dim = embedding_dim
    # values only for the weights' gradient (a backward without it needs none, as the lookup's)
    ctx.save_for_backward(row, col, rowptr, indices, bag, weights, values if weights.requires_grad else None)


def _bag_backward(ctx, grad: Tensor):
    row, col, rowptr, indices, bag, weights, values = ctx.saved_tensors
    grad = grad.contiguous()
    dvalues = dweights = None
    if ctx.needs_input_grad[0]:
        dvalues = embedding_bag_values_grad(grad, row, col, rowptr, indices, bag, weights)
    if ctx.needs_input_grad[6]:  # dweights[n] = E[indices[n]] · dY[bag[n]]
        rows = embedding_lookup(values, row, col, rowptr, indices, ctx.embedding_dim)
        dweights = (rows * grad.index_select(0, bag)).sum(-1)
    return dvalues, None, None, None, None, None, dweights, None, None


embedding_bag.register_autograd(_bag_backward, setup_context=_bag_setup_context)


def embedding_lookup_for_transforms(
    values: Tensor, row: Tensor, col: Tensor, rowptr: Tensor, indices: Tensor, embedding_dim: int
) -> Tensor:
    """:func:`embedding_lookup` in differentiable torch ops of shapes known from the unbatched
    ``rowptr``: what a lookup runs inside ``torch.func`` transforms (``grad``, ``vmap`` over the ids
    or the values, ``jvp``) and forward-mode AD, which the custom op does not support. Each id reads
    ``width`` = the longest row's connection count of slots (the missing ones masked), so it
    holds ``(N, width)`` temporaries, ``width <= embedding_dim``: never the table."""
    lengths = rowptr[1:] - rowptr[:-1]
    width = int(lengths.max()) if lengths.numel() else 0
    slots = torch.arange(width, device=indices.device)
    starts = rowptr[indices].long()
    present = slots < (rowptr[indices + 1].long() - starts).unsqueeze(-1)  # (N, width)
    positions = torch.where(present, starts.unsqueeze(-1) + slots, 0)  # (missing slots read entry 0, masked)
    picked = torch.where(present, values[positions], 0)
    output = values.new_zeros(*indices.shape, embedding_dim)
    return output.scatter_add(-1, col[positions].long(), picked)


class _GatherWithSparseGradient(torch.autograd.Function):
    """``values[positions]``, whose gradient reaches ``values`` as a sparse COO tensor at
    ``positions`` (sorted, unique): no ``(nnz,)`` tensor is formed."""

    @staticmethod
    def forward(values: Tensor, positions: Tensor) -> Tensor:
        return values.index_select(0, positions)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        values, positions = inputs
        ctx.save_for_backward(positions)
        ctx.length = values.shape[0]

    @staticmethod
    def backward(ctx, grad: Tensor):
        (positions,) = ctx.saved_tensors
        sparse = torch.sparse_coo_tensor(
            positions.unsqueeze(0), grad, (ctx.length,), is_coalesced=True,
            check_invariants=False,  # (sorted and unique by construction)
        )
        return sparse, None


def table_of_rows_looked_up(
    values: Tensor, rowptr: Tensor, col: Tensor, ids: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(values, row, col, rowptr, ids)`` of the table of only the rows of ``ids (N,)``, in the
    order of their ids, for a lookup whose gradient reaches ``values`` as a sparse COO tensor of
    those rows' connections (``nn.Embedding(sparse=True)``'s rule: an optimizer for sparse
    gradients, ``torch.optim.SparseAdam`` or ``SGD``, then steps only them).

    The small table's values are gathered from ``values`` (``(M,)``, ``M`` the rows' connections),
    its ids are the positions of ``ids`` among the rows (int64); looked up, and its gradient formed,
    as any table's, it touches nothing of the size of ``nnz``."""
    rows, local_ids = torch.unique(ids, return_inverse=True)
    token, positions = _connections_of(rows, rowptr)
    counts = rowptr.index_select(0, rows + 1) - rowptr.index_select(0, rows)
    local_rowptr = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0, dtype=rowptr.dtype)])
    local_values = _GatherWithSparseGradient.apply(values, positions)
    return local_values, token.to(col.dtype), col.index_select(0, positions), local_rowptr, local_ids


def without_padding_gradient(output: Tensor, ids: Tensor, padding_idx: int | None) -> Tensor:
    """``output (N, embedding_dim)`` of the lookup of ``ids (N,)``, through which the rows of
    ``padding_idx`` pass no gradient (``nn.Embedding``'s rule: a padding token's embedding does not
    train); ``output`` itself without one."""
    if padding_idx is None:
        return output
    return torch.where((ids == padding_idx).unsqueeze(-1), output.detach(), output)
