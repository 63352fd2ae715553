"""The one generic topology update of a layer: drop some connections, grow others.

Every algorithm (SET, RigL, gradual pruning, GraNet) only decides *which* positions to drop and grow;
:func:`rewire` applies that choice to the layer and its optimizer state, keeping the format's
invariants (indices sorted by ``(row, col)``, unique, in range), and installs it through the
layer's two-phase ``_prepare_topology`` (checks and allocations, changing nothing) and
``_commit_topology`` (reference swaps only, with the new index data), so that an update of
several layers either applies to all of them or to none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from snack.dst.sharded import check_not_sharded
from snack.dst.optim_state import check_optimizer, remapped_state
from snack.indexing import merge_connections, take_or_fill
from snack.nn.layer import SparseLinear, _NewTopology
from snack.topology import MAX_INDEX

__all__ = ["Rewiring", "plan_rewire", "rewire"]


@dataclass
class Rewiring:
    """A checked, fully computed topology change of one layer, not applied yet: the algorithms
    plan every layer's before they apply any, so a failure anywhere changes nothing."""

    layer: SparseLinear
    optimizer: torch.optim.Optimizer
    topology: _NewTopology  # row, col (nnz',) int32 sorted by (row, col), the new values (nnz',)
    state: dict | None  # the optimizer's new state of layer.values (None: it has none)

    def apply(self) -> None:
        """Install it: reference swaps only (everything was allocated while planning), so an
        update of several layers cannot fail half-way, e.g. out of memory."""
        param = self.layer.values
        self.layer._commit_topology(self.topology)
        if self.state is not None:
            self.optimizer.state[param] = self.state


def _positions(tensor, argument: str, name: str, limit: int, device: torch.device) -> tuple[Tensor, bool]:
    """``tensor`` as ``(k,)`` int64 on ``device`` after checking it holds unique ints in ``[0, limit)``,
    and whether they increase (read once: a pass over them)."""
    if not isinstance(tensor, Tensor) or tensor.dim() != 1 or tensor.is_floating_point() or tensor.dtype == torch.bool:
        shown = f"{tuple(tensor.shape)} {tensor.dtype}" if isinstance(tensor, Tensor) else type(tensor).__name__
        raise TypeError(f"{name}: {argument} must be a 1-D integer tensor, got {shown}")
    tensor = tensor.to(device=device, dtype=torch.int64)
    if tensor.numel() and not (0 <= int(tensor.min()) and int(tensor.max()) < limit):
        raise ValueError(
            f"{name}: {argument} positions must be in [0, {limit}), got {int(tensor.min())}..{int(tensor.max())}"
        )
    increasing = _increasing(tensor)
    if not increasing and tensor.unique().numel() != tensor.numel():  # sorted ones need no sort
        raise ValueError(f"{name}: {argument} positions must be unique")
    return tensor, increasing


def _grow_values(grow_values, grow: Tensor, values: Tensor, name: str) -> Tensor:
    """``grow_values`` as ``values``' dtype and device after checking it holds one float per position."""
    if not isinstance(grow_values, Tensor) or grow_values.shape != grow.shape or not grow_values.is_floating_point():
        shown = f"{tuple(grow_values.shape)} {grow_values.dtype}" if isinstance(grow_values, Tensor) else grow_values
        raise ValueError(f"{name}: grow_values must be a floating tensor of shape {tuple(grow.shape)}, got {shown}")
    return grow_values.to(values.device, values.dtype)


def _increasing(positions: Tensor) -> bool:
    return positions.numel() < 2 or bool((positions[1:] > positions[:-1]).all())


def plan_rewire(
    layer: SparseLinear,
    optimizer: torch.optim.Optimizer,
    drop: Tensor,
    grow: Tensor,
    *,
    grow_values: Tensor | None = None,
    name: str = "layer",
) -> Rewiring:
    """What :func:`rewire` does, checked and computed but not applied (no side effects)."""
    # new optimizer state made under inference mode could never be stepped in place
    with torch.inference_mode(False), torch.no_grad():
        return _plan_rewire(layer, optimizer, drop, grow, grow_values, name)


def _plan_rewire(layer, optimizer, drop, grow, grow_values, name) -> Rewiring:
    if not isinstance(layer, SparseLinear):
        raise TypeError(f"{name}: layer must be a snack.SparseLinear, got {type(layer).__name__}")
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__} {name!r}")
    check_not_sharded(name, layer)
    check_optimizer(optimizer, {name: layer.values})
    values = layer.values
    drop, _ = _positions(drop, "drop", name, layer.nnz, values.device)
    grow, grow_increasing = _positions(grow, "grow", name, layer.out_features * layer.in_features, values.device)
    if grow_values is not None:
        grow_values = _grow_values(grow_values, grow, values, name)
    if not grow_increasing:  # the algorithms' come sorted
        order = torch.argsort(grow)
        grow = grow[order]
        grow_values = grow_values[order] if grow_values is not None else None
    new_nnz = layer.nnz - drop.numel() + grow.numel()
    if new_nnz > MAX_INDEX:
        raise ValueError(f"{name}: {new_nnz} connections after rewiring; int32 indices hold at most {MAX_INDEX}")
    keep = torch.ones(layer.nnz, dtype=torch.bool, device=values.device).index_fill_(0, drop, False)
    topology = layer.topology
    try:
        row, col, src, grown_slots = merge_connections(topology.row, topology.col, keep, grow, topology.shape)
    except ValueError as error:
        raise ValueError(f"{name}: grow positions must be inactive (or dropped in this same call): {error}") from None
    new_values = take_or_fill(values.detach(), src, 0.0)
    if grow_values is not None:
        new_values.index_copy_(0, grown_slots, grow_values)
    state = remapped_state(optimizer, values, src, name)
    return Rewiring(layer, optimizer, layer._prepare_topology(row, col, new_values, made_for_it=True), state)


def rewire(
    layer: SparseLinear,
    optimizer: torch.optim.Optimizer,
    drop: Tensor,
    grow: Tensor,
    *,
    grow_values: Tensor | None = None,
    name: str = "layer",
) -> None:
    """Remove connections ``drop`` and add ``grow``; remap ``optimizer``'s state of ``layer.values``.

    Args:
        drop: ``(k_drop,)`` unique integer positions into the current ``values``.
        grow: ``(k_grow,)`` unique integer linear positions ``r · in + c``, each inactive now
            (or dropped by this call).
        grow_values: ``(k_grow,)`` initial weights of the new connections (default zeros),
            in the order of ``grow``.
        name: how errors name the layer.

    New connections get fresh optimizer state (:func:`snack.dst.optim_state.remapped_state`);
    survivors keep theirs (and their weights). Everything is checked and computed before the
    layer or optimizer changes, so an error (``TypeError``/``ValueError`` naming the bad
    argument, e.g. an ``optimizer`` that does not hold ``layer.values``) leaves both as they were.
    """
    plan_rewire(layer, optimizer, drop, grow, grow_values=grow_values, name=name).apply()
