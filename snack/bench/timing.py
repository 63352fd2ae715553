"""Wall-clock timing that is right on CPU and GPU: synchronise the device around each sample,
and batch several calls into one sample when one call is too short for the clock."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["Timer", "median_time"]

# A sample should last at least this long: timer resolution and overhead stay small, and a
# sample measures back-to-back calls (as in a training loop) rather than mostly the first call
# after another variant has evicted this one's data from the caches.
_MIN_SAMPLE_SECONDS = 20e-3
_MAX_CALLS_PER_SAMPLE = 200


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Times ``fn`` in samples of ``calls`` back-to-back calls (chosen by :meth:`warm_up`)."""

    def __init__(self, fn: Callable[[], object], device: torch.device):
        self.fn = fn
        self.device = device
        self.calls = 1

    def warm_up(self, rounds: int = 2) -> None:
        """Run ``fn`` a few times (first-call costs, caches), then size the samples."""
        for _ in range(rounds):
            self.fn()
        one = self._time(1)
        self.calls = max(1, min(_MAX_CALLS_PER_SAMPLE, int(_MIN_SAMPLE_SECONDS / max(one, 1e-9))))

    def _time(self, calls: int) -> float:
        synchronize(self.device)
        start = time.perf_counter()
        for _ in range(calls):
            self.fn()
        synchronize(self.device)
        return (time.perf_counter() - start) / calls

    def sample(self) -> float:
        """Seconds per call, averaged over one sample."""
        return self._time(self.calls)


def median_time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds per call of ``fn`` over ``repeats`` samples, after a warm-up."""
    timer = Timer(fn, device)
    timer.warm_up()
    return statistics.median(timer.sample() for _ in range(repeats))
