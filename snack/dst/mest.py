"""MEST: memory-economic sparse training (Yuan et al., NeurIPS 2021).

*MEST: Accurate and Fast Memory-Economic Sparse Training Framework on the Edge*: SET's random
growth, a drop score that may add the gradient of the active connections to their magnitude
(a truly sparse layer has that gradient: ``values.grad``; no dense one is formed), and a *soft
memory bound*: between updates each layer may hold more connections than its target, so grown
connections get a few hundred steps to prove themselves before the next update prunes the
layer back to its target by the score.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from snack.dst.algorithms import check_grow_init, grown_values, saved_counts
from snack.dst.base import NO_POSITIONS, DynamicSparsity, check_state_is_dict, constructor_arguments, outside_snack_dst
from snack.dst.checks import check_fraction, check_nonnegative
from snack.dst.layers import listed
from snack.dst.prune_grow import magnitude_drop, random_grow
from snack.dst.schedules import DropSchedule
from snack.nn import SparseLinear
from snack.ranking import k_smallest_positions, ordering_keys

__all__ = ["MEST"]


class MEST(DynamicSparsity):
    """MEST (Yuan et al., 2021): elastic mutation under a soft memory bound.

    Each layer has a *target* count ``n``: its nnz when the object is built. An update at step
    ``t`` does, in each layer, in one rewiring:

    1. **pruning** to ``n - floor(f_t · n)`` connections, dropping the lowest scores
       ``|w| + λ · |∂L/∂w|``: ``λ`` is ``gradient_weight`` and ``∂L/∂w`` the update step's
       ``values.grad`` (the active connections' gradient, which the layer has anyway; read at
       :meth:`step`, after ``optimizer.step()``); with ``λ = 0`` the smallest ``|w|``.
    2. **growth** at uniformly random positions inactive before the update, up to
       ``n + floor(e_t · n)`` connections.

    ``f_t = drop_fraction · c_t`` (*elastic mutation*: connections replaced below the target)
    and ``e_t = extra_fraction · c_t`` (the *soft memory bound*: connections held above it until
    the next update), with ``c_t = (1 + cos(π t / T)) / 2`` (``schedule="cosine"``) or 1
    (``"constant"``), ``T = floor(stop_fraction · total_steps)``. Updates happen every
    ``update_every`` steps up to ``T``, and at ``T`` itself, whose update prunes every layer to
    its target and grows nothing: the run ends at the target sparsity, which no layer exceeds
    by more than ``extra_fraction · n`` connections meanwhile.

    The defaults are the reference code's MEST+EM&S at 90% sparsity (upper bound 85%: half the
    target again between updates), with a cosine in place of its steps (85% → 87.5% → 90% at
    56% and 75% of the run); its MEST+EM (a hard bound) is ``drop_fraction=0.2,
    extra_fraction=0.0``, which with ``gradient_weight=0`` is :class:`SET` (but for SET's
    update at ``T`` itself under ``schedule="constant"``, where MEST's replaces nothing). The paper scores
    the drop by ``|w| + λ|∂L/∂w|``; the reference code prunes by ``|w|`` (``λ = 0``, the
    default here). Growth excludes every position active before the update (the reference
    code may regrow a connection it just pruned), as SET's and RigL's here do.

    nnz changes at updates where ``e_t`` does (the first, and each while the cosine decays): under
    DDP rebuild the wrapper after an update that changed the topology, as for
    :class:`GradualPruning`. A frozen layer (``values.requires_grad`` False) is left alone while
    frozen. With ``gradient_weight > 0``, at an update that drops some of a layer's connections,
    a layer without ``values.grad`` raises ``RuntimeError`` (nothing changed), and one whose
    gradient holds inf or NaN (an overflowed mixed-precision step) is left alone at that update,
    with a ``RuntimeWarning``.

    To resume, build it with the same arguments, then :meth:`load_state_dict`: the targets come
    from the saved state, so the model may be loaded before or after construction.

    Args:
        model, optimizer, layers, seed, process_group: as for :class:`SET`.
        total_steps: training length in optimizer steps, for the schedule.
        drop_fraction: ``f`` at step 0, in ``[0, 1]``: the fraction of the target pruned below it
            at an update (and regrown).
        extra_fraction: ``e`` at step 0, ``>= 0``: the fraction of the target grown above it at
            an update (growth stops at the layer's size).
        gradient_weight: ``λ >= 0`` of the drop score.
        update_every: steps between updates (``>= 1``).
        stop_fraction: the last update, back to the targets, is at ``stop_fraction · total_steps``.
        schedule: ``"cosine"`` or ``"constant"``.
        grow_init: ``"zero"`` (new weights start at 0, as in the reference code) or ``"random"``.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        total_steps: int,
        drop_fraction: float = 0.0,
        extra_fraction: float = 0.5,
        gradient_weight: float = 0.0,
        update_every: int = 100,
        stop_fraction: float = 0.75,
        schedule: str = "cosine",
        grow_init: str = "zero",
        layers: Iterable[str | SparseLinear] | None = None,
        seed: int = 0,
        process_group=None,
    ):
        layers = listed(layers)
        self._agree_across_ranks(model, optimizer, constructor_arguments(locals()))
        # the decay c_t: a DropSchedule of fraction 1 (its update grid, end step and cosine)
        self.decay = DropSchedule(1.0, update_every, total_steps, stop_fraction, schedule)  # checks them
        self.drop_fraction = check_fraction(drop_fraction, "drop_fraction")
        self.extra_fraction = check_nonnegative(extra_fraction, "extra_fraction")
        self.gradient_weight = check_nonnegative(gradient_weight, "gradient_weight")
        check_grow_init(grow_init)
        self.grow_init = grow_init
        end = self.decay.end_step
        if (self.drop_fraction or self.extra_fraction) and update_every >= end:
            # the only update, if any, is the last one: back to the targets the layers hold already
            warnings.warn(
                f"MEST will never change the topology: updates stop at step {end} of {total_steps} "
                f"(update_every={update_every}, stop_fraction={stop_fraction}; total_steps counts optimizer "
                "steps, not epochs)",
                UserWarning,
                stacklevel=outside_snack_dst(),
            )
        super().__init__(model, optimizer, layers=layers, seed=seed, process_group=process_group)
        self.target_nnz = [layer.nnz for _, layer in self.layers]

    def state_dict(self) -> dict:
        return {**super().state_dict(), "target_nnz": list(self.target_nnz)}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output, including the layers' targets (which a model loaded
        before construction, holding connections above them, does not tell)."""
        check_state_is_dict(state)  # (read before the base class checks the rest)
        target_nnz = saved_counts(state, "target_nnz", self.layers)
        super().load_state_dict(state)
        self.target_nnz = target_nnz

    def _config(self) -> dict:
        d = self.decay
        return {
            "total_steps": d.total_steps, "drop_fraction": self.drop_fraction, "extra_fraction": self.extra_fraction,
            "gradient_weight": self.gradient_weight, "update_every": d.update_every, "stop_fraction": d.stop_fraction,
            "schedule": d.kind, "grow_init": self.grow_init,
        }  # fmt: skip

    def _is_update_step(self, step: int) -> bool:
        # the last update, at the end step, prunes back to the targets
        return self.decay.is_update_step(step) or step == self.decay.end_step >= 1

    def fractions(self, step: int) -> tuple[float, float]:
        """``(f_t, e_t)``: the fractions of a layer's target pruned below it and grown above it
        at ``step``; both 0 from the end step on."""
        if step >= self.decay.end_step:
            return 0.0, 0.0
        decay = self.decay.fraction(step)
        return self.drop_fraction * decay, self.extra_fraction * decay

    def _counts(self, step: int, index: int, layer: SparseLinear) -> tuple[int, int]:
        """``(dropped, grown)`` connections of layer ``index`` at ``step``: down to the target less
        ``floor(f_t · n)``, then up to the target plus ``floor(e_t · n)``, growing at most the
        positions inactive before the update."""
        target = self.target_nnz[index]
        below, above = (math.floor(round(fraction * target, 9)) for fraction in self.fractions(step))
        kept = min(layer.nnz, target - below)
        inactive = layer._growable_count()
        return layer.nnz - kept, min(target + above - kept, inactive)

    def _plan(self, step, index, name, layer):
        dropped, grown = self._counts(step, index, layer)
        if dropped + grown == 0:
            return NO_POSITIONS, NO_POSITIONS, None
        drop = self._drop(step, name, layer, dropped)
        if drop is None:
            return NO_POSITIONS, NO_POSITIONS, None
        grow = random_grow(layer.growth_topology, grown, self.generator)
        return drop, grow, grown_values(self.grow_init, layer, grown, self.generator) if grown else None

    def _drop(self, step: int, name: str, layer: SparseLinear, k: int) -> Tensor | None:
        """Positions into ``layer.values`` of the ``k`` lowest scores ``|w| + λ·|∂L/∂w|`` (sorted;
        ties to the lower position); ``None`` when the gradient is not finite (warned)."""
        values = layer.values.detach()
        if self.gradient_weight == 0 or k == 0:
            return magnitude_drop(values, k)
        gradient = layer.values.grad
        if gradient is None:
            raise RuntimeError(
                f"MEST update at step {step}: layer {name!r} has no gradient (values.grad is None), which its drop "
                f"score |w| + {self.gradient_weight} * |grad| needs. Call dst.step() right after optimizer.step(), "
                "before the gradients are zeroed or set to None, or pass gradient_weight=0"
            )
        consequence = "this layer is left alone at this update"
        if not self._records_are_finite(step, name, (gradient,), consequence, what="the gradient"):
            return None
        # float32 at least: |w| and λ|g| of 16-bit values would round on adding
        dtype = torch.promote_types(values.dtype, torch.float32)
        score = values.abs().to(dtype).add_(gradient.detach().abs().to(dtype), alpha=self.gradient_weight)
        return k_smallest_positions(ordering_keys(score), k)
