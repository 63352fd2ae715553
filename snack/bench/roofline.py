"""This machine's limits, measured once per benchmark run, and the roofline bound of a point.

The roofline bound of a sparse layer computation is ``max(bytes / bandwidth, flops / peak)``:
no kernel can stream its data faster than memory bandwidth, nor compute faster than the dense
GEMM rate. ``distance = measured time / bound`` says how far a kernel is from that limit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from snack.bench.timing import median_time

__all__ = ["Machine", "measure_machine", "sparse_bound"]

# Bytes per copied buffer when measuring bandwidth: large enough that caches hold little of it.
_COPY_BYTES = 256 * 2**20
# Side of the square matrices of the GEMM measuring the compute peak (large enough for MKL and
# cuBLAS to reach their peak, small enough to take about a second on two CPU cores).
_GEMM_SIZE = 2048


@dataclass(frozen=True)
class Machine:
    bandwidth: float  # bytes / s, a large device-to-device copy (read + write counted)
    peak_flops: float  # flop / s, a dense float32 GEMM (torch's matmul: MKL, cuBLAS)


def measure_machine(device: torch.device, repeats: int = 5) -> Machine:
    """Measure copy bandwidth and dense GEMM throughput on ``device`` (a few seconds)."""
    source = torch.ones(_COPY_BYTES // 4, device=device)
    target = torch.empty_like(source)
    copy_time = median_time(lambda: target.copy_(source), device, repeats)
    del source, target
    a = torch.randn(_GEMM_SIZE, _GEMM_SIZE, device=device)
    b = torch.randn(_GEMM_SIZE, _GEMM_SIZE, device=device)
    gemm_time = median_time(lambda: a @ b, device, repeats)
    return Machine(bandwidth=2 * _COPY_BYTES / copy_time, peak_flops=2 * _GEMM_SIZE**3 / gemm_time)


def sparse_bound(
    machine: Machine, out_features: int, in_features: int, nnz: int, batch: int, training: bool, element_size: int = 4
) -> tuple[float, float, float]:
    """``(bound seconds, flops, bytes)`` of a sparse layer's inference or training step.

    Inference (``Y = X·Wᵀ``): ``2·B·nnz`` flops; reads the weight (values + int32 column indices
    + row pointer) and ``X``, writes ``Y``. A training step adds the backward, ``dX = dY·W`` and
    ``dvalues = sddmm(dY, X)``: twice the forward's flops, and at least one more read of the
    weight, a write of ``dvalues`` (nnz values), reads of ``dY`` and ``X`` and a write of ``dX``
    (a fused backward does exactly this; separate kernels move more).
    """
    weight_bytes = nnz * (element_size + 4) + (out_features + 1) * 4
    activation_bytes = batch * (in_features + out_features) * element_size
    if training:
        flops = 3 * 2 * batch * nnz
        moved = 2 * weight_bytes + nnz * element_size + 2 * activation_bytes
    else:
        flops = 2 * batch * nnz
        moved = weight_bytes + activation_bytes
    return max(moved / machine.bandwidth, flops / machine.peak_flops), flops, moved
