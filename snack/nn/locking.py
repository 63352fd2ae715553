"""The lock that makes a layer's rewires atomic for forwards running in other threads.

Held while a layer's connections change (``set_topology``, ``load_state_dict``, a DST update)
and while a forward takes its snapshot of them (``SparseLinear._consistent_state``). One lock for
every layer: readers hold it for microseconds, and it needs no copying with a layer (pickle,
deepcopy). Read it as ``locking.STATE_LOCK`` (not ``from ... import``): a forked child gets a new one.
"""

from __future__ import annotations

import os
import threading

STATE_LOCK = threading.RLock()


def _new_state_lock() -> None:
    # a child forked while another thread held the lock would otherwise wait for it forever
    global STATE_LOCK
    STATE_LOCK = threading.RLock()


os.register_at_fork(after_in_child=_new_state_lock)
