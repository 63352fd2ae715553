"""GraNet: gradual magnitude pruning with zero-cost neuroregeneration (Liu et al., 2021).

*Sparse Training via Boosting Pruning Plasticity with Neuroregeneration* (NeurIPS 2021): nnz
shrinks on :class:`~snack.dst.algorithms.GradualPruning`'s cubic schedule, and every update also
replaces a cosine-decayed fraction of each layer's survivors as RigL does (the smallest ``|w|``
dropped, as many grown where ``|∂L/∂W|`` is largest), so a pruned network keeps exploring
connections while it shrinks, and after.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from snack.dst.algorithms import GradualPruning, check_grow_init, gradient_growth, grown_values, replaced_count
from snack.dst.base import NO_POSITIONS, ON_RANK_ZERO, constructor_arguments
from snack.dst.layers import listed
from snack.dst.prune_grow import magnitude_drop
from snack.dst.schedules import DropSchedule
from snack.nn import SparseLinear
from snack.ranking import k_smallest_positions, ordering_keys

__all__ = ["GraNet"]

PRUNINGS = ("global", "layerwise")


class GraNet(GradualPruning):
    """GraNet (Liu et al., 2021): gradual magnitude pruning with zero-cost neuroregeneration.

    An update at step ``t`` does, in each layer, in one rewiring:

    1. **pruning** to the overall sparsity ``s_t`` of :class:`GradualPruning`'s cubic schedule
       (from ``initial_sparsity``, default the model's, at ``start_step`` to ``final_sparsity``
       at ``end_step``). ``pruning="global"`` (the paper's) keeps the
       ``round(positions · (1 - s_t))`` largest ``|w|`` of all the layers together, so the layers'
       densities drift apart as their weights do; ``"layerwise"`` shrinks every layer by the same
       ratio, keeping the distribution ``sparsify`` chose (e.g. ERK), as :class:`GradualPruning`
       does. Either way a layer keeps at least one connection; global pruning ranks raw ``|w|``,
       so a layer whose weights start smaller (a narrow output layer, dense-to-sparse) can be
       thinned to that one: prefer ``"layerwise"`` there, or leave the layer out (``layers=``).
    2. **neuroregeneration**: of the ``n`` connections left, ``k = floor(f_t · n)`` more with the
       smallest ``|w|`` are dropped and ``k`` grown where ``|∂L/∂W|`` of the update step's batch is
       largest among the positions inactive before the update, as :class:`RigL` grows.
       ``f_t = drop_fraction · (1 + cos(π t / T)) / 2`` with ``T = stop_fraction · total_steps``
       (``schedule="constant"``: ``drop_fraction`` until ``T``), 0 after ``T``.

    Updates happen every ``update_every`` steps from ``start_step`` (and at ``end_step``, as for
    :class:`GradualPruning`); after ``end_step`` they regrow only, until ``T``. The paper's setting:
    ``drop_fraction=0.5`` decayed over the whole run (``stop_fraction=1.0``), sparse-to-sparse
    from ``sparsify(model, 0.5)``, or dense-to-sparse from ``sparsify(model, 0.0)``.

    nnz changes at pruning updates: under DDP rebuild the wrapper after an update that changed
    the topology, as for :class:`GradualPruning`. A frozen layer (``values.requires_grad`` False)
    is left alone while frozen (the overall sparsity then stays below ``s_t``); a layer
    whose recorded batch has inf or NaN (an overflowed mixed-precision step) is pruned but
    regrows nothing at that update, with a ``RuntimeWarning``.

    Args:
        model, optimizer, layers, seed, process_group: as for :class:`SET`.
        final_sparsity, start_step, end_step, update_every, initial_sparsity: the pruning
            schedule, as for :class:`GradualPruning`.
        total_steps: training length in optimizer steps, for the regeneration's schedule.
        pruning: ``"global"`` or ``"layerwise"`` (above).
        drop_fraction: ``f`` at step 0, in ``[0, 1]`` (0: no regeneration, plain gradual pruning
            with ``pruning``'s rule).
        stop_fraction: no regeneration after ``stop_fraction · total_steps``.
        schedule: ``"cosine"`` or ``"constant"``.
        grow_init: ``"zero"`` (new weights start at 0, as in the paper) or ``"random"``.
    """

    needs_gradient = True

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        final_sparsity: float,
        start_step: int,
        end_step: int,
        total_steps: int,
        update_every: int = 100,
        initial_sparsity: float | None = None,
        pruning: str = "global",
        drop_fraction: float = 0.5,
        stop_fraction: float = 1.0,
        schedule: str = "cosine",
        grow_init: str = "zero",
        layers: Iterable[str | SparseLinear] | None = None,
        seed: int = 0,
        process_group=None,
    ):
        layers = listed(layers)
        self._agree_across_ranks(model, optimizer, constructor_arguments(locals()))
        self.regrowth = DropSchedule(drop_fraction, update_every, total_steps, stop_fraction, schedule)  # checks them
        if pruning not in PRUNINGS:
            raise ValueError(f"pruning must be one of {PRUNINGS}, got {pruning!r}")
        check_grow_init(grow_init)
        self.pruning, self.grow_init = pruning, grow_init
        self._global_counts: list[int] = []  # each layer's pruned count, during an update with global pruning
        super().__init__(
            model, optimizer, final_sparsity=final_sparsity, start_step=start_step, end_step=end_step,
            update_every=update_every, initial_sparsity=initial_sparsity, layers=layers, seed=seed,
        )  # fmt: skip
        self._arm()

    def _config(self) -> dict:
        r = self.regrowth
        return {
            **super()._config(), "total_steps": r.total_steps, "pruning": self.pruning,
            "drop_fraction": r.drop_fraction, "stop_fraction": r.stop_fraction, "schedule": r.kind,
            "grow_init": self.grow_init,
        }  # fmt: skip

    def _is_update_step(self, step: int) -> bool:
        if super()._is_update_step(step):  # a pruning step
            return True
        # after end_step: regeneration alone, on the same grid, until it stops
        return self.end_step < step <= self.regrowth.end_step and (step - self.start_step) % self.update_every == 0

    def regrowth_fraction(self, step: int) -> float:
        """``f_t``: the fraction of a layer's connections (after pruning) replaced at ``step``."""
        return self.regrowth.fraction(step) if step <= self.regrowth.end_step else 0.0

    def _regrown_count(self, step: int, layer: SparseLinear, survivors: int) -> int:
        """``floor(f_t · survivors)``, at most the positions inactive before the update."""
        return replaced_count(self.regrowth_fraction(step), survivors, layer)

    def _count(self, step: int, layer: SparseLinear) -> int:
        # at most what the update regrows: whether it needs the layer's records
        return self._regrown_count(step, layer, layer.nnz)

    def _before_planning(self, step: int) -> None:
        super()._before_planning(step)
        if self.pruning == "global":
            self._global_counts = self._globally_pruned_counts(step)

    def _pruned_count(self, step: int, index: int, layer: SparseLinear) -> int:
        if self.pruning == "global":
            return self._global_counts[index]
        return super()._pruned_count(step, index, layer)

    def _globally_pruned_counts(self, step: int) -> list[int]:
        """Per layer, how many connections global magnitude pruning removes at ``step``: those
        outside the ``round(positions · (1 - s_t))`` largest ``|w|`` of all the layers, each layer
        keeping its largest (ties: the earlier layer's, then the lower position's, are pruned
        first). Frozen layers are ranked too; their counts are not applied."""
        layers = [layer for _, layer in self.layers]
        total = sum(layer.out_features * layer.in_features for layer in layers)
        excess = sum(layer.nnz for layer in layers) - round(total * (1.0 - self.sparsity(step)))
        if excess <= 0:
            return [0] * len(layers)
        device = layers[0].values.device
        # float64 magnitudes: layers of different dtypes rank on one scale
        magnitudes, owners = [], []
        for index, layer in enumerate(layers):
            if layer.nnz == 0:
                continue
            magnitude = layer.values.detach().abs().to(device=device, dtype=torch.float64)
            largest = int(torch.argmax(magnitude))  # kept: every other connection is a candidate
            magnitudes += [magnitude[:largest], magnitude[largest + 1 :]]
            owners.append(torch.full((layer.nnz - 1,), index, dtype=torch.int64, device=device))
        keys, owners = ordering_keys(torch.cat(magnitudes)), torch.cat(owners)
        pruned = owners[k_smallest_positions(keys, min(excess, keys.numel()))]
        return torch.bincount(pruned, minlength=len(layers)).tolist()

    def _plan(self, step, index, name, layer):
        pruned = self._pruned_count(step, index, layer)
        regrown = self._regrown_count(step, layer, layer.nnz - pruned)
        if regrown:
            recorded = self._batches[index]
            if recorded is ON_RANK_ZERO:
                return NO_POSITIONS, NO_POSITIONS, None  # on several ranks, rank 0 decides from every rank's records
            self._check_recorded(step, name, recorded)
            consequence = "this layer is pruned but regrows nothing at this update"
            if not self._records_are_finite(step, name, recorded, consequence):
                regrown = 0
        if pruned + regrown == 0:
            return NO_POSITIONS, NO_POSITIONS, None
        drop = magnitude_drop(layer.values, pruned + regrown)
        grow = gradient_growth(self, layer, regrown) if regrown else NO_POSITIONS
        return drop, grow, grown_values(self.grow_init, layer, regrown, self.generator) if regrown else None
