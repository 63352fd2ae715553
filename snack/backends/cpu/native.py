"""The native CPU kernels' ops: ``kernels.cpp``, built by :mod:`snack.backends.cpu` when
this module is imported (at once when cached), wrapped as the backend protocol of
:mod:`snack.backends` asks.

Shapes follow :mod:`snack.backends`: ``spmm`` ``x (B, in)`` → ``(B, out)``, ``spmm_t``
``dy (B, out)`` → ``(B, in)``, ``sddmm`` → ``(nnz,)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from snack.backends.cpu import build
from snack.backends.derived import derived
from snack.topology import TopologyTensors

__all__ = ["forward_column_bytes", "narrow_columns", "sddmm", "spmm", "spmm_backward", "spmm_t", "supports"]

# raises BuildError when the kernels cannot be built: snack.backends then reports the backend
# unavailable and runs the reference backend
build()
_ops = torch.ops.snack_cpu


def supports(device: torch.device) -> bool:
    return device.type == "cpu"


# Largest in_features whose column indices fit the 16-bit copy that batch-1 forwards read.
_MAX_U16_COLUMNS = 1 << 16


def narrow_columns(col: Tensor) -> Tensor:
    """``col`` as unsigned 16-bit values stored in an int16 tensor (``in_features <= 65536``).

    A batch-1 forward reads little besides the weight: 6 bytes per non-zero instead of 8 made it
    ~13% faster (0.39 -> 0.34 ms at 4096², 90%). The copy is cached per
    ``col`` tensor (:func:`snack.backends.derived.derived`: dropped with it, rebuilt if ``col`` is
    changed in place, as ``load_state_dict`` does); it costs 2 bytes per non-zero, which
    ``snack bench`` counts in the layer's memory.
    """
    # 32768..65535 stored as their int16 bit patterns; the kernel reads them as uint16
    return derived("u16_columns", (col,), lambda: torch.where(col >= 1 << 15, col - (1 << 16), col).to(torch.int16))


def forward_column_bytes(batch: int, in_features: int) -> int:
    """Bytes per column index :func:`spmm` reads (for the benchmark's roofline bound)."""
    return 2 if batch == 1 and in_features <= _MAX_U16_COLUMNS else 4


def spmm(x: Tensor, values: Tensor, topo: TopologyTensors, bias: Tensor | None = None) -> Tensor:
    """``Y = X·Wᵀ (+ bias)``: ``x (B, in)`` → ``(B, out)``, the bias added in the kernel. Batch 1
    reads 16-bit columns (see :func:`narrow_columns`)."""
    # (inference tensors have no version counter to keep the cached copy honest: 32-bit path)
    if forward_column_bytes(x.shape[0], x.shape[1]) == 2 and not topo.col.is_inference():
        return _ops.spmv_u16(x, values, topo.rowptr, narrow_columns(topo.col), bias)
    return _ops.spmm(x, values, topo.rowptr, topo.col, bias)


def spmm_t(dy: Tensor, values: Tensor, topo: TopologyTensors) -> Tensor:
    """``dX = dY·W``: ``dy (B, out)`` → ``(B, in)``. Walks rows and scatters into per-thread
    accumulators (no atomics); faster here than the column walk through ``csc_perm``."""
    return _ops.spmm_t(dy, values, topo.rowptr, topo.col, topo.colptr.numel() - 1)


def sddmm(dy: Tensor, x: Tensor, topo: TopologyTensors) -> Tensor:
    """``out[k] = Σ_b dy[b, row_k]·x[b, col_k]``: ``dy (B, out)``, ``x (B, in)`` → ``(nnz,)``."""
    return _ops.sddmm(dy, x, topo.rowptr, topo.col)


def spmm_backward(
    dy: Tensor, x: Tensor, values: Tensor, topo: TopologyTensors, *, bias_grad: bool = False, fuse: bool | None = None
) -> tuple[Tensor, ...]:
    """``(spmm_t(dy, values), sddmm(dy, x))``: ``dy (B, out)``, ``x (B, in)`` → ``(dx (B, in),
    dvalues (nnz,))``, plus ``dbias = dy.sum(0)`` (computed while packing ``dy``) as a third output
    when ``bias_grad``. One pass over the weight (``fuse=True``) or the two kernels one after the
    other (``False``). By default the fused pass, unless its two L2-resident ``(in, W)`` tiles force
    so many narrower batch tiles that it would read the weight as often as the two kernels (a large
    ``in × B`` for the L2 cache; ``torch.ops.snack_cpu.fuses_backward`` says which): there the two
    kernels measured faster (``benchmarks/backward_fusion.py``)."""
    dx, dvalues, dbias = _ops.spmm_backward(dy, x, values, topo.rowptr, topo.col, bias_grad, fuse)
    return (dx, dvalues, dbias) if bias_grad else (dx, dvalues)
