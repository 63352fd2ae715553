"""The sparse ops on a topology that holds every connection (``nnz = out · in``), by dense math.

A topology is sorted by (row, col) and unique, so one with all ``out · in`` connections lists
every position in row-major order: its ``values`` are the dense weight, ``values.view(out, in)``,
without a copy, and its weight gradient is the dense one. ERK (``distribution="erk"``) leaves
small layers fully dense (the 10-way classifier of ``snack train``), and ``from_dense(...,
sparsity=None)`` keeps every weight of a dense layer without zeros. For such a topology
:func:`snack.backends.resolve` picks these functions (BLAS: MKL, cuBLAS) over the sparse
kernels, which gather every input of every row one by one. A layer's training step with these
against the native CPU kernels (AMD Zen 4, 2 threads, interleaved, 2026-12-02): 1024×1024 at
batch 64 in 0.70x the time and at batch 1 in 0.48x, 10×1024 at batch 64 in 0.86x (``nn.Linear``:
0.69x, 0.38x, 0.71x; the rest is the layer's Python). Not measured on a GPU yet. Nothing here
builds a tensor larger than the sparse kernels' outputs.

Not when a backend is forced (:func:`snack.use_backend`: its kernels run as they are), nor on a
GPU under ``torch.use_deterministic_algorithms(True)``, where cuBLAS needs
``CUBLAS_WORKSPACE_CONFIG`` set and raises without it; snack's own GPU kernels need nothing.
Shapes and contracts are those of :mod:`snack.backends`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from snack.topology import TopologyTensors


def supports(device: torch.device) -> bool:
    return True


def applies(device: torch.device, topo: TopologyTensors) -> bool:
    """Whether ``topo`` holds every connection and ``device`` takes dense math (module docstring)."""
    if topo.row.numel() != (topo.rowptr.numel() - 1) * (topo.colptr.numel() - 1):
        return False
    return device.type != "cuda" or not torch.are_deterministic_algorithms_enabled()


def _weight(values: Tensor, topo: TopologyTensors) -> Tensor:
    """``values (nnz,)`` as the dense ``(out, in)`` weight: a view."""
    return values.view(topo.rowptr.numel() - 1, topo.colptr.numel() - 1)


def spmm(x: Tensor, values: Tensor, topo: TopologyTensors, bias: Tensor | None = None) -> Tensor:
    """``x (B, in)`` → ``(B, out)``, ``x·Wᵀ (+ bias)``."""
    return F.linear(x, _weight(values, topo), bias)


def spmm_t(dy: Tensor, values: Tensor, topo: TopologyTensors) -> Tensor:
    """``dy (B, out)`` → ``(B, in)``, ``dY·W``."""
    return dy @ _weight(values, topo)


def sddmm(dy: Tensor, x: Tensor, topo: TopologyTensors) -> Tensor:
    """``(nnz,)``: ``dYᵀ·X`` in row-major order, the connections' order."""
    return (dy.t() @ x).view(-1)


def spmm_backward(dy: Tensor, x: Tensor, values: Tensor, topo: TopologyTensors, *, bias_grad: bool = False):
    """``(dx, dvalues)``, and ``dy.sum(0)`` third when ``bias_grad``."""
    grads = spmm_t(dy, values, topo), sddmm(dy, x, topo)
    return (*grads, dy.sum(0)) if bias_grad else grads
