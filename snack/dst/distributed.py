"""Dynamic sparse training across the ranks of a ``torch.distributed`` job (e.g. under DDP).

DDP keeps every rank's weights equal by averaging gradients, but a topology update is decided
outside autograd: left alone, each rank would grow from its own shard of the batch (RigL) or its
own random draws (SET), and the ranks' connections would drift apart while DDP keeps averaging
the gradients of ``values`` position by position, silently mixing different connections.

So on more than one rank the DST algorithms

- check first thing at construction that every rank has the same arguments, model topology
  and optimizer layout (:func:`check_same_on_every_rank`), so that the constructor's own checks
  then fail on every rank or on none;
- let RigL score growth with the gradient of the *global* batch: every rank's recorded ``X`` and
  ``dY`` rows are gathered on rank 0 (:func:`gather_rows`), so ``Σ dYᵀX`` is the gradient DDP
  averages (up to the factor ``1/world``, which does not change a top-k);
- apply rank 0's choice of dropped and grown connections on every rank
  (:func:`broadcast_choices`), so floating-point ties or a rank's own RNG cannot split them;
- agree after each local phase of an update (:func:`agreed`): an error on one rank (out of
  memory, say) raises on every rank with nothing changed on any, rather than leave the others
  waiting in the next collective; so does a rank at another step or with another topology.

Collectives run on the layers' device (CUDA tensors for NCCL, CPU tensors for gloo).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from snack.topology import linear_positions

__all__ = [
    "agreed", "broadcast_choices", "check_same_on_every_rank", "comparable", "gather_rows", "is_rank_zero",
    "model_summary", "optimizer_summary", "resolve_group", "topology_fingerprint",
]

# one layer's choice: (drop positions (k_drop,) int64, grow positions (k_grow,) int64, grow values or None)
Choice = tuple[Tensor, Tensor, Tensor | None]
T = TypeVar("T")


def resolve_group(process_group):
    """The group whose ranks share the topology, or ``None`` to act alone.

    ``None`` (the default): the default group when ``torch.distributed`` is initialized. A group:
    that group (this rank must be in it). ``False``: this rank alone, e.g. independent models
    trained side by side in one job.
    """
    if process_group is False:
        return None
    initialized = dist.is_available() and dist.is_initialized()
    if process_group is None:
        if not initialized:
            return None
        process_group = dist.group.WORLD
    elif not initialized:
        raise ValueError("process_group was given but torch.distributed is not initialized")
    elif dist.get_rank(process_group) < 0:
        raise ValueError(f"process_group: rank {dist.get_rank()} is not in the group it was given")
    return process_group if dist.get_world_size(process_group) > 1 else None


def is_rank_zero(group) -> bool:
    return dist.get_rank(group) == 0


def check_same_on_every_rank(summary: dict, group) -> None:
    """Raise ``ValueError`` on every rank if ``summary`` (picklable) differs between ranks."""
    summaries: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(summaries, summary, group=group)
    for rank, other in enumerate(summaries):  # every rank sees the same list, and raises alike
        if other != summaries[0]:
            differing = _differences(summaries[0], other)
            raise ValueError(
                f"dynamic sparse training across {len(summaries)} ranks needs the same set-up on each, but rank "
                f"{dist.get_global_rank(group, rank)} differs from rank {dist.get_global_rank(group, 0)} in: "
                f"{', '.join(differing)} (give every rank the same arguments and seed, and build or load the model "
                "and optimizer identically, e.g. from one seed or one checkpoint)"
            )


def _differences(first: dict, other: dict) -> list[str]:
    """The keys whose values differ, with the differing keys inside when both are dicts:
    ``["arguments (seed)", "model"]``."""
    found = []
    for key in sorted(first.keys() | other.keys()):
        a, b = first.get(key), other.get(key)
        if a != b:
            inner = _differences(a, b) if isinstance(a, dict) and isinstance(b, dict) else []
            found.append(f"{key} ({', '.join(inner)})" if inner else key)
    return found


def comparable(value, model):
    """``value`` (a constructor argument) in a form that compares equal across ranks when it means
    the same: modules by their name in ``model``, numbers and strings by ``repr`` (NaN too)."""
    if isinstance(value, (list, tuple)):
        return [comparable(item, model) for item in value]
    if isinstance(value, (set, frozenset)):  # its order differs between processes
        return sorted(comparable(item, model) for item in value)
    if isinstance(value, nn.Module):
        for name, module in model.named_modules() if isinstance(model, nn.Module) else ():
            if module is value:
                return f"<module {name!r}>"
        return f"<{type(value).__name__} outside the model>"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    return f"<{type(value).__name__}>"


def model_summary(model) -> list | str:
    """Each sparse layer's name, shape, nnz and :func:`topology_fingerprint`."""
    from snack.nn import SparseLinear

    if not isinstance(model, nn.Module):
        return f"<{type(model).__name__}>"
    return [
        (name, m.out_features, m.in_features, m.nnz, topology_fingerprint(m.row, m.col, m.in_features))
        for name, m in model.named_modules()
        if isinstance(m, SparseLinear)
    ]


def optimizer_summary(optimizer) -> list | str:
    """The optimizer's type and the shapes of its parameter groups."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return f"<{type(optimizer).__name__}>"
    return [type(optimizer).__name__, [[tuple(p.shape) for p in group["params"]] for group in optimizer.param_groups]]


def topology_fingerprint(row: Tensor, col: Tensor, in_features: int) -> int:
    """A 64-bit hash of the coordinates, equal on every rank that holds the same ones."""
    linear = linear_positions(row, col, in_features)
    # int64 products wrap around; the position weight makes the hash order-sensitive
    mixed = (linear + 1) * -7046029254386353131 + torch.arange(linear.numel(), device=linear.device)
    return int((mixed ^ (mixed >> 29)).sum()) if linear.numel() else 0


def agreed(group, doing: str, compute: Callable[[], T], check=None) -> T:
    """``compute()`` on this rank, then (on several ranks) make sure every rank succeeded with the
    same ``check``: if one did not, every rank raises (that rank its own error), so none goes on
    to a collective the others never reach. ``doing`` names the phase for the message."""
    try:
        result, error = compute(), None
    except Exception as caught:  # reported to the other ranks, then raised here
        result, error = None, caught
    if group is None:
        if error is not None:
            raise error
        return result
    reports: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, (None if error is None else f"{type(error).__name__}: {error}", check), group=group)
    if error is not None:
        raise error
    for rank, (failure, other_check) in enumerate(reports):
        who = f"rank {dist.get_global_rank(group, rank)}"
        if failure is not None:
            raise RuntimeError(f"dynamic sparse training: {who} failed while {doing} ({failure}); no rank changed")
        if other_check != reports[0][1]:
            raise RuntimeError(
                f"dynamic sparse training: the ranks disagree while {doing}: {who} has {other_check}, rank "
                f"{dist.get_global_rank(group, 0)} {reports[0][1]}. Every rank must call dst.step() on the same "
                "steps and load the same DST state; no rank changed"
            )
    return result


def gather_rows(rows: Tensor, group) -> tuple[Tensor | None, int]:
    """``(rows of every rank concatenated in rank order (Σ n_r, width) on rank 0 (None on the
    others), Σ n_r on every rank)`` for this rank's ``rows (n_r, width)`` (or ``(n_r,)``: an
    embedding's ids); ranks may hold different numbers of rows (an uneven last batch, a rank
    with none)."""
    counts = [torch.zeros(1, dtype=torch.int64, device=rows.device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(counts, torch.tensor([rows.shape[0]], device=rows.device), group=group)
    counts = [int(c) for c in counts]
    padded = rows.new_zeros(max(counts), *rows.shape[1:])
    padded[: rows.shape[0]] = rows
    receive = [torch.empty_like(padded) for _ in counts] if is_rank_zero(group) else None
    dist.gather(padded, receive, dst=dist.get_global_rank(group, 0), group=group)
    if receive is None:
        return None, sum(counts)
    return torch.cat([part[:count] for part, count in zip(receive, counts)]), sum(counts)


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


def broadcast_generator(generator: torch.Generator, device: torch.device, group) -> None:
    """Set ``generator`` to rank 0's state on every rank: only rank 0 plans an update that needs
    the gradient records (the others' draws would not happen), and the ranks' DST state must stay
    one (a checkpoint of any rank resumes the same run)."""
    state = generator.get_state().to(device)
    dist.broadcast(state, dist.get_global_rank(group, 0), group=group)
    generator.set_state(state.cpu())


def _resized(tensor: Tensor, numel: int) -> Tensor:
    """``tensor`` if it has ``numel`` elements, else a buffer of that size to receive into (a rank
    other than 0 whose own choice had another size)."""
    return tensor.contiguous() if tensor.numel() == numel else tensor.new_empty(numel)
