"""This machine's limits, measured once per benchmark run, and the roofline bound of a point.

The roofline bound of a sparse layer computation is ``max(bytes / bandwidth, flops / peak)``:
no kernel can stream its data faster than memory bandwidth, nor compute faster than the dense
GEMM rate. ``distance = measured time / bound`` says how far a kernel is from that limit.

Bandwidth depends on where the data lives. A benchmark calls a layer back to back, so a sparse
weight that fits in the last-level cache is read from there: on the 2-core Xeon this project
measures on, a 13 MB weight (4096², 90%) streams at ~40 GB/s from L3, while DRAM gives ~17. Both
rates are measured, and a point whose working set fits the cache-sized buffer gets the cache
rate (with DRAM alone, batch-1 points showed distances below 1, i.e. faster than their "bound").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from snack.bench.timing import median_time

__all__ = ["Machine", "measure_machine", "sparse_bound"]

# Bytes per copied buffer when measuring bandwidth: large enough that caches hold little of it.
_COPY_BYTES = 256 * 2**20
# Bytes of the buffer read back to back to measure the cache's rate (CPU only): the working set
# of a 90%-sparse 4096² training step (weight, dvalues, packed tiles) fits in it.
_CACHE_BYTES = 32 * 2**20
# Side of the square matrices of the GEMM measuring the compute peak (large enough for MKL and
# cuBLAS to reach their peak, small enough to take about a second on two CPU cores).
_GEMM_SIZE = 2048


@dataclass(frozen=True)
class Machine:
    bandwidth: float  # bytes / s, a large device-to-device copy (read + write counted)
    peak_flops: float  # flop / s, a dense float32 GEMM (torch's matmul: MKL, cuBLAS)
    # bytes / s reading a cache_bytes buffer back to back (at least `bandwidth`; 0 bytes: none)
    cache_bandwidth: float = 0.0
    cache_bytes: int = 0

    def bandwidth_for(self, working_set: int) -> float:
        """The rate at which a working set of this many bytes streams when used back to back."""
        if working_set <= self.cache_bytes:
            return max(self.cache_bandwidth, self.bandwidth)
        return self.bandwidth


def measure_machine(device: torch.device, repeats: int = 5) -> Machine:
    """Measure copy bandwidth, cache read bandwidth (CPU) and dense GEMM throughput (a few seconds)."""
    source = torch.ones(_COPY_BYTES // 4, device=device)
    target = torch.empty_like(source)
    copy_time = median_time(lambda: target.copy_(source), device, repeats)
    del source, target
    cache_bandwidth, cache_bytes = 0.0, 0
    if device.type == "cpu":
        cached = torch.ones(_CACHE_BYTES // 4)
        cache_bandwidth = _CACHE_BYTES / median_time(cached.sum, device, repeats)
        cache_bytes = _CACHE_BYTES
        del cached
    a = torch.randn(_GEMM_SIZE, _GEMM_SIZE, device=device)
    b = torch.randn(_GEMM_SIZE, _GEMM_SIZE, device=device)
    gemm_time = median_time(lambda: a @ b, device, repeats)
    return Machine(
        bandwidth=2 * _COPY_BYTES / copy_time,
        peak_flops=2 * _GEMM_SIZE**3 / gemm_time,
        cache_bandwidth=cache_bandwidth,
        cache_bytes=cache_bytes,
    )


def sparse_bound(
    machine: Machine,
    out_features: int,
    in_features: int,
    nnz: int,
    batch: int,
    training: bool,
    element_size: int = 4,
    forward_column_bytes: int = 4,
) -> tuple[float, float, float]:
    """``(bound seconds, flops, bytes)`` of a sparse layer's inference or training step.

    Inference (``Y = X·Wᵀ``): ``2·B·nnz`` flops; reads the weight (values + column indices of
    ``forward_column_bytes`` each + int32 row pointer) and ``X``, writes ``Y``. A training step
    adds the backward, ``dX = dY·W`` and ``dvalues = sddmm(dY, X)``: twice the forward's flops,
    and at least one more read of the weight (int32 columns), a write of ``dvalues`` (nnz
    values), reads of ``dY`` and ``X`` and a write of ``dX`` (a fused backward does exactly
    this; separate kernels move more). The bandwidth is the cache's when the working set
    (weight, dvalues, activations) fits it (:meth:`Machine.bandwidth_for`).
    """
    pointer_bytes = (out_features + 1) * 4
    forward_weight = nnz * (element_size + forward_column_bytes) + pointer_bytes
    weight_bytes = nnz * (element_size + 4) + pointer_bytes
    activation_bytes = batch * (in_features + out_features) * element_size
    if training:
        flops = 3 * 2 * batch * nnz
        # forward: X in, Y out; backward: dY and X in, dX out
        moved = (forward_weight + weight_bytes + nnz * element_size
                 + 2 * activation_bytes + batch * in_features * element_size)
        working_set = weight_bytes + nnz * element_size + 2 * activation_bytes
    else:
        flops = 2 * batch * nnz
        moved = working_set = forward_weight + activation_bytes
    bandwidth = machine.bandwidth_for(working_set)
    return max(moved / bandwidth, flops / machine.peak_flops), flops, moved
