"""Dynamic sparse training across the ranks of a ``torch.distributed`` job (e.g. under DDP).

DDP keeps every rank's weights equal by averaging gradients, but a topology update is decided
outside autograd: left alone, each rank would grow from its own shard of the batch (RigL) or its
own random draws (SET), and the ranks' connections would drift apart while DDP keeps averaging
the gradients of ``values`` position by position, silently mixing different connections.

So on more than one rank the DST algorithms

- check once, at construction, that every rank has the same algorithm, configuration, seed and
  topology (:func:`check_same_on_every_rank`);
- let RigL score growth with the gradient of the *global* batch: each rank's recorded ``X`` and
  ``dY`` rows are gathered from every rank (:func:`gather_rows`), so ``Σ dYᵀX`` is the gradient
  DDP averages (up to the factor ``1/world``, which does not change a top-k);
- apply rank 0's choice of dropped and grown connections on every rank
  (:func:`broadcast_choices`), so floating-point ties or a rank's own RNG cannot split them.

Collectives run on the layers' device (CUDA tensors for NCCL, CPU for gloo).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["broadcast_choices", "check_same_on_every_rank", "gather_rows", "resolve_group", "topology_fingerprint"]

# one layer's choice: (drop positions (k_drop,) int64, grow positions (k_grow,) int64, grow values or None)
Choice = tuple[Tensor, Tensor, Tensor | None]


def resolve_group(process_group):
    """The group whose ranks share the topology: ``process_group`` itself, or when it is ``None``
    the default group if ``torch.distributed`` is initialized; ``None`` for a single process."""
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        process_group = dist.group.WORLD
    elif not (dist.is_available() and dist.is_initialized()):
        raise ValueError("process_group was given but torch.distributed is not initialized")
    return process_group if dist.get_world_size(process_group) > 1 else None


def check_same_on_every_rank(summary: dict, group) -> None:
    """Raise ``ValueError`` on every rank if ``summary`` (picklable) differs between ranks."""
    summaries: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(summaries, summary, group=group)
    for rank, other in enumerate(summaries):  # every rank sees the same list, and raises alike
        if other != summaries[0]:
            differing = sorted(key for key in other if summaries[0].get(key) != other.get(key))
            raise ValueError(
                f"dynamic sparse training across {len(summaries)} ranks needs the same set-up on each, but rank "
                f"{dist.get_global_rank(group, rank)} differs from rank {dist.get_global_rank(group, 0)} in: "
                f"{', '.join(differing)} (give every rank the same seed and configuration, and build or load the "
                "model identically, e.g. from one seed or one checkpoint)"
            )


def topology_fingerprint(row: Tensor, col: Tensor, in_features: int) -> int:
    """A 64-bit hash of the coordinates, equal on every rank that holds the same ones."""
    linear = row.to(torch.int64) * in_features + col.to(torch.int64)
    # int64 products wrap around; the position weight makes the hash order-sensitive
    mixed = (linear + 1) * -7046029254386353131 + torch.arange(linear.numel(), device=linear.device)
    return int((mixed ^ (mixed >> 29)).sum()) if linear.numel() else 0


def gather_rows(rows: Tensor, group) -> Tensor:
    """``rows (n_r, width)`` of every rank ``r``, concatenated in rank order: ``(Σ n_r, width)``.

    Ranks may hold different numbers of rows (an uneven last batch, a rank with none)."""
    counts = [torch.zeros(1, dtype=torch.int64, device=rows.device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(counts, torch.tensor([rows.shape[0]], device=rows.device), group=group)
    counts = [int(c) for c in counts]
    padded = rows.new_zeros(max(counts), rows.shape[1])
    padded[: rows.shape[0]] = rows
    gathered = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(gathered, padded.contiguous(), group=group)
    return torch.cat([part[:count] for part, count in zip(gathered, counts)])


def broadcast_choices(choices: list[Choice], device: torch.device, group) -> list[Choice]:
    """Rank 0's ``choices`` (one per layer, in the same layer order on every rank), on every rank.

    Three broadcasts whatever the number of layers: the sizes, the positions, the grow values (in
    float64, whatever the layers' dtypes; ``plan_rewire`` casts them)."""
    source = dist.get_global_rank(group, 0)
    sizes = torch.tensor(
        [[drop.numel(), grow.numel(), values is not None] for drop, grow, values in choices],
        dtype=torch.int64, device=device,
    ).view(-1, 3)
    dist.broadcast(sizes, source, group=group)
    sizes = sizes.tolist()
    positions = torch.cat([torch.cat([d, g]).to(device, torch.int64) for d, g, _ in choices])
    positions = _resized(positions, sum(d + g for d, g, _ in sizes))
    dist.broadcast(positions, source, group=group)
    grow_values = [v.to(device, torch.float64) for _, _, v in choices if v is not None]
    values = torch.cat(grow_values) if grow_values else torch.empty(0, device=device, dtype=torch.float64)
    values = _resized(values, sum(g for _, g, has in sizes if has))
    dist.broadcast(values, source, group=group)
    result, at, value_at = [], 0, 0
    for k_drop, k_grow, has_values in sizes:
        drop, grow = positions[at: at + k_drop], positions[at + k_drop: at + k_drop + k_grow]
        at += k_drop + k_grow
        grow_values = values[value_at: value_at + k_grow] if has_values else None
        value_at += k_grow if has_values else 0
        result.append((drop, grow, grow_values))
    return result


def _resized(tensor: Tensor, numel: int) -> Tensor:
    """``tensor`` if it has ``numel`` elements, else a buffer of that size to receive into (a rank
    other than 0 whose own choice had another size)."""
    return tensor.contiguous() if tensor.numel() == numel else tensor.new_empty(numel)
