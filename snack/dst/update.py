"""The one generic topology update of a layer: drop some connections, grow others.

Every algorithm (SET, RigL, gradual pruning) only decides *which* positions to drop and grow;
:func:`rewire` applies that choice to the layer and its optimizer state, keeping the format's
invariants (indices sorted by ``(row, col)``, unique, in range; caches cleared by
:meth:`SparseLinear.set_topology`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from snack.dst.optim_state import remapped_state
from snack.dst.prune_grow import linear_index
from snack.nn import SparseLinear

__all__ = ["rewire"]


@torch.no_grad()
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
        drop: ``(k_drop,)`` int64 unique positions into the current ``values``.
        grow: ``(k_grow,)`` int64 unique linear positions ``r · in + c``, all inactive now.
        grow_values: ``(k_grow,)`` initial weights of the new connections (default zeros),
            in the order of ``grow``.

    New connections get zero optimizer state; survivors keep theirs (and their weights).
    Everything is computed and checked before the layer or optimizer changes, so an error
    leaves both as they were.
    """
    values = layer.values
    in_features = layer.in_features
    keep = torch.ones(layer.nnz, dtype=torch.bool, device=values.device)
    keep[drop] = False
    kept = keep.nonzero().squeeze(1)
    if grow_values is None:
        grow_values = values.new_zeros(grow.numel())
    linear = torch.cat([linear_index(layer.topology)[kept], grow])
    src = torch.cat([kept, torch.full_like(grow, -1)])
    new_values = torch.cat([values.detach()[kept], grow_values.to(values.dtype)])
    order = torch.argsort(linear)
    linear, src, new_values = linear[order], src[order], new_values[order]
    if linear.numel() > 1 and not bool((linear[1:] > linear[:-1]).all()):
        raise ValueError(f"{name}: grow positions must be unique and inactive")
    state = remapped_state(optimizer, values, src, name)
    layer.set_topology((linear // in_features).to(torch.int32), (linear % in_features).to(torch.int32), new_values)
    if state is not None:
        optimizer.state[values] = state
