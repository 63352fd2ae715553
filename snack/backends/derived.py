"""A cache for tensors a backend derives from a topology (a narrower copy of the column indices,
the row indices in column order, ...), shared by the backends.

An entry is keyed by the identity of the tensors it was built from and remembers their version
counters: it is rebuilt when any of them is changed in place (``load_state_dict`` copies into
``row``/``col``), and dropped when any of them is freed (so a new tensor that reuses a freed
one's ``id`` never finds a stale entry). Inference tensors have no version
counter, so nothing derived from them is cached (the value is rebuilt on every call).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable

from torch import Tensor

__all__ = ["derived", "held"]

# (name, ids of the sources) -> (their versions when built, the derived tensor, the finalizers
# that drop the entry when a source is freed)
_CACHE: dict[tuple, tuple[tuple[int, ...], Tensor, list]] = {}
# guards _CACHE against layers running in several threads; reentrant, because a finalizer (_drop)
# may run inside a locked section when the garbage collector frees a source there
_LOCK = threading.RLock()


def _new_lock() -> None:
    # a child forked while another thread held the lock would otherwise wait for it forever
    global _LOCK
    _LOCK = threading.RLock()


os.register_at_fork(after_in_child=_new_lock)


def derived(name: str, sources: tuple[Tensor, ...], build: Callable[[], Tensor]) -> Tensor:
    """``build()``, cached under ``name`` for these exact ``sources`` at their current versions."""
    if any(t.is_inference() for t in sources):
        return build()
    key = (name, *map(id, sources))
    versions = tuple(t._version for t in sources)
    entry = _CACHE.get(key)
    if entry is not None and entry[0] == versions:
        return entry[1]
    value = build()  # first: a build that raises (e.g. validation) must leave no finalizers
    with _LOCK:
        entry = _CACHE.get(key)  # another thread may have built it meanwhile: one set of finalizers
        finalizers = entry[2] if entry is not None else [weakref.finalize(source, _drop, key) for source in sources]
        _CACHE[key] = (versions, value, finalizers)
    return value


def _drop(key: tuple) -> None:
    """Forget ``key``'s entry, and the finalizers on its other sources (a long-lived tensor paired
    with short-lived ones would otherwise collect one dead finalizer per pairing)."""
    with _LOCK:
        entry = _CACHE.pop(key, None)
    if entry is not None:
        for finalizer in entry[2]:
            finalizer.detach()


def held(*sources: Tensor) -> list[Tensor]:
    """Every tensor cached from any of ``sources`` that is still in memory (for memory
    accounting: what backends keep for a topology, whichever of them built it)."""
    ids = set(map(id, sources))
    with _LOCK:
        return [entry[1] for key, entry in _CACHE.items() if ids.intersection(key[1:])]
