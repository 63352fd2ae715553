"""SET, RigL and gradual magnitude pruning: drop/grow scores plus a schedule.

All three share :class:`DynamicSparsity` (layer discovery, argument checks, step counter,
seeded RNG, gradient records, ``state_dict``) and :func:`snack.dst.update.plan_rewire` (the
update itself). SET and RigL are :class:`DropGrow` subclasses, the public base for new
drop-and-grow algorithms. They differ only in how many connections each update replaces and in
their drop and grow scores:

=============== ============================== ========================================
algorithm       drop                           grow
=============== ============================== ========================================
SET             lowest ``|w|`` (or sign split) uniformly random inactive positions
RigL            lowest ``|w|``                 largest ``|∂L/∂W|`` at inactive positions
GradualPruning  lowest ``|w|``, nnz shrinks    nothing
=============== ============================== ========================================

Growth is among positions inactive *before* the drop, so a connection dropped in an update is
never regrown in the same update (RigL's and SET's reference code may regrow one; the README's
*Departures from the reference code* lists this and the other differences).
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import numbers
import sys
import warnings
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from snack.dst import distributed
from snack.dst.capture import GradientCapture
from snack.dst.checks import check_int
from snack.dst.optim_state import check_optimizer, check_state
from snack.dst.prune_grow import gradient_grow, magnitude_drop, random_grow
from snack.dst.schedules import DropSchedule, cubic_sparsity
from snack.dst.update import plan_rewire
from snack.nn import SparseLinear
from snack.topology import check_sparsity

__all__ = ["RigL", "SET", "DropGrow", "DynamicSparsity", "GradualPruning"]

GROW_INITS = ("zero", "random")
_EMPTY = torch.empty(0, dtype=torch.int64)
_ON_RANK_ZERO = object()  # RigL on several ranks: the records are gathered on rank 0, which decides
_SEED_MAX = 2**64 - 1  # the largest seed torch.Generator.manual_seed takes


def _check_seed(value) -> int:
    value = check_int(value, "seed", 0)
    if value > _SEED_MAX:
        raise ValueError(f"seed must be in [0, 2**64 - 1] (what torch.Generator.manual_seed takes), got {value}")
    return value


def _listed(layers):
    """``layers`` as given, but a one-shot iterable (a generator, ``filter(...)``) as a list: a
    constructor reads it more than once (the agreement across ranks, then the layers it names).
    Never raises, so that every rank reaches the agreement first; :func:`_find_layers` checks."""
    reusable = (str, nn.Module, list, tuple, set, frozenset)
    if layers is None or isinstance(layers, reusable) or not isinstance(layers, Iterable):
        return layers
    return list(layers)


def _arguments(local_variables: dict) -> dict:
    """A constructor's arguments from its ``locals()`` (``**kwargs`` spread, ``process_group``
    always present), for :meth:`DynamicSparsity._agree_across_ranks`."""
    skipped = ("self", "model", "optimizer", "kwargs", "__class__")
    arguments = {k: v for k, v in local_variables.items() if k not in skipped}
    arguments.update(local_variables.get("kwargs", {}))
    arguments.setdefault("process_group", None)
    return arguments


def _find_layers(model: nn.Module, layers) -> list[tuple[str, SparseLinear]]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    named = {name: m for name, m in model.named_modules() if isinstance(m, SparseLinear)}
    if layers is None:
        found = list(named.items())
    else:
        if isinstance(layers, (str, nn.Module)):
            layers = [layers]
        if not isinstance(layers, Iterable):
            raise TypeError(
                "layers must be None (every SparseLinear), a layer's name (or glob pattern) or module, or an "
                f"iterable of them, got {type(layers).__name__} {layers!r}"
            )
        unordered = isinstance(layers, (set, frozenset))  # its order differs between processes
        layers = list(layers)
        if not layers:
            raise ValueError("layers is empty: name at least one SparseLinear (or pass None for all of them)")
        by_id = {id(m): name for name, m in named.items()}
        found = []
        for item in layers:
            if isinstance(item, str) and item not in named and any(c in item for c in "*?["):
                # a glob pattern, as sparsify's include/exclude take: its matches in model order;
                # layers another item listed already are not listed twice
                matches = [name for name in named if fnmatch.fnmatchcase(name, item)]
                if not matches:
                    raise ValueError(
                        f"layers: pattern {item!r} matches no SparseLinear of the model (have {sorted(named)})"
                    )
                found.extend((name, named[name]) for name in matches if all(name != seen for seen, _ in found))
            elif isinstance(item, str):
                if item not in named:
                    raise ValueError(f"layers: {item!r} is not a SparseLinear of the model (have {sorted(named)})")
                found.append((item, named[item]))
            elif isinstance(item, SparseLinear) and id(item) in by_id:
                found.append((by_id[id(item)], item))
            else:
                raise ValueError(f"layers: {item!r} is not a SparseLinear of the model")
        if len({name for name, _ in found}) != len(found):
            raise ValueError("layers: a layer is listed twice")
        if unordered:  # the model's order, the same in every process (state_dict, several ranks)
            order = {name: i for i, name in enumerate(named)}
            found.sort(key=lambda pair: order[pair[0]])
    if not found:
        raise ValueError("the model has no SparseLinear layers to act on: call snack.sparsify(model, ...) first")
    _refuse_shared_values(named, found)
    return found


def _refuse_shared_values(named: dict[str, SparseLinear], found: list[tuple[str, SparseLinear]]) -> None:
    """Raise if a layer to rewire shares its ``values`` Parameter with another layer: a rewire
    changes one layer's connections, and the other would read the new values at its own, old
    positions (silently wrong)."""
    owners: dict[int, tuple[str, SparseLinear]] = {}
    for name, layer in named.items():
        owners.setdefault(id(layer.values), (name, layer))
    for name, layer in named.items():
        first_name, first = owners[id(layer.values)]
        if first is not layer and any(m is layer or m is first for _, m in found):
            raise ValueError(
                f"layers {first_name!r} and {name!r} share one values Parameter: dynamic sparsity would rewire one "
                "and leave the other reading the new values at its old connections. Untie them, or leave both out "
                "of layers."
            )


def _outside_snack_dst() -> int:
    """``warnings.warn``'s ``stacklevel`` for the caller's first frame outside ``snack.dst``: the
    user's line, through however many constructors of subclasses."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("snack.dst"):
        frame, level = frame.f_back, level + 1
    return level


class DynamicSparsity:
    """Base of the DST algorithms: call :meth:`step` once after every ``optimizer.step()``.

    Subclasses implement ``_is_update_step(t)``, ``_plan(t, index, name, layer)`` → ``(drop,
    grow, grow_values)`` for one layer, without side effects except drawing from
    ``self.generator``, and ``_config()``, the arguments :meth:`state_dict` saves and
    :meth:`load_state_dict` compares (and with ``needs_gradient``, ``_count(t, layer)``, how many
    connections an update replaces). (To write a new drop-and-grow algorithm, subclass :class:`DropGrow`,
    whose hooks are public.) With ``needs_gradient = True`` the layers' inputs and output
    gradients are recorded during each update step's training step (:meth:`recorded_batch`).

    A frozen layer (``values.requires_grad`` False) stays among the layers acted on, but every
    update made while it is frozen leaves it alone (nothing dropped, grown or pruned; nothing
    recorded for it), so it can be unfrozen later.

    On several ranks (``torch.distributed`` initialized, e.g. under DDP) every rank must build it
    with the same arguments on the same model (checked first thing), call :meth:`step` on the
    same steps and load the same state; every rank then applies rank 0's update
    (:mod:`snack.dst.distributed`). ``process_group`` picks the ranks that share the topology
    (default: all; ``False``: this rank alone).
    """

    needs_gradient = False
    _batches: tuple = ()  # with needs_gradient, during an update: per layer, what _recorded returned

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, layers, seed: int, process_group=None):
        layers = _listed(layers)
        self._agree_across_ranks(model, optimizer, dict(layers=layers, seed=seed, process_group=process_group))
        self.layers = _find_layers(model, layers)
        hint = ", or pass layers=... to act on fewer layers"
        check_optimizer(optimizer, {name: layer.values for name, layer in self.layers}, hint=hint)
        self.optimizer = optimizer
        self.seed = _check_seed(seed)
        self.generator = torch.Generator().manual_seed(self.seed)
        self.step_count = 0
        self._capture = GradientCapture([layer for _, layer in self.layers]) if self.needs_gradient else None

    # -------------------------------------------------------------- public

    def step(self) -> bool:
        """Advance one training step; update the topology if this is an update step.

        Returns ``True`` when some layer's topology changed. On error nothing changes (layers,
        optimizer, step counter, RNG). The update runs with inference mode off, so a call made
        under ``torch.inference_mode()`` still leaves trainable layers and optimizer state.
        """
        step = self.step_count + 1
        changed = False
        if self._is_update_step(step):
            # Tensors made under inference mode (new values, optimizer state) could not be trained
            # afterwards. inference_mode(False) also turns grad mode on: keep the caller's instead.
            # Autocast (a step body inside torch.autocast) would score RigL's growth in 16 bits.
            grad_enabled = torch.is_grad_enabled()
            with torch.inference_mode(False), torch.set_grad_enabled(grad_enabled), self._autocast_off():
                changed = self._update(step)
        self.step_count = step
        self._arm()
        return changed

    def _autocast_off(self) -> contextlib.ExitStack:
        """A context without autocast on the devices of the layers acted on."""
        stack = contextlib.ExitStack()
        for device_type in sorted({layer.values.device.type for _, layer in self.layers}):
            if torch.amp.is_autocast_available(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        return stack

    def state_dict(self) -> dict:
        """Step counter, RNG state and configuration: with the model's and optimizer's state
        dicts, enough to resume bitwise."""
        return {
            "algorithm": type(self).__name__,
            "layers": [name for name, _ in self.layers],
            "config": self._config(),
            "step": self.step_count,
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output of the same algorithm with the same configuration."""
        if not isinstance(state, dict):
            raise TypeError(f"cannot load DST state: expected the dict state_dict() returns, got {type(state).__name__}")
        layers = [name for name, _ in self.layers]
        expected = {"algorithm": type(self).__name__, "layers": layers, "config": self._config()}
        for key, value in expected.items():
            saved = state.get(key)
            if saved == value:
                continue
            if key == "config" and isinstance(saved, dict):  # name what differs, not two whole dicts
                differing = sorted(set(saved) | set(value), key=str)
                detail = ", ".join(
                    f"{name}: saved {saved.get(name)!r}, this object {value.get(name)!r}"
                    for name in differing if saved.get(name) != value.get(name)
                )
                raise ValueError(f"cannot load DST state: its configuration differs ({detail})")
            raise ValueError(f"cannot load DST state: {key} is {saved!r}, this object has {value!r}")
        for key in ("step", "generator"):
            if key not in state:
                raise ValueError(f"cannot load DST state: it has no {key!r} entry (keys: {sorted(state)})")
        step = check_int(state["step"], "step", 0)
        self.generator.set_state(state["generator"])
        self.step_count = step
        self._arm()

    def remove(self) -> None:
        """Remove the gradient-capture hooks (the object must not be stepped afterwards)."""
        if self._capture is not None:
            self._capture.disarm()

    def recorded_batch(self, layer: SparseLinear) -> tuple[Tensor, Tensor]:
        """``(X (N, in), dY (N, out))``: ``layer``'s inputs and output gradients recorded during
        this update step's training step (every forward and backward of it), in the layer's
        dtype; on several ranks, every rank's rows. For use while planning an update of an
        algorithm with ``needs_gradient = True``. ``∂L/∂W = dYᵀ·X``: score it in blocks (see
        :func:`snack.dst.prune_grow.gradient_grow`) rather than form it."""
        for index, (_, candidate) in enumerate(self.layers):
            if candidate is layer:
                break
        else:
            raise ValueError(f"recorded_batch: {layer!r} is not one of the layers this {type(self).__name__} acts on")
        recorded = self._batches[index] if index < len(self._batches) else None
        if recorded is None or recorded is _ON_RANK_ZERO:
            raise RuntimeError(
                "recorded_batch: no batch is recorded for this layer now; it is available while an update of an "
                "algorithm with needs_gradient = True (a class attribute, read when the object is built) is planned"
            )
        return recorded

    # -------------------------------------------------------------- machinery

    def _config(self) -> dict:
        raise NotImplementedError

    def _agree_across_ranks(self, model, optimizer, arguments: dict) -> None:
        """Resolve the process group and, on several ranks, check that every rank was given the
        same ``arguments``, model topology and optimizer layout: the first thing each constructor
        does (the outermost one acts), so that its checks then fail on every rank or on none."""
        if hasattr(self, "_group"):
            return
        arguments = dict(arguments)
        self._group = distributed.resolve_group(arguments.pop("process_group"))
        if self._group is not None:
            distributed.check_same_on_every_rank({
                "algorithm": type(self).__name__,
                "arguments": {key: distributed.comparable(value, model) for key, value in arguments.items()},
                "model": distributed.model_summary(model),
                "optimizer": distributed.optimizer_summary(optimizer),
            }, self._group)  # fmt: skip

    def _fingerprints(self) -> list[int]:
        return [distributed.topology_fingerprint(m.row, m.col, m.in_features) for _, m in self.layers]

    def _is_update_step(self, step: int) -> bool:
        raise NotImplementedError

    def _plan(self, step: int, index: int, name: str, layer: SparseLinear) -> tuple[Tensor, Tensor, Tensor | None]:
        raise NotImplementedError

    def _arm(self) -> None:
        """Record X and dY during the next step only if it is an update step (RigL)."""
        if self._capture is None:
            return
        if self._is_update_step(self.step_count + 1):
            self._capture.clear()
            self._capture.arm()
        else:
            self._capture.disarm()

    def _update(self, step: int) -> bool:
        """Plan and compute every layer's rewiring, then apply them all: an error while planning
        (a bad plan, out of memory) leaves every layer, the optimizer and the RNG as they were,
        on every rank (the ranks agree after each phase, see :func:`distributed.agreed`)."""
        rng_state = self.generator.get_state()
        try:
            rewirings = self._rewirings(step)
        except BaseException:
            self.generator.set_state(rng_state)
            raise
        finally:
            self._batches = ()
        for rewiring in rewirings:
            rewiring.apply()
        if self._capture is not None:
            self._capture.clear()
        return bool(rewirings)

    def _rewirings(self, step: int) -> list:
        group = self._group

        def check_states() -> None:
            for name, layer in self.layers:
                check_state(self.optimizer, layer.values, name)

        # on several ranks: the same step, topologies and frozen layers everywhere, before any other
        # collective (whether a layer's records are gathered depends on it)
        frozen = self._frozen()
        check = (step, *self._fingerprints(), frozen) if group is not None else None
        starting = "starting the update (step, a fingerprint of each layer's topology, frozen layers, optimizer state)"
        distributed.agreed(group, starting, check_states, check)
        self._before_planning(step)

        def plan() -> list:
            return [
                (_EMPTY, _EMPTY, None) if frozen[i] else self._plan(step, i, name, layer)
                for i, (name, layer) in enumerate(self.layers)
            ]

        choices = distributed.agreed(group, "choosing connections", plan)
        if group is not None:
            device = self.layers[0][1].values.device
            choices = distributed.broadcast_choices(choices, device, group)
            distributed.broadcast_generator(self.generator, device, group)

        def rewire_all() -> list:
            return [
                plan_rewire(layer, self.optimizer, drop, grow, grow_values=grow_values, name=name)
                for (name, layer), (drop, grow, grow_values) in zip(self.layers, choices)
                if drop.numel() or grow.numel()
            ]

        return distributed.agreed(group, "computing the new topologies", rewire_all)

    def _frozen(self) -> tuple[bool, ...]:
        """Per layer, whether it is frozen (``values.requires_grad`` False): left alone by this update."""
        return tuple(not layer.values.requires_grad for _, layer in self.layers)

    def _before_planning(self, step: int) -> None:
        """Collective work every rank does before planning: with ``needs_gradient``, gather the
        records (on several ranks, every rank's on rank 0) of the layers not frozen."""
        if self._capture is not None:
            self._batches = [
                None if frozen else self._recorded(step, i, layer)
                for i, ((_, layer), frozen) in enumerate(zip(self.layers, self._frozen()))
            ]

    def _count(self, step: int, layer: SparseLinear) -> int:
        """Connections the update at ``step`` replaces in ``layer`` (0: the layer is left alone)."""
        raise NotImplementedError

    def _recorded(self, step: int, index: int, layer: SparseLinear):
        """``(X (N, in), dY (N, out))`` recorded for layer ``index`` in this step, on several ranks
        every rank's rows, on rank 0 (elsewhere ``_ON_RANK_ZERO``); ``None`` if no rank has any."""
        recorded = self._capture.batch(index)
        values = layer.values
        if self._group is None or self._count(step, layer) == 0:
            return recorded if recorded is None else tuple(t.to(values.dtype) for t in recorded)
        x, dy = recorded if recorded is not None else (values.new_empty(0, layer.in_features),
                                                        values.new_empty(0, layer.out_features))
        x, rows = distributed.gather_rows(x.to(values.dtype), self._group)
        dy, _ = distributed.gather_rows(dy.to(values.dtype), self._group)
        if rows == 0:
            return None
        return (x, dy) if distributed.is_rank_zero(self._group) else _ON_RANK_ZERO


class DropGrow(DynamicSparsity):
    """Base of drop-and-grow algorithms (SET, RigL, and your own): every update replaces a
    scheduled fraction of each layer's connections, ``k = floor(fraction · nnz)``, keeping nnz.

    To write a new algorithm, subclass it and override :meth:`grow` (and :meth:`drop`, which by
    default drops the smallest ``|w|``). Both see one layer and ``k``, may draw from
    ``self.generator`` (seeded, saved in :meth:`state_dict`) and must not change anything. Set
    ``needs_gradient = True`` to read the step's inputs and output gradients with
    :meth:`recorded_batch`. Everything else is this class's: the schedule, the optimizer-state
    remap, checking what the hooks return (``k`` unique positions each; grown ones inactive, or
    dropped by this update: a regrown connection restarts at its grow value with fresh optimizer
    state), all layers planned before any changes, and on several ranks one choice (rank 0's) for
    all. Frozen layers are left alone (see :class:`DynamicSparsity`); with ``needs_gradient``, so
    is a layer whose recorded batch has a non-finite value (inf or NaN: an overflowed
    mixed-precision step), with a ``RuntimeWarning`` naming it and the step::

        class RandomDropGradientGrow(snack.dst.DropGrow):
            needs_gradient = True

            def drop(self, layer, k):
                return torch.randperm(layer.nnz, generator=self.generator)[:k]

            def grow(self, layer, k):
                x, dy = self.recorded_batch(layer)
                return snack.dst.gradient_grow(x, dy, layer.topology, k)

    A subclass's own constructor arguments are not compared across ranks, nor saved in
    :meth:`state_dict`.

    Args: as :class:`SET` (without ``split_sign``).
    """

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
        if type(self).grow is DropGrow.grow:  # a class property: every rank raises alike
            raise TypeError(f"{type(self).__name__} must implement grow(layer, k): DropGrow has no default growth")
        layers = _listed(layers)
        self._agree_across_ranks(model, optimizer, _arguments(locals()))
        self.schedule = DropSchedule(drop_fraction, update_every, total_steps, stop_fraction, schedule)  # checks them
        if grow_init not in GROW_INITS:
            raise ValueError(f"grow_init must be one of {GROW_INITS}, got {grow_init!r}")
        why = self.schedule.why_static()
        if why is not None:  # a DST run that would silently train a static topology
            warnings.warn(
                f"{type(self).__name__} will never change the topology: {why} "
                f"(update_every={self.schedule.update_every}, stop_fraction={self.schedule.stop_fraction}; "
                "total_steps counts optimizer steps, not epochs)",
                UserWarning,
                stacklevel=_outside_snack_dst(),
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
        inactive = layer.out_features * layer.in_features - layer.nnz
        # (rounded to 9 places first: 0.29 · 100 is 28.999999999999996 in binary floating point)
        return min(math.floor(round(self.schedule.fraction(step) * layer.nnz, 9)), inactive)

    def drop(self, layer: SparseLinear, k: int) -> Tensor:
        """``(k,)`` unique positions into ``layer.values`` of the connections to remove; by
        default the ``k`` smallest ``|w|`` (:func:`snack.dst.prune_grow.magnitude_drop`)."""
        return magnitude_drop(layer.values, k)

    def grow(self, layer: SparseLinear, k: int) -> Tensor:
        """``(k,)`` unique linear positions ``r · in_features + c`` to add, each inactive (or
        among those :meth:`drop` returned) in ``layer.topology``, which is the topology before
        this update (see :func:`snack.dst.prune_grow.random_grow`, ``gradient_grow``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement grow(layer, k)")

    def _plan(self, step, index, name, layer):
        k = self._count(step, layer)
        recorded = self._batches[index] if self._capture is not None else ()
        if k == 0 or recorded is _ON_RANK_ZERO:
            return _EMPTY, _EMPTY, None  # on several ranks, rank 0 decides from every rank's records
        if recorded is None:
            raise RuntimeError(
                f"{type(self).__name__} update at step {step}: no gradient was recorded for layer {name!r}. Run the "
                "step's forward and backward through this layer between dst.step() calls; it records nothing if "
                "the layer was not used in them, ran only under no_grad or inference mode, was frozen "
                "(values.requires_grad False) during its forward, ran inside torch.func.vmap (per-sample gradients: "
                "its batched tensors cannot be recorded), or ran in a compiled model that does not run the "
                "recording hooks RigL adds before each update step: compile without fullgraph=True, and set "
                "torch._dynamo.config.skip_nnmodule_hook_guards = False so that Dynamo notices them"
            )
        if recorded and not all(bool(torch.isfinite(t).all()) for t in recorded):
            # e.g. a mixed-precision step whose gradients overflowed (GradScaler skips its optimizer
            # step): scores from inf/NaN would pick arbitrary positions. Decided here, where the
            # records are (rank 0 on several ranks, whose choice every rank applies).
            warnings.warn(
                f"{type(self).__name__} update at step {step}: the batch recorded for layer {name!r} has non-finite "
                "values (inf or NaN, e.g. an overflowed mixed-precision step); this layer is left alone at this update",
                RuntimeWarning,
            )
            return _EMPTY, _EMPTY, None
        drop = self._hook_positions(self.drop(layer, k), "drop", name, k)
        grow = self._hook_positions(self.grow(layer, k), "grow", name, k)
        return drop, grow, self._grow_values(layer, k)

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

    def _grow_values(self, layer: SparseLinear, k: int) -> Tensor | None:
        if self.grow_init == "zero":
            return None
        # the layer's own init: U(-1/√fan_in, 1/√fan_in), fan_in = nnz / out (see SparseLinear)
        bound = 1.0 / math.sqrt(max(1.0, layer.nnz / layer.out_features))
        draw = torch.rand(k, generator=self.generator, dtype=torch.float64) * 2 - 1
        return (draw * bound).to(device=layer.values.device, dtype=layer.values.dtype)


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
            kwargs["layers"] = _listed(kwargs["layers"])
        self._agree_across_ranks(model, optimizer, _arguments(locals()))
        if not isinstance(split_sign, bool):
            raise TypeError(f"split_sign must be a bool, got {split_sign!r}")
        self.split_sign = split_sign
        super().__init__(model, optimizer, **kwargs)

    def _config(self) -> dict:
        return {**super()._config(), "split_sign": self.split_sign}

    def drop(self, layer, k):
        return magnitude_drop(layer.values, k, split_sign=self.split_sign)

    def grow(self, layer, k):
        return random_grow(layer.topology, k, self.generator)


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
        x, dy = self.recorded_batch(layer)
        return gradient_grow(x, dy, layer.topology, k)


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
        layers = _listed(layers)
        self._agree_across_ranks(model, optimizer, _arguments(locals()))
        final_sparsity = check_sparsity(final_sparsity, "final_sparsity")
        start_step = check_int(start_step, "start_step", 0)
        end_step = check_int(end_step, "end_step", start_step + 1)
        update_every = check_int(update_every, "update_every", 1)
        found = _find_layers(model, layers)
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
        if not isinstance(state, dict):
            raise TypeError(f"cannot load DST state: expected the dict state_dict() returns, got {type(state).__name__}")
        initial_nnz = state.get("initial_nnz")
        sizes = [layer.out_features * layer.in_features for _, layer in self.layers]
        if (
            not isinstance(initial_nnz, list) or len(initial_nnz) != len(self.layers)
            or not all(isinstance(n, numbers.Integral) and not isinstance(n, bool) and 0 <= n <= size
                       for n, size in zip(initial_nnz, sizes))
        ):
            raise ValueError(
                f"cannot load DST state: initial_nnz must list {len(self.layers)} counts, each an int from 0 to the "
                f"layer's size {sizes}, got {initial_nnz!r}"
            )
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
        self.initial_nnz = [int(n) for n in initial_nnz]
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
        # Scaled from the density the layers had at the start (not 1 - initial_sparsity, which the
        # caller may set apart from it), so the overall sparsity is s_t (once s_t passes it).
        total = sum(layer.out_features * layer.in_features for _, layer in self.layers)
        if sum(self.initial_nnz) == 0:  # nothing was connected: nothing to prune
            return _EMPTY, _EMPTY, None
        ratio = (1.0 - self.sparsity(step)) / (sum(self.initial_nnz) / total)
        target = max(1, round(self.initial_nnz[index] * ratio))
        drop = magnitude_drop(layer.values, max(0, layer.nnz - target))
        return drop, _EMPTY, None
