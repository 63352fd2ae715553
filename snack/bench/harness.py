"""The layer benchmark: every variant on every grid point, interleaved, in one process.

For each ``(size, sparsity)`` the variants are built once from one topology. For each
``(batch, mode)`` every variant is warmed up, then ``repeats`` rounds each take one sample of
every variant, in an order that rotates between rounds, so drift on a shared machine affects
all variants alike. Reported: median seconds per call and the interquartile range, the
speedups over ``dense`` and ``dense+mask`` (ratios of medians), snack's roofline bound and its
distance to it, the page faults a call takes (counted over a few calls after the samples, see
:mod:`snack.bench.page_faults`), and each variant's training memory.
"""

from __future__ import annotations

import statistics
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import torch

from snack import backends
from snack.bench.page_faults import minor_faults
from snack.bench.roofline import Machine, sparse_bound
from snack.bench.timing import interleaved_samples
from snack.bench.variants import build_variants
from snack.topology import nnz_for_sparsity

__all__ = ["Grid", "MemoryRecord", "TimeRecord", "run_grid", "select"]

MODES = ("inference", "training")


@dataclass(frozen=True)
class Grid:
    sizes: tuple[tuple[int, int], ...]  # (out_features, in_features)
    sparsities: tuple[float, ...]
    batches: tuple[int, ...]
    modes: tuple[str, ...] = MODES
    repeats: int = 7

    def points(self) -> int:
        return len(self.sizes) * len(self.sparsities) * len(self.batches) * len(self.modes)


@dataclass
class TimeRecord:
    """One variant at one grid point. Times in milliseconds per call."""

    out_features: int
    in_features: int
    sparsity: float
    batch: int
    mode: str
    variant: str
    median_ms: float
    q25_ms: float
    q75_ms: float
    speedup_vs_dense: float = float("nan")
    speedup_vs_mask: float = float("nan")
    bound_ms: float = float("nan")  # snack only: the roofline bound
    distance: float = float("nan")  # snack only: median / bound
    faults_per_call: float = float("nan")  # minor page faults (fresh memory); NaN where not counted
    samples_ms: list[float] = field(default_factory=list, repr=False)


@dataclass
class MemoryRecord:
    """Training memory of one variant (bytes): parameters, gradients, Adam state, structure."""

    out_features: int
    in_features: int
    sparsity: float
    variant: str
    params: int
    grads: int
    adam: int
    structure: int
    total: int
    reduction_vs_dense: float = float("nan")  # 1 - total / dense total


def _quartiles(samples: list[float]) -> tuple[float, float, float]:
    if len(samples) < 2:
        return samples[0], samples[0], samples[0]
    q25, q50, q75 = statistics.quantiles(samples, n=4, method="inclusive")
    return q25, q50, q75


# Calls over which a variant's page faults are counted, after its samples (in the steady state)
_FAULT_CALLS = 3


def _measure_point(
    variants, size: tuple[int, int], batch: int, mode: str, repeats: int, device: torch.device
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Interleaved samples (seconds per call) of every variant at one (batch, mode), and the
    minor page faults per call of each (NaN where the platform does not count them)."""
    out_features, in_features = size
    generator = torch.Generator(device=device).manual_seed(batch)
    x = torch.randn(batch, in_features, device=device, generator=generator)
    dy = torch.randn(batch, out_features, device=device, generator=generator)
    x_grad = x.clone().requires_grad_()

    def call(variant) -> Callable[[], object]:
        if mode == "inference":
            return lambda: variant.infer(x)
        return lambda: variant.train_step(x_grad, dy)

    calls = {v.name: call(v) for v in variants}
    samples = interleaved_samples(calls, device, repeats)
    return samples, {name: _faults_per_call(fn) for name, fn in calls.items()}


def _faults_per_call(fn: Callable[[], object]) -> float:
    before = minor_faults()
    if before is None:
        return float("nan")
    for _ in range(_FAULT_CALLS):
        fn()
    return (minor_faults() - before) / _FAULT_CALLS


def _time_records(
    point: dict, samples: dict[str, list[float]], faults: dict[str, float], bound: float
) -> list[TimeRecord]:
    medians = {name: statistics.median(s) for name, s in samples.items()}
    records = []
    for name, s in samples.items():
        q25, median, q75 = _quartiles(s)
        record = TimeRecord(
            **point, variant=name, median_ms=median * 1e3, q25_ms=q25 * 1e3, q75_ms=q75 * 1e3,
            speedup_vs_dense=medians["dense"] / median, speedup_vs_mask=medians["dense+mask"] / median,
            faults_per_call=faults[name], samples_ms=[t * 1e3 for t in s],
        )
        if name == "snack":
            record.bound_ms = bound * 1e3
            record.distance = median / bound
        records.append(record)
    return records


def _memory_records(size: tuple[int, int], sparsity: float, variants) -> list[MemoryRecord]:
    memories = {v.name: v.state_bytes() for v in variants}
    dense_total = memories["dense"].total
    return [
        MemoryRecord(
            out_features=size[0], in_features=size[1], sparsity=sparsity, variant=name,
            **{k: v for k, v in asdict(m).items()}, total=m.total, reduction_vs_dense=1 - m.total / dense_total,
        )
        for name, m in memories.items()
    ]


def _forward_column_bytes(device: torch.device, batch: int, in_features: int) -> int:
    """Bytes per column index the default backend's forward reads (the CPU backend's batch-1
    kernel reads a 16-bit copy), so that the bound counts what the kernel must move."""
    backend = backends.resolve(device)
    return getattr(backend, "forward_column_bytes", lambda batch, in_features: 4)(batch, in_features)


def run_grid(
    grid: Grid, machine: Machine, device: torch.device, progress: Callable[[str], None] | None = None
) -> tuple[list[TimeRecord], list[MemoryRecord]]:
    """Measure every point of ``grid``; ``progress(description)`` is called after each point."""
    times: list[TimeRecord] = []
    memory: list[MemoryRecord] = []
    with warnings.catch_warnings():
        # torch.sparse CSR announces its beta status on first use; not news to a benchmark reader
        warnings.filterwarnings("ignore", message=".*[Ss]parse.*")
        for size in grid.sizes:
            measured: dict[float, float] = {}  # recorded sparsity -> the sparsity asked for that gave it
            for requested in grid.sparsities:
                nnz = nnz_for_sparsity(*size, requested)
                sparsity = real_sparsity(nnz, size[0] * size[1])
                if sparsity in measured:  # records are keyed on it: measure each once
                    warnings.warn(
                        f"snack bench: at {size[0]}x{size[1]}, sparsity {requested:g} is recorded as {sparsity:g}, as "
                        f"{measured[sparsity]:g} is; measured once",
                        stacklevel=2,
                    )
                    for _ in range(len(grid.batches) * len(grid.modes)):
                        if progress is not None:
                            progress(f"{size[0]}x{size[1]} s={requested:g} (as {measured[sparsity]:g})")
                    continue
                measured[sparsity] = requested
                variants = build_variants(*size, requested, device)
                for batch in grid.batches:
                    for mode in grid.modes:
                        samples, faults = _measure_point(variants, size, batch, mode, grid.repeats, device)
                        bound, _, _ = sparse_bound(
                            machine, *size, nnz, batch, mode == "training",
                            forward_column_bytes=_forward_column_bytes(device, batch, size[1]),
                        )
                        point = dict(out_features=size[0], in_features=size[1], sparsity=sparsity, batch=batch, mode=mode)
                        times.extend(_time_records(point, samples, faults, bound))
                        if progress is not None:
                            progress(f"{size[0]}x{size[1]} s={sparsity} B={batch} {mode}")
                # gradients exist now (training steps ran), as they do during training
                memory.extend(_memory_records(size, sparsity, variants))
                del variants
    return times, memory


def real_sparsity(nnz: int, total: int) -> float:
    """The sparsity a record carries for ``nnz`` of ``total`` connections: the real one (nnz is
    whole: a 4x4 layer at 0.9 is 0.875), to 6 decimals (0.9 reads 0.9 at 4096x4096, where it is
    1 - 1677722 / 4096²), but never rounded up to 1 while the layer has connections."""
    exact = 1.0 - nnz / total
    rounded = round(exact, 6)
    return rounded if rounded < 1 or nnz == 0 else exact


def select(records: Iterable[TimeRecord], **fields) -> list[TimeRecord]:
    """The records whose attributes equal ``fields``."""
    return [r for r in records if all(getattr(r, k) == v for k, v in fields.items())]
