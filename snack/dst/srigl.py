"""SRigL's constant fan-in (Lasby et al., *Dynamic Sparse Training with Structured Sparsity*,
ICLR 2024): RigL whose updates keep every row of a layer at the same number of connections.

A row is one output (a :class:`~snack.SparseLinear`'s output feature, a convolution's output
channel): with a constant fan-in each output reads the same number of inputs, a structure that
kernels can store without a row pointer and balance without effort (the paper's condensed
representation), and that the paper trains to RigL's accuracy. Each update here:

1. proposes RigL's drop: the ``k = floor(fraction · nnz)`` smallest ``|w|`` of the layer
   (:meth:`SRigL.drop`);
2. balances it per row (:func:`balanced_drop`): each row's target is ``nnz // out`` connections,
   one more for the ``nnz % out`` rows keeping the most, so nnz stays; a row above its target after
   the proposal drops its smallest ``|w|`` down to it, and a row whose regrowth would not fit among
   the positions inactive before the update (a nearly dense row) keeps its largest proposed ones;
3. regrows in each row what it is short of its target, its largest ``|∂L/∂W|`` at positions
   inactive before the update (:func:`snack.dst.prune_grow.gradient_grow_rows`).

A layer whose rows already hold their targets (a constant fan-in when ``out`` divides ``nnz``)
keeps them: every row regrows what it lost. Any other topology (``snack.sparsify`` draws rows of
varying counts) is balanced by the first update that replaces something in it.

Not here: the paper's *neuron ablation* (removing outputs left with too few salient weights, and
spreading their fan-in over the others); every output keeps its share.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from snack.dst.algorithms import DropGrow, grown_values
from snack.dst.base import NO_POSITIONS, constructor_arguments
from snack.dst.layers import find_layers, listed
from snack.dst.prune_grow import gradient_grow_rows
from snack.indexing import flat_nonzero
from snack.nn.conv_base import _SparseConvNd
from snack.nn.embedding import SparseEmbedding
from snack.ranking import k_largest_positions, ordering_keys

__all__ = ["SRigL", "balanced_drop"]


class SRigL(DropGrow):
    """RigL with a balanced fan-in: every row of a layer keeps ``nnz // out`` or ``nnz // out + 1``
    connections (SRigL's constant fan-in, without its neuron ablation; module docstring).

    An update drops RigL's ``floor(fraction · nnz)`` smallest ``|w|``, balanced per row (a few more
    or fewer where rows are above their targets or nearly dense, :func:`balanced_drop`), and grows
    each row back to its target with its largest ``|∂L/∂W|`` among the positions inactive before the
    update (:func:`~snack.dst.prune_grow.gradient_grow_rows`), recorded as :class:`RigL` records it.
    nnz never changes, so it acts on FSDP-sharded layers too. :meth:`drop` is the proposal an
    update balances: a subclass may override it (``k`` unique positions into ``layer.values``);
    growth is not a hook here.

    Arguments as :class:`RigL`. Its layers are :class:`~snack.SparseLinear` layers and sparse
    convolutions; a :class:`~snack.SparseEmbedding` (whose rows are tokens, not outputs) is refused:
    leave it out with ``layers=``.
    """

    needs_gradient = True

    def __init__(self, model, optimizer, **kwargs):
        if "layers" in kwargs:
            kwargs["layers"] = listed(kwargs["layers"])
        self._agree_across_ranks(model, optimizer, constructor_arguments(locals()))
        for name, layer in find_layers(model, kwargs.get("layers")):  # before the base class arms hooks
            if isinstance(layer, SparseEmbedding):
                raise TypeError(
                    f"SRigL balances each output's fan-in, but layer {name!r} is a {type(layer).__name__}, whose rows "
                    "are tokens: leave it out with layers=... (or train it with RigL)"
                )
        super().__init__(model, optimizer, **kwargs)

    def _plan(self, step, index, name, layer):
        k = self._planned_count(step, index, name, layer)
        if k == 0:
            return NO_POSITIONS, NO_POSITIONS, None
        proposal = self._hook_positions(self.drop(layer, k), "drop", name, k)
        topology = layer.topology
        drop, quotas = balanced_drop(layer.values, topology.row, topology.rowptr, topology.shape[1], proposal)
        x, dy = self.recorded_as_kept(layer)
        convolution = layer if isinstance(layer, _SparseConvNd) else None
        grow = gradient_grow_rows(x, dy, layer.growth_topology, quotas, convolution=convolution)
        return drop, grow, grown_values(self.grow_init, layer, grow.numel(), self.generator)


# what help(SRigL) and inspect show: DropGrow's arguments with their defaults, not **kwargs
SRigL.__init__.__signature__ = inspect.signature(DropGrow.__init__)


@torch.no_grad()
def balanced_drop(
    values: Tensor, row: Tensor, rowptr: Tensor, in_features: int, proposal: Tensor
) -> tuple[Tensor, Tensor]:
    """The connections to drop, and how many to regrow in each row, so that every row ends at its
    target: ``nnz // out`` connections, plus one for the ``nnz % out`` rows that keep the most after
    ``proposal`` (ties to the lower row).

    Each row drops what ``proposal`` drops in it, moved to the nearest count in
    ``[count - target, in_features - target]``: a row above its target after the proposal also drops
    its smallest ``|w|`` down to it; a row that could not regrow to its target among its positions
    inactive now (one that is nearly dense) keeps its largest ``|w|`` of those proposed instead.
    Equal magnitudes go to the lower position.

    Args:
        values: ``(nnz,)`` the layer's weights.
        row: ``(nnz,)`` their rows (sorted, as a :class:`~snack.topology.Topology` holds them).
        rowptr: ``(out + 1,)`` the row pointer.
        in_features: positions per row.
        proposal: ``(k,)`` unique positions into ``values``: the drop to balance.

    Returns:
        ``(drop, quotas)``: ``drop`` int64 positions into ``values``, sorted; ``quotas`` ``(out,)``
        int64, what each row regrows (never more than its positions inactive now), summing to
        ``drop``'s length.
    """
    nnz, out_features = values.numel(), rowptr.numel() - 1
    proposal = proposal.to(device=values.device, dtype=torch.int64)
    if proposal.numel() and (int(proposal.min()) < 0 or int(proposal.max()) >= nnz):
        raise ValueError(f"the drop must hold positions into the layer's {nnz} values, got some outside [0, {nnz})")
    dropping = torch.zeros(nnz, dtype=torch.bool, device=values.device)
    dropping[proposal] = True
    if int(dropping.sum()) != proposal.numel():
        raise ValueError("the drop must hold unique positions, got one more than once")
    row = row.to(torch.int64)
    counts = rowptr.to(torch.int64).diff()
    dropped = torch.bincount(row[proposal], minlength=out_features)
    fan_in, extra = divmod(nnz, out_features) if out_features else (0, 0)
    target = torch.full_like(counts, fan_in)
    target[k_largest_positions(counts - dropped, extra)] += 1
    balanced = torch.minimum(torch.maximum(dropped, counts - target), in_features - target)
    more, fewer = (balanced - dropped).clamp_min(0), (dropped - balanced).clamp_min(0)
    if bool(more.any()):  # rows above their targets: their smallest kept ones go too
        candidates = flat_nonzero(~dropping & (more[row] > 0))
        dropping[_first_in_rows(candidates, row, values, more, largest=False)] = True
    if bool(fewer.any()):  # rows with too little room to regrow: their largest proposed ones stay
        candidates = flat_nonzero(dropping & (fewer[row] > 0))
        dropping[_first_in_rows(candidates, row, values, fewer, largest=True)] = False
    return flat_nonzero(dropping), target - counts + balanced


def _first_in_rows(candidates: Tensor, row: Tensor, values: Tensor, quota: Tensor, *, largest: bool) -> Tensor:
    """Of ``candidates`` (positions into ``values``, increasing), the ``quota[r]`` of each row ``r``
    with the smallest ``|w|`` (the largest if ``largest``); equal magnitudes to the lower position."""
    keys = ordering_keys(values[candidates].abs())
    # by magnitude, then (stably) by row: each row's candidates in order, lower positions first on ties
    order = torch.sort(keys, stable=True, descending=largest).indices
    order = order[torch.sort(row[candidates][order], stable=True).indices]
    rows = row[candidates][order]
    rank = torch.arange(rows.numel(), device=rows.device) - torch.searchsorted(rows, rows)
    return candidates[order[rank < quota[rows]]]
