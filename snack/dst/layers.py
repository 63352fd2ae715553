"""Which layers a DST algorithm acts on: the ``layers=`` argument resolved against a model."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

from torch import nn

from snack.nn import SparseLinear, SparseTiedHead

__all__ = ["find_layers", "listed"]


def listed(layers):
    """``layers`` as given, but a one-shot iterable (a generator, ``filter(...)``) as a list: a
    constructor reads it more than once (the agreement across ranks, then the layers it names).
    Never raises, so that every rank reaches the agreement first; :func:`find_layers` checks."""
    reusable = (str, nn.Module, list, tuple, set, frozenset)
    if layers is None or isinstance(layers, reusable) or not isinstance(layers, Iterable):
        return layers
    return list(layers)


def find_layers(model: nn.Module, layers) -> list[tuple[str, SparseLinear]]:
    """``[(qualified name, layer)]``: the SparseLinear layers of ``model`` that ``layers`` names
    (``None``: all; names, glob patterns or modules, in the order given; a set in the model's
    order), each once, under the first name the model lists it by. A name may be any a layer is
    reachable under (a shared layer's second one too), and a :class:`snack.SparseTiedHead` (its
    name or itself) stands for its embedding, whose table is the head's weight. Raises
    ``TypeError``/``ValueError`` naming what does not fit."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    named = {name: m for name, m in model.named_modules() if isinstance(m, SparseLinear)}
    by_id = {id(m): name for name, m in named.items()}
    aliases = {}  # every name a layer (or a tied head, for its embedding) is reachable under -> its first name
    for name, m in model.named_modules(remove_duplicate=False):
        m = m.embedding if isinstance(m, SparseTiedHead) else m
        if id(m) in by_id:
            aliases[name] = by_id[id(m)]
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
        found = []
        for item in layers:
            if isinstance(item, SparseTiedHead):
                item = item.embedding
            if isinstance(item, str) and item not in aliases and any(c in item for c in "*?["):
                # a glob pattern, as sparsify's include/exclude take: its matches in model order;
                # layers another item listed already are not listed twice
                matches = [name for name in named if fnmatch.fnmatchcase(name, item)]
                if not matches:
                    raise ValueError(
                        f"layers: pattern {item!r} matches no SparseLinear of the model (have {sorted(named)})"
                    )
                found.extend((name, named[name]) for name in matches if all(name != seen for seen, _ in found))
            elif isinstance(item, str):
                if item not in aliases:
                    raise ValueError(f"layers: {item!r} is not a SparseLinear of the model (have {sorted(named)})")
                found.append((aliases[item], named[aliases[item]]))
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

