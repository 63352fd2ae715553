"""SET, RigL and gradual magnitude pruning: drop/grow scores plus a schedule.

All three share :class:`~snack.dst.base.DynamicSparsity` (argument checks, step counter, seeded
RNG, gradient records, ``state_dict``), :mod:`snack.dst.layers` (which layers) and
:func:`snack.dst.update.plan_rewire` (the update itself). SET and RigL are :class:`DropGrow`
subclasses, the public base for new drop-and-grow algorithms. They differ only in how many
connections each update replaces and in their drop and grow scores:

=============== ============================== ========================================
algorithm       drop                           grow
=============== ============================== ========================================
SET             lowest ``|w|`` (or sign split) uniformly random inactive positions
RigL            lowest ``|w|``                 largest ``|∂L/∂W|`` at inactive positions
GradualPruning  lowest ``|w|``, nnz shrinks    nothing
=============== ============================== ========================================

:class:`~snack.dst.granet.GraNet` (its own module) prunes as GradualPruning does (or globally)
and regrows as RigL does; :class:`~snack.dst.mest.MEST` (its own module) drops by ``|w|`` (plus
``λ|∂L/∂w|``) and grows as SET does, above each layer's target between updates.

Growth is among positions inactive *before* the drop, so a connection dropped in an update is
never regrown in the same update (RigL's and SET's reference code may regrow one; the README's
*Departures from the reference code* lists this and the other differences).
"""

from __future__ import annotations

import inspect
import math
import numbers
import warnings
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from snack.dst.base import (
    NO_POSITIONS,
    ON_RANK_ZERO,
    DynamicSparsity,
    check_state_is_dict,
    constructor_arguments,
    outside_snack_dst,
)
from snack.dst.checks import check_int
from snack.dst.layers import find_layers, listed
from snack.dst.prune_grow import gradient_grow, magnitude_drop, random_grow
from snack.dst.schedules import DropSchedule, cubic_sparsity
from snack.nn import SparseLinear
from snack.nn.conv_base import _SparseConvNd
from snack.topology import check_sparsity

__all__ = ["RigL", "SET", "DropGrow", "GradualPruning"]

GROW_INITS = ("zero", "random")


def check_grow_init(grow_init) -> None:
    if grow_init not in GROW_INITS:
        raise ValueError(f"grow_init must be one of {GROW_INITS}, got {grow_init!r}")


def replaced_count(fraction: float, connections: int, layer: SparseLinear) -> int:
    """``floor(fraction · connections)``: how many of ``connections`` an update replaces in
    ``layer``, at most the positions inactive in it (growth takes only those)."""
    inactive = layer._growable_count()
    # (rounded to 9 places first: 0.29 · 100 is 28.999999999999996 in binary floating point)
    return min(math.floor(round(fraction * connections, 9)), inactive)


def saved_counts(state: dict, key: str, layers: list[tuple[str, SparseLinear]]) -> list[int]:
    """``state[key]``, a saved connection count per layer, after checking it lists one int from 0 to
    the layer's size for each of ``layers``; ``ValueError`` naming ``key`` otherwise."""
    counts = state.get(key)
    sizes = [layer.out_features * layer.in_features for _, layer in layers]
    if (
        not isinstance(counts, list) or len(counts) != len(layers)
        or not all(isinstance(n, numbers.Integral) and not isinstance(n, bool) and 0 <= n <= size
                   for n, size in zip(counts, sizes))
    ):
        raise ValueError(
            f"cannot load DST state: {key} must list {len(layers)} counts, each an int from 0 to the "
            f"layer's size {sizes}, got {counts!r}"
        )
    return [int(n) for n in counts]


def grown_values(grow_init: str, layer: SparseLinear, k: int, generator: torch.Generator) -> Tensor | None:
    """``(k,)`` initial weights of ``k`` connections grown in ``layer``: ``None`` (zeros) for
    ``grow_init="zero"``; for ``"random"`` the layer's own init (a :class:`SparseLinear`'s
    ``U(-1/√fan_in, 1/√fan_in)`` with ``fan_in = nnz / out``, a :class:`SparseEmbedding`'s normal),
    drawn from ``generator``."""
    if grow_init == "zero":
        return None
    return layer._random_initial_values(k, generator).to(device=layer.values.device, dtype=layer.values.dtype)


def gradient_growth(dst: DynamicSparsity, layer: SparseLinear, k: int) -> Tensor:
    """RigL's growth: the ``k`` inactive positions of ``layer`` with the largest ``|∂L/∂W|`` of the
    batch ``dst`` recorded (a convolution's from its padded input, never its im2col rows; a tied
    embedding's from its lookups and its uses as the head)."""
    x, dy = dst.recorded_as_kept(layer)
    convolution = layer if isinstance(layer, _SparseConvNd) else None
    head = dst.recorded_head_batch(layer)
    return gradient_grow(x, dy, layer.growth_topology, k, convolution=convolution, head=head)


class DropGrow(DynamicSparsity):
    """Base of drop-and-grow algorithms (SET, RigL, and your own): every update replaces a
    scheduled fraction of each layer's connections, ``k = floor(fraction · nnz)``, keeping nnz.

    To write a new algorithm, subclass it and override :meth:`grow` (and :meth:`drop`, which by
    default drops the smallest ``|w|``). Both see one layer and ``k``, may draw from
    ``self.generator`` (seeded, saved in :meth:`state_dict`) and must not change anything. Set
    ``needs_gradient = True`` to read the step's inputs and output gradients with
    :meth:`recorded_batch` (a convolution's as im2col rows; :meth:`recorded_as_kept` gives its
    padded input, which ``gradient_grow(..., convolution=layer)`` scores without them). Everything
    else is this class's: the schedule, the optimizer-state remap, checking what the hooks return
    (``k`` unique positions each; grown ones inactive, or dropped by this update: a regrown
    connection restarts at its grow value with fresh optimizer state), all layers planned before any
    changes, and on several ranks one choice (rank 0's) for all. Frozen layers are left alone (see
    :class:`DynamicSparsity`); with ``needs_gradient``, so is a layer whose recorded batch has a
    non-finite value (inf or NaN: an overflowed mixed-precision step), with a ``RuntimeWarning``
    naming it and the step::

        class RandomDropGradientGrow(snack.dst.DropGrow):
            needs_gradient = True

            def drop(self, layer, k):
                return torch.randperm(layer.nnz, generator=self.generator)[:k]

            def grow(self, layer, k):
                x, dy = self.recorded_batch(layer)
                convolutions = (snack.SparseConv2d, snack.SparseConv3d, snack.SparseConvTranspose2d,
                                snack.SparseConvTranspose3d)  # (the 1-D ones subclass the 2-D ones)
                conv = layer if isinstance(layer, convolutions) else None  # its kernel, groups
                head = self.recorded_head_batch(layer)  # a tied embedding's use as the head, else None
                return snack.dst.gradient_grow(x, dy, layer.growth_topology, k, convolution=conv, head=head)

    A subclass's own constructor arguments are not compared across ranks, nor saved in
    :meth:`state_dict`.

    Args: as :class:`SET` (without ``split_sign``).
    """

    keeps_nnz = True  # k dropped, k grown: it acts on FSDP-sharded layers too

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        drop_fraction: float = 0.3,
        update_every: int = 100,
        total_steps: int,
        stop_fraction: float = 0.75,
        schedule: str = "cosine",
        grow_init: str = "zero",
        layers: Iterable[str | SparseLinear] | None = None,
        seed: int = 0,
        process_group=None,
    ):
        # (a class property: every rank raises alike; a subclass planning its own way needs no hook)
        if type(self).grow is DropGrow.grow and type(self)._plan is DropGrow._plan:
            raise TypeError(f"{type(self).__name__} must implement grow(layer, k): DropGrow has no default growth")
        layers = listed(layers)
        self._agree_across_ranks(model, optimizer, constructor_arguments(locals()))
        self.schedule = DropSchedule(drop_fraction, update_every, total_steps, stop_fraction, schedule)  # checks them
        check_grow_init(grow_init)
        why = self.schedule.why_static()
        if why is not None:  # a DST run that would silently train a static topology
            warnings.warn(
                f"{type(self).__name__} will never change the topology: {why} "
                f"(update_every={self.schedule.update_every}, stop_fraction={self.schedule.stop_fraction}; "
                "total_steps counts optimizer steps, not epochs)",
                UserWarning,
                stacklevel=outside_snack_dst(),
            )
        self.grow_init = grow_init
        super().__init__(model, optimizer, layers=layers, seed=seed, process_group=process_group)
        self._arm()

    def _config(self) -> dict:
        s = self.schedule
        return {
            "drop_fraction": s.drop_fraction, "update_every": s.update_every, "total_steps": s.total_steps,
            "stop_fraction": s.stop_fraction, "schedule": s.kind, "grow_init": self.grow_init,
        }

    def _is_update_step(self, step: int) -> bool:
        return self.schedule.is_update_step(step)

    def _count(self, step: int, layer: SparseLinear) -> int:
        """Connections to replace: ``floor(fraction · nnz)``, at most the inactive positions."""
        return replaced_count(self.schedule.fraction(step), layer.nnz, layer)

    def drop(self, layer: SparseLinear, k: int) -> Tensor:
        """``(k,)`` unique positions into ``layer.values`` of the connections to remove; by
        default the ``k`` smallest ``|w|`` (:func:`snack.dst.prune_grow.magnitude_drop`)."""
        return magnitude_drop(layer.values, k)

    def grow(self, layer: SparseLinear, k: int) -> Tensor:
        """``(k,)`` unique linear positions ``r · in_features + c`` to add, each inactive (or
        among those :meth:`drop` returned) in ``layer.growth_topology``: the topology before
        this update (a :class:`SparseEmbedding`'s padding row counted as full; see
        :func:`snack.dst.prune_grow.random_grow`, ``gradient_grow``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement grow(layer, k)")

    def _plan(self, step, index, name, layer):
        k = self._planned_count(step, index, name, layer)
        if k == 0:
            return NO_POSITIONS, NO_POSITIONS, None
        drop = self._hook_positions(self.drop(layer, k), "drop", name, k)
        grow = self._hook_positions(self.grow(layer, k), "grow", name, k)
        _refuse_ungrowable_rows(self, layer, grow, name)
        return drop, grow, grown_values(self.grow_init, layer, k, self.generator)

    def _planned_count(self, step: int, index: int, name: str, layer: SparseLinear) -> int:
        """:meth:`_count` for layer ``index`` at this update, or 0 where this rank leaves it alone:
        nothing to replace, a rank other than 0 of several (rank 0 decides from every rank's
        records), or a record holding inf or NaN (warned). Raises where nothing was recorded."""
        k = self._count(step, layer)
        recorded = self._batches[index] if self._capture is not None else ()
        if k == 0 or recorded is ON_RANK_ZERO:
            return 0
        self._check_recorded(step, name, recorded)
        if not self._records_are_finite(step, name, recorded, "this layer is left alone at this update"):
            return 0
        return k

    def _hook_positions(self, positions, hook: str, name: str, k: int) -> Tensor:
        """What :meth:`drop` or :meth:`grow` returned, after checking it holds ``k`` positions
        (their values are checked by :func:`snack.dst.update.plan_rewire`)."""
        if not isinstance(positions, Tensor) or positions.shape != (k,):
            shown = f"shape {tuple(positions.shape)}" if isinstance(positions, Tensor) else type(positions).__name__
            raise ValueError(f"{type(self).__name__}.{hook} must return {k} positions for layer {name!r}, got {shown}")
        if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
            raise TypeError(
                f"{type(self).__name__}.{hook} must return integer positions for layer {name!r}, got {positions.dtype}"
            )
        return positions


def _refuse_ungrowable_rows(dst: DynamicSparsity, layer: SparseLinear, grow: Tensor, name: str) -> None:
    """Raise if a :meth:`DropGrow.grow` hook returned a position in a row growth must avoid (a
    :class:`SparseEmbedding`'s padding row, whose connections never train)."""
    rows = layer._ungrowable_rows()
    if not rows or grow.numel() == 0:
        return
    in_rows = torch.isin(grow.to(torch.int64) // layer.in_features, torch.tensor(rows, device=grow.device))
    if bool(in_rows.any()):
        position = int(grow[in_rows][0])
        raise ValueError(
            f"{type(dst).__name__}.grow returned position {position} of layer {name!r}, in row "
            f"{position // layer.in_features}, where no connection may grow (the padding row of a SparseEmbedding: "
            "it never trains); grow among the inactive positions of layer.growth_topology"
        )


class SET(DropGrow):
    """Sparse Evolutionary Training (Mocanu et al., 2018): drop the weakest ``|w|``, regrow at random.

    Args:
        model: contains :class:`SparseLinear` layers (e.g. from :func:`snack.sparsify`).
        optimizer: holds the layers' ``values``; its per-element state is remapped at updates.
        drop_fraction: fraction of each layer's connections replaced per update, in ``[0, 1]``.
        update_every: steps between updates (``>= 1``).
        total_steps: training length, for the schedule.
        stop_fraction: no updates after ``stop_fraction · total_steps``.
        schedule: ``"cosine"`` decays the drop fraction to 0 at the stop step; ``"constant"``.
        split_sign: SET's original drop rule (smallest positive and largest negative weights
            separately) instead of the smallest ``|w|``.
        grow_init: ``"zero"`` (new weights start at 0) or ``"random"`` (the layer's init).
        layers: names (or glob patterns, ``"encoder.*"``) or modules of the layers to act on,
            any iterable (default: every ``SparseLinear``). A frozen one (``values.requires_grad`` False) is left alone
            while it is frozen.
        seed: seeds the RNG of the random growth, in ``[0, 2**64 - 1]``.
        process_group: the ranks that train this model together (default: all, when
            ``torch.distributed`` is initialized); see :class:`DynamicSparsity`.
    """

    def __init__(self, model, optimizer, *, split_sign: bool = False, **kwargs):
        if "layers" in kwargs:
            kwargs["layers"] = listed(kwargs["layers"])
        self._agree_across_ranks(model, optimizer, constructor_arguments(locals()))
        if not isinstance(split_sign, bool):
            raise TypeError(f"split_sign must be a bool, got {split_sign!r}")
        self.split_sign = split_sign
        super().__init__(model, optimizer, **kwargs)

    def _config(self) -> dict:
        return {**super()._config(), "split_sign": self.split_sign}

    def drop(self, layer, k):
        return magnitude_drop(layer.values, k, split_sign=self.split_sign)

    def grow(self, layer, k):
        return random_grow(layer.growth_topology, k, self.generator)


def with_keyword(base: inspect.Signature, name: str, default, annotation: str) -> inspect.Signature:
    """``base`` (DropGrow's constructor) with a subclass's keyword argument ``name`` first among its
    keyword arguments: what ``help()`` and ``inspect`` show for a constructor taking ``**kwargs``."""
    parameters = list(base.parameters.values())
    first_keyword = next(i for i, p in enumerate(parameters) if p.kind is inspect.Parameter.KEYWORD_ONLY)
    added = inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
    return base.replace(parameters=[*parameters[:first_keyword], added, *parameters[first_keyword:]])


SET.__init__.__signature__ = with_keyword(inspect.signature(DropGrow.__init__), "split_sign", False, "bool")


class RigL(DropGrow):
    """Rigged Lottery (Evci et al., 2020): drop the weakest ``|w|``, grow the largest ``|∂L/∂W|``.

    The gradient is that of the update step's batch: when the *next* step is an update step,
    :meth:`step` (and the constructor) arm hooks that record each layer's input ``X`` and output
    gradient ``dY`` during that step's forward and backward; the following ``dst.step()`` (after
    ``optimizer.step()``) scores inactive positions with ``|dYᵀ·X|`` in row blocks with a running
    top-k (:func:`snack.dst.prune_grow.gradient_grow`) and disarms. The score uses the weights
    of that forward, before the optimizer step, like the dense gradient RigL reads.

    Arguments as :class:`SET` (without ``split_sign``). An update step whose training step ran
    no forward/backward through a layer raises ``RuntimeError``. A frozen layer
    (``values.requires_grad`` False) records nothing and is left alone while it is frozen; a
    layer whose recorded ``X`` or ``dY`` holds inf or NaN (an overflowed mixed-precision step) is
    left alone at that update, with a ``RuntimeWarning``. On several ranks the records of every
    rank are gathered first, so growth follows the gradient of the global batch, as DDP's
    averaged gradient does (each rank then holds all ranks' records during the update).
    """

    needs_gradient = True

    def grow(self, layer, k):
        return gradient_growth(self, layer, k)


class GradualPruning(DynamicSparsity):
    """Gradual magnitude pruning (Zhu & Gupta, 2017): nnz shrinks on a cubic schedule.

    Every ``update_every`` steps from ``start_step``, and at ``end_step`` itself (so that the
    final sparsity is reached when ``end_step - start_step`` is not a multiple of
    ``update_every``), each layer keeps its largest-``|w|`` connections so that its density is
    ``d_l · (1 - s_t) / (1 - s_0)``, with ``d_l`` and ``s_0`` the layer's density and the layers'
    overall sparsity at construction: all layers shrink by the same ratio, so the layer-wise
    distribution chosen by ``sparsify`` (e.g. ERK) is kept, and the overall sparsity is ``s_t``.
    ``s_t`` follows :func:`snack.dst.schedules.cubic_sparsity` from ``initial_sparsity``
    (default: ``s_0``) to ``final_sparsity``; while ``s_t < s_0`` nothing is pruned. Nothing
    grows; the optimizer state of survivors is kept. A frozen layer (``values.requires_grad``
    False) is not pruned while it is frozen, so the overall sparsity then stays below ``s_t``.
    Start from ``sparsify(model, 0.0)`` for dense-to-sparse training, or e.g. 0.5 → 0.9.

    To resume, build it with the same arguments, then :meth:`load_state_dict`: ``d_l``, ``s_0`` and
    the default ``initial_sparsity`` come from the saved state, so the model may be loaded from the
    checkpoint before or after construction.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        final_sparsity: float,
        start_step: int,
        end_step: int,
        update_every: int = 100,
        initial_sparsity: float | None = None,
        layers: Iterable[str | SparseLinear] | None = None,
        seed: int = 0,
        process_group=None,
    ):
        layers = listed(layers)
        self._agree_across_ranks(model, optimizer, constructor_arguments(locals()))
        final_sparsity = check_sparsity(final_sparsity, "final_sparsity")
        start_step = check_int(start_step, "start_step", 0)
        end_step = check_int(end_step, "end_step", start_step + 1)
        update_every = check_int(update_every, "update_every", 1)
        found = find_layers(model, layers)
        if initial_sparsity is not None:
            initial_sparsity = check_sparsity(initial_sparsity, "initial_sparsity")
            effective = initial_sparsity
        else:
            total = sum(layer.out_features * layer.in_features for _, layer in found)
            effective = 1.0 - sum(layer.nnz for _, layer in found) / total
            # A model this object pruned to final_sparsity, loaded before construction to resume, may
            # be sparser by the rounding of each layer's count (half a connection each): not an error.
            if final_sparsity < effective <= final_sparsity + (len(found) / 2 + 1e-6) / total:
                effective = final_sparsity
        if final_sparsity < effective:
            raise ValueError(f"final_sparsity ({final_sparsity}) must be >= initial_sparsity ({effective})")
        # the argument as given (None: derived) is configuration; the value in use is state
        self._initial_sparsity_argument = initial_sparsity
        self.initial_sparsity, self.final_sparsity = effective, final_sparsity
        self.start_step, self.end_step, self.update_every = start_step, end_step, update_every
        super().__init__(model, optimizer, layers=layers, seed=seed, process_group=process_group)
        # densities at the start, which the schedule scales down
        self.initial_nnz = [layer.nnz for _, layer in self.layers]

    def sparsity(self, step: int) -> float:
        """Target overall sparsity of the acted-on layers at ``step``."""
        return cubic_sparsity(step, self.initial_sparsity, self.final_sparsity, self.start_step, self.end_step)

    def state_dict(self) -> dict:
        state = super().state_dict()
        return {**state, "initial_nnz": list(self.initial_nnz), "initial_sparsity": self.initial_sparsity}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output, including the layers' counts and overall sparsity at the
        start of the saved run (which a model loaded before construction no longer has)."""
        check_state_is_dict(state)  # (read before the base class checks the rest)
        initial_nnz = saved_counts(state, "initial_nnz", self.layers)
        config = state.get("config")
        if "initial_sparsity" not in state and isinstance(config, dict) and "initial_sparsity" in config:
            # saved before the initial sparsity was state: its config held the value in use
            effective = config["initial_sparsity"]
            if self._initial_sparsity_argument is None:
                state = {**state, "config": {**config, "initial_sparsity": None}}
        else:
            effective = state.get("initial_sparsity")
        if isinstance(effective, bool) or not isinstance(effective, (int, float)) or not (
            0.0 <= effective <= self.final_sparsity
        ):
            raise ValueError(
                f"cannot load DST state: initial_sparsity must be a number in [0, final_sparsity = "
                f"{self.final_sparsity}], got {effective!r}"
            )
        super().load_state_dict(state)
        self.initial_nnz = initial_nnz
        self.initial_sparsity = float(effective)

    def _config(self) -> dict:
        return {
            "initial_sparsity": self._initial_sparsity_argument, "final_sparsity": self.final_sparsity,
            "start_step": self.start_step, "end_step": self.end_step, "update_every": self.update_every,
        }

    def _is_update_step(self, step: int) -> bool:
        if not self.start_step <= step <= self.end_step:
            return False
        # end_step too, or a schedule whose last multiple of update_every falls short would stop early
        return (step - self.start_step) % self.update_every == 0 or step == self.end_step

    def _plan(self, step, index, name, layer):
        return magnitude_drop(layer.values, self._pruned_count(step, index, layer)), NO_POSITIONS, None

    def _pruned_count(self, step: int, index: int, layer: SparseLinear) -> int:
        """How many connections of layer ``index`` the update at ``step`` prunes: down to its
        starting count scaled by the schedule, at least one connection."""
        # Scaled from the density the layers had at the start (not 1 - initial_sparsity, which the
        # caller may set apart from it), so the overall sparsity is s_t (once s_t passes it).
        total = sum(m.out_features * m.in_features for _, m in self.layers)
        if sum(self.initial_nnz) == 0:  # nothing was connected: nothing to prune
            return 0
        ratio = (1.0 - self.sparsity(step)) / (sum(self.initial_nnz) / total)
        target = max(1, round(self.initial_nnz[index] * ratio))
        return max(0, layer.nnz - target)
