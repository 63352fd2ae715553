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

With ``ablation=γ > 0`` (the paper's *neuron ablation*, its ``γ_sal``: 0.3 by the reference code's
default) an update first removes outputs left with too few salient weights: an output's salient weights are
those it keeps after RigL's drop plus those RigL's growth (the layer's ``k`` largest ``|∂L/∂W|`` at
inactive positions) would give it, and an output with fewer than ``γ`` times the layer's fan-in
(``nnz // outputs``) of them loses all its connections; the layer's nnz is spread over the outputs
left (a larger fan-in each). An output without connections counts as ablated and stays so (with
``ablation=0``, the default, every output keeps its share, one without connections included).
Ablation costs a second scoring of the gradient (RigL's growth), about RigL's update again.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from snack.dst.algorithms import DropGrow, grown_values, with_keyword
from snack.dst.base import NO_POSITIONS, constructor_arguments
from snack.dst.checks import check_fraction
from snack.dst.layers import find_layers, listed
from snack.dst.prune_grow import gradient_grow, gradient_grow_rows
from snack.indexing import flat_nonzero
from snack.nn.conv_base import _SparseConvNd
from snack.nn.embedding import SparseEmbedding
from snack.ranking import k_largest_positions, ordering_keys

__all__ = ["SRigL", "balanced_drop", "live_rows"]


class SRigL(DropGrow):
    """RigL with a balanced fan-in: every row of a layer keeps ``nnz // out`` or ``nnz // out + 1``
    connections (SRigL's constant fan-in; with ``ablation`` its neuron ablation: module docstring).

    An update drops RigL's ``floor(fraction · nnz)`` smallest ``|w|``, balanced per row (a few more
    or fewer where rows are above their targets or nearly dense, :func:`balanced_drop`), and grows
    each row back to its target with its largest ``|∂L/∂W|`` among the positions inactive before the
    update (:func:`~snack.dst.prune_grow.gradient_grow_rows`), recorded as :class:`RigL` records it.
    nnz never changes, so it acts on FSDP-sharded layers too. :meth:`drop` is the proposal an
    update balances: a subclass may override it (``k`` unique positions into ``layer.values``);
    growth is not a hook here.

    Arguments as :class:`RigL`, and ``ablation`` (``γ_sal`` in ``[0, 1]``, default 0: no output is
    ablated; the module docstring says how). Its layers are :class:`~snack.SparseLinear` layers and sparse
    convolutions; a :class:`~snack.SparseEmbedding` (whose rows are tokens, not outputs) is refused:
    leave it out with ``layers=``.
    """

    needs_gradient = True

    def __init__(self, model, optimizer, *, ablation: float = 0.0, **kwargs):
        if "layers" in kwargs:
            kwargs["layers"] = listed(kwargs["layers"])
        self._agree_across_ranks(model, optimizer, constructor_arguments(locals()))
        self.ablation = check_fraction(ablation, "ablation")
        for name, layer in find_layers(model, kwargs.get("layers")):  # before the base class arms hooks
            if isinstance(layer, SparseEmbedding):
                raise TypeError(
                    f"SRigL balances each output's fan-in, but layer {name!r} is a {type(layer).__name__}, whose rows "
                    "are tokens: leave it out with layers=... (or train it with RigL)"
                )
        super().__init__(model, optimizer, **kwargs)

    def _config(self) -> dict:
        return {**super()._config(), "ablation": self.ablation}

    def _plan(self, step, index, name, layer):
        k = self._planned_count(step, index, name, layer)
        if k == 0:
            return NO_POSITIONS, NO_POSITIONS, None
        proposal = self._hook_positions(self.drop(layer, k), "drop", name, k)
        topology = layer.topology
        x, dy = self.recorded_as_kept(layer)
        convolution = layer if isinstance(layer, _SparseConvNd) else None
        live = None
        if self.ablation > 0:
            rigl_growth = gradient_grow(x, dy, layer.growth_topology, k, convolution=convolution)
            live = live_rows(topology.row, topology.rowptr, topology.shape[1], proposal, rigl_growth, self.ablation)
        drop, quotas = balanced_drop(layer.values, topology.row, topology.rowptr, topology.shape[1], proposal, live)
        grow = gradient_grow_rows(x, dy, layer.growth_topology, quotas, convolution=convolution)
        return drop, grow, grown_values(self.grow_init, layer, grow.numel(), self.generator)


# what help(SRigL) and inspect show: every argument with its default, not **kwargs
SRigL.__init__.__signature__ = with_keyword(inspect.signature(DropGrow.__init__), "ablation", 0.0, "float")


@torch.no_grad()
def live_rows(
    row: Tensor, rowptr: Tensor, in_features: int, proposal: Tensor, growth: Tensor, ablation: float
) -> Tensor:
    """``(out,)`` bool: the rows an update keeps, by SRigL's neuron ablation. A row with connections
    is ablated when its salient connections, those it keeps after ``proposal`` (positions into the
    values) plus those ``growth`` (linear positions: RigL's growth) gives it, number fewer than
    ``ablation`` times the layer's fan-in (``nnz // rows with connections``); a row without any stays
    ablated. Enough rows stay live to hold nnz (``ceil(nnz / in_features)``, and one), the most
    salient first (ties to the lower row)."""
    nnz, out_features = row.numel(), rowptr.numel() - 1
    counts = rowptr.to(torch.int64).diff()
    alive = counts > 0
    if nnz == 0:
        return alive
    kept = counts - torch.bincount(row.to(torch.int64)[proposal.to(torch.int64)], minlength=out_features)
    salient = kept + torch.bincount(growth.to(torch.int64) // in_features, minlength=out_features)
    fan_in = nnz // int(alive.sum())
    live = alive & (salient >= ablation * fan_in)
    needed = max(1, -(-nnz // in_features))
    if int(live.sum()) < needed:  # keep the most salient rows with connections
        keys = torch.where(alive, salient, -1)
        live = torch.zeros_like(alive)
        live[k_largest_positions(keys, needed)] = True
    return live


@torch.no_grad()
def balanced_drop(
    values: Tensor, row: Tensor, rowptr: Tensor, in_features: int, proposal: Tensor, live: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The connections to drop, and how many to regrow in each row, so that every row ends at its
    target: ``nnz // out`` connections, plus one for the ``nnz % out`` rows that keep the most after
    ``proposal`` (ties to the lower row); with ``live``, ``out`` counts the live rows only, and the
    others' target is 0 (they drop every connection: :func:`live_rows`).

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
        live: ``(out,)`` bool, the rows that keep connections (enough to hold nnz); default all.

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
    if live is None:
        live = torch.ones(out_features, dtype=torch.bool, device=values.device)
    live_count = int(live.sum())
    fan_in, extra = divmod(nnz, live_count) if live_count else (0, 0)
    if fan_in + (extra > 0) > in_features:
        raise ValueError(f"{live_count} live rows of {in_features} positions cannot hold the layer's {nnz} connections")
    target = torch.where(live, fan_in, 0)
    target[k_largest_positions(torch.where(live, counts - dropped, -1), extra)] += 1
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
