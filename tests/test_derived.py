"""The cache of tensors that backends derive from a topology (snack.backends.derived)."""

from __future__ import annotations

import gc
import sys
import threading
import weakref

import pytest
import torch

from snack.backends import derived as derived_module
from snack.backends.derived import derived, held


def test_built_once_per_sources_and_rebuilt_after_an_in_place_change():
    a, b = torch.arange(5), torch.arange(5) * 2
    builds = []

    def build():
        builds.append(1)
        return a + b

    first = derived("sum", (a, b), build)
    assert derived("sum", (a, b), build) is first and len(builds) == 1
    b.add_(1)  # any source's version counter moves: rebuilt
    assert torch.equal(derived("sum", (a, b), build), a + b) and len(builds) == 2
    assert derived("other", (a, b), lambda: a) is not first  # names keep entries apart


def test_entry_dropped_when_a_source_is_freed():
    a, b = torch.arange(3), torch.arange(3)
    derived("pair", (a, b), lambda: a + b)
    key = ("pair", id(a), id(b))
    assert key in derived_module._CACHE
    del b
    gc.collect()
    assert key not in derived_module._CACHE


def test_inference_tensors_are_not_cached():
    with torch.inference_mode():
        a = torch.arange(4)
    builds = []
    for _ in range(2):
        derived("inference", (a,), lambda: builds.append(1) or a * 2)
    assert len(builds) == 2


def test_a_long_lived_source_keeps_no_finalizer_per_dropped_pairing():
    """A layer's ``row`` cached with each topology's fresh ``csc_perm`` in turn."""
    row = torch.arange(100, dtype=torch.int32)
    before = len(weakref.finalize._registry)
    for _ in range(50):
        perm = torch.randperm(100).to(torch.int32)
        derived("test_rows_by_column", (row, perm), lambda: row.index_select(0, perm))
        del perm  # drops the entry
    gc.collect()
    assert not [key for key in derived_module._CACHE if key[0] == "test_rows_by_column"]
    assert len(weakref.finalize._registry) - before == 0


def test_held_lists_what_is_cached_from_any_given_source():
    a, b, other = (torch.arange(4) for _ in range(3))
    from_a = derived("test_held_a", (a,), lambda: a * 2)
    from_ab = derived("test_held_ab", (a, b), lambda: a + b)
    assert {id(t) for t in held(a)} == {id(from_a), id(from_ab)}
    assert [id(t) for t in held(b)] == [id(from_ab)]
    assert held(other) == []


def test_a_build_that_raises_caches_nothing_and_leaves_no_finalizer():
    source = torch.arange(4)
    before = len(weakref.finalize._registry)

    def failing_build():
        raise ValueError("invalid coordinates")

    for _ in range(3):
        with pytest.raises(ValueError, match="invalid coordinates"):
            derived("failing", (source,), failing_build)
    assert len(weakref.finalize._registry) == before
    assert derived("failing", (source,), lambda: source * 2).tolist() == [0, 2, 4, 6]  # a later build is cached


def test_held_runs_while_other_threads_add_and_drop_entries():
    # memory accounting in one thread while others build and free cached tensors (it raised
    # "dictionary changed size during iteration")
    keep = torch.arange(4)
    derived("kept", (keep,), lambda: keep + 1)
    stop, errors = threading.Event(), []

    def churn():
        while not stop.is_set():
            short_lived = torch.arange(4)
            derived("churn", (short_lived,), lambda: short_lived * 2)
            del short_lived

    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    threads = [threading.Thread(target=churn) for _ in range(2)]
    try:
        for thread in threads:
            thread.start()
        for _ in range(3000):
            try:
                assert len(held(keep)) == 1
            except RuntimeError as error:
                errors.append(error)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        sys.setswitchinterval(switch_interval)
    assert not errors
