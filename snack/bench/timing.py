"""Wall-clock timing that is right on CPU and GPU: synchronise the device around each sample,
and batch several calls into one sample when one call is too short for the clock."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["Timer", "interleaved_medians", "interleaved_samples", "median_time", "synchronize"]

# A sample should last at least this long: timer resolution and overhead stay small, and a
# sample measures back-to-back calls (as in a training loop).
_MIN_SAMPLE_SECONDS = 20e-3
_MAX_CALLS_PER_SAMPLE = 200
# Untimed calls of the same function right before each sample. On the 2-core VM this project
# measures on, the first few calls after other work (another variant, or even 50 ms of idling)
# run 1.5-2x slower for any variant: a 90%-sparse 4096² batch-32 training step took 9-12 ms,
# then 7, then 5.5 ms steady (a ramp of ~20 ms), with no page faults or context switches (CPU
# clock or vCPU ramp-up). Interleaving variants would otherwise measure that ramp instead of the
# steady state a training loop runs in.
_LEAD_IN_SECONDS = 30e-3


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Times ``fn`` in samples of ``calls`` back-to-back calls, each sample after ``lead_in``
    untimed calls (both chosen by :meth:`warm_up`)."""

    def __init__(self, fn: Callable[[], object], device: torch.device):
        self.fn = fn
        self.device = device
        self.calls = 1
        self.lead_in = 1

    def warm_up(self, rounds: int = 2) -> None:
        """Run ``fn`` a few times (first-call costs, caches), then size the samples."""
        for _ in range(rounds):
            self.fn()
        one = max(self._time(1), 1e-9)
        self.calls = max(1, min(_MAX_CALLS_PER_SAMPLE, int(_MIN_SAMPLE_SECONDS / one)))
        self.lead_in = max(1, min(_MAX_CALLS_PER_SAMPLE, int(_LEAD_IN_SECONDS / one)))

    def _time(self, calls: int) -> float:
        synchronize(self.device)
        start = time.perf_counter()
        for _ in range(calls):
            self.fn()
        synchronize(self.device)
        return (time.perf_counter() - start) / calls

    def sample(self) -> float:
        """Seconds per call, averaged over one sample (after its untimed lead-in)."""
        for _ in range(self.lead_in):
            self.fn()
        return self._time(self.calls)


def median_time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds per call of ``fn`` over ``repeats`` samples, after a warm-up."""
    timer = Timer(fn, device)
    timer.warm_up()
    return statistics.median(timer.sample() for _ in range(repeats))


def interleaved_samples(functions: dict, device: torch.device, samples: int) -> dict[object, list[float]]:
    """Seconds per call of each of ``functions`` (key → callable), ``samples`` of each: every one
    warmed up, then rounds taking one sample of each in turn, so that the machine's drift reaches
    them alike, starting each round one function further on (none always runs first)."""
    timers = {key: Timer(fn, device) for key, fn in functions.items()}
    for timer in timers.values():
        timer.warm_up()
    taken: dict = {key: [] for key in timers}
    keys = list(timers)
    for round_index in range(samples):
        shift = round_index % len(keys)
        for key in keys[shift:] + keys[:shift]:
            taken[key].append(timers[key].sample())
    return taken


def interleaved_medians(functions: dict, device: torch.device, samples: int) -> dict:
    """Median seconds per call of each of ``functions``, sampled by :func:`interleaved_samples`."""
    return {key: statistics.median(values) for key, values in interleaved_samples(functions, device, samples).items()}
