"""The machinery every DST algorithm shares: :class:`DynamicSparsity` (step counter, seeded RNG,
gradient records, the all-or-nothing update of every layer, ``state_dict``, agreement across
ranks). The algorithms themselves are in :mod:`snack.dst.algorithms`."""

from __future__ import annotations

import contextlib
import sys
import warnings

import torch
from torch import Tensor, nn

from snack.dst import distributed
from snack.dst.capture import GradientCapture
from snack.dst.checks import check_int
from snack.dst.layers import find_layers, listed
from snack.dst.optim_state import check_optimizer, check_state
from snack.dst.sharded import WholeLayers, check_sharded_layers
from snack.dst.update import plan_rewire
from snack.nn import SparseLinear

__all__ = ["DynamicSparsity"]

NO_POSITIONS = torch.empty(0, dtype=torch.int64)  # an empty drop or grow: the layer is left alone
ON_RANK_ZERO = object()  # RigL on several ranks: the records are gathered on rank 0, which decides
_SEED_MAX = 2**64 - 1  # the largest seed torch.Generator.manual_seed takes


def _check_seed(value) -> int:
    value = check_int(value, "seed", 0)
    if value > _SEED_MAX:
        raise ValueError(f"seed must be in [0, 2**64 - 1] (what torch.Generator.manual_seed takes), got {value}")
    return value


def check_state_is_dict(state) -> None:
    """Raise ``TypeError`` unless ``state`` is a dict, as :meth:`DynamicSparsity.state_dict` returns."""
    if not isinstance(state, dict):
        raise TypeError(f"cannot load DST state: expected the dict state_dict() returns, got {type(state).__name__}")


def constructor_arguments(local_variables: dict) -> dict:
    """A constructor's arguments from its ``locals()`` (``**kwargs`` spread, ``process_group``
    always present), for :meth:`DynamicSparsity._agree_across_ranks`."""
    skipped = ("self", "model", "optimizer", "kwargs", "__class__")
    arguments = {k: v for k, v in local_variables.items() if k not in skipped}
    arguments.update(local_variables.get("kwargs", {}))
    arguments.setdefault("process_group", None)
    return arguments


def outside_snack_dst() -> int:
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
    connections an update replaces). (To write a new drop-and-grow algorithm, subclass
    :class:`~snack.dst.algorithms.DropGrow`, whose hooks are public.) With ``needs_gradient =
    True`` the layers' inputs and output gradients are recorded during each update step's
    training step (:meth:`recorded_batch`).

    A frozen layer (``values.requires_grad`` False) stays among the layers acted on, but every
    update made while it is frozen leaves it alone (nothing dropped, grown or pruned; nothing
    recorded for it), so it can be unfrozen later.

    On several ranks (``torch.distributed`` initialized, e.g. under DDP) every rank must build it
    with the same arguments on the same model (checked first thing), call :meth:`step` on the
    same steps and load the same state; every rank then applies rank 0's update
    (:mod:`snack.dst.distributed`). ``process_group`` picks the ranks that share the topology
    (default: all; ``False``: this rank alone).

    Under FSDP (``fully_shard``: ``values`` are DTensor shards) an update gathers each sharded
    layer's whole ``values`` and optimizer state, rewires them, and each rank writes its shard of
    the result back in place (:mod:`snack.dst.sharded`); an algorithm whose updates change nnz
    (``keeps_nnz = False``, the default) refuses sharded layers at construction.
    """

    needs_gradient = False
    # whether every update keeps each layer's nnz: only such algorithms act on FSDP-sharded layers
    keeps_nnz = False
    _batches: tuple = ()  # with needs_gradient, during an update: per layer, what _recorded returned

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, layers, seed: int, process_group=None):
        layers = listed(layers)
        self._agree_across_ranks(model, optimizer, dict(layers=layers, seed=seed, process_group=process_group))
        self.layers = find_layers(model, layers)
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
        check_state_is_dict(state)
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
        :func:`snack.dst.prune_grow.gradient_grow`) rather than form it. A convolution's ``X`` are
        its im2col rows ``(N · H_out · W_out, in_channels · kh · kw)``, formed by this call (RigL
        scores the padded input it kept instead: see :meth:`recorded_as_kept`); a grouped one's
        hold every group's columns, so ``gradient_grow`` needs ``convolution=`` the layer. A
        :class:`snack.SparseEmbedding`'s ``X`` are its ids ``(N,)`` (int64) and ``dY`` its output
        gradient rows ``(N, embedding_dim)``: row ``t`` of ``∂L/∂W`` sums the ``dY`` rows of id ``t``
        (``gradient_grow`` scores them so); its uses as a tied output layer are apart
        (:meth:`recorded_head_batch`)."""
        x, dy = self.recorded_as_kept(layer)
        return layer._rows_of_record(x), dy

    def recorded_as_kept(self, layer: SparseLinear) -> tuple[Tensor, Tensor]:
        """:meth:`recorded_batch` as the records hold it: ``X`` is a convolution's padded input
        ``(N, C, Hp, Wp)`` (:func:`snack.dst.prune_grow.gradient_grow` takes it with
        ``convolution=``), or its rows where the calls' inputs differed in size or several ranks
        gathered them; other layers' ``X`` are their rows."""
        x, dy = self._records_of(layer)[:2]
        return x, dy

    def recorded_head_batch(self, layer: SparseLinear) -> tuple[Tensor, Tensor] | None:
        """``(hidden (M, embedding_dim), dlogits (M, num_embeddings))``: for a
        :class:`snack.SparseEmbedding` whose table also served as an output layer in this update
        step's training step (:meth:`~snack.SparseEmbedding.attend`, :class:`snack.SparseTiedHead`),
        that use's inputs and logits' gradients, as :meth:`recorded_batch` gives the lookups' ids
        and output gradients (which are then of no rows if the table served only as the head).
        The table's gradient is the sum of both uses': ``gradient_grow(ids, dy, ..., head=(hidden,
        dlogits))`` scores it so. ``None`` for any other layer, or one not used so."""
        records = self._records_of(layer)
        if len(records) == 2 or records[2].shape[0] == 0:
            return None
        return records[2], records[3]

    def _records_of(self, layer: SparseLinear) -> tuple[Tensor, ...]:
        """What :meth:`_recorded` returned for ``layer`` at this update (raises where there is none)."""
        for index, (_, candidate) in enumerate(self.layers):
            if candidate is layer:
                break
        else:
            raise ValueError(f"{layer!r} is not one of the layers this {type(self).__name__} acts on")
        recorded = self._batches[index] if index < len(self._batches) else None
        if recorded is None or recorded is ON_RANK_ZERO:
            raise RuntimeError(
                "no batch is recorded for this layer now; it is available while an update of an "
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
        check_sharded_layers(model, type(self).__name__, self.keeps_nnz, self._group)
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
        # FSDP-sharded layers are rewired whole, then each rank keeps its shard (snack.dst.sharded)
        with WholeLayers(self.layers, self.optimizer) as sharded:
            try:
                rewirings = self._rewirings(step, sharded)
            except BaseException:
                self.generator.set_state(rng_state)
                raise
            finally:
                self._batches = ()
            for rewiring in rewirings:
                rewiring.apply()
            sharded.write_back()
        if self._capture is not None:
            self._capture.clear()
        return bool(rewirings)

    def _rewirings(self, step: int, sharded: WholeLayers) -> list:
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
        sharded.gather()  # (FSDP) collectives too: after the ranks agreed on the update
        self._before_planning(step)

        def plan() -> list:
            return [
                (NO_POSITIONS, NO_POSITIONS, None) if frozen[i] else self._plan(step, i, name, layer)
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

    def _check_recorded(self, step: int, name: str, recorded) -> None:
        """Raise ``RuntimeError`` saying why when nothing was recorded (``recorded is None``) for
        layer ``name`` in the training step of the update at ``step``."""
        if recorded is not None:
            return
        raise RuntimeError(
            f"{type(self).__name__} update at step {step}: no gradient was recorded for layer {name!r}. Run the "
            "step's forward and backward through this layer between dst.step() calls; it records nothing if "
            "the layer was not used in them, ran only under no_grad or inference mode, was frozen "
            "(values.requires_grad False) during its forward, ran inside torch.func.vmap (per-sample gradients: "
            "its batched tensors cannot be recorded), or ran in a compiled model that does not run the "
            f"recording hooks {type(self).__name__} adds before each update step: compile without fullgraph=True, "
            "and set torch._dynamo.config.skip_nnmodule_hook_guards = False so that Dynamo notices them"
        )

    def _records_are_finite(
        self, step: int, name: str, recorded: tuple[Tensor, ...], consequence: str, *, what: str = "the batch recorded"
    ) -> bool:
        """Whether every recorded tensor is finite; if not, warn (``RuntimeWarning``) naming
        ``what`` was recorded, the layer, the step and the ``consequence``."""
        if all(bool(torch.isfinite(t).all()) for t in recorded):
            return True
        # e.g. a mixed-precision step whose gradients overflowed (GradScaler skips its optimizer
        # step): scores from inf/NaN would pick arbitrary positions. Decided where the records
        # are (rank 0 on several ranks, whose choice every rank applies).
        warnings.warn(
            f"{type(self).__name__} update at step {step}: {what} for layer {name!r} has non-finite "
            f"values (inf or NaN, e.g. an overflowed mixed-precision step); {consequence}",
            RuntimeWarning,
        )
        return False

    def _count(self, step: int, layer: SparseLinear) -> int:
        """Connections the update at ``step`` replaces in ``layer`` (0: the layer is left alone)."""
        raise NotImplementedError

    def _recorded(self, step: int, index: int, layer: SparseLinear):
        """``(X (N, in), dY (N, out))`` recorded for layer ``index`` in this step (an embedding's
        ``(ids, dY, hidden, dlogits)``, :meth:`GradientCapture.batch`), on several ranks every
        rank's rows, on rank 0 (elsewhere ``ON_RANK_ZERO``); ``None`` if no rank has any."""
        recorded = self._capture.batch(index)
        values = layer.values
        if self._group is None or self._count(step, layer) == 0:
            return recorded if recorded is None else tuple(_in_dtype(t, values.dtype) for t in recorded)
        if recorded is None:
            recorded = layer._empty_records(values)
        else:  # rows: ranks' inputs may differ in size
            recorded = (layer._rows_of_record(recorded[0]), *recorded[1:])
        gathered = [distributed.gather_rows(_in_dtype(t, values.dtype), self._group) for t in recorded]
        if sum(rows for _, rows in gathered[::2]) == 0:  # (each X, with its dY)
            return None
        return tuple(t for t, _ in gathered) if distributed.is_rank_zero(self._group) else ON_RANK_ZERO


def _in_dtype(record: Tensor, dtype: torch.dtype) -> Tensor:
    """A recorded tensor in the layer's ``dtype``, an embedding's ids (integers) as they are."""
    return record.to(dtype) if record.is_floating_point() else record
