"""The native CPU kernels' ops: ``kernels.cpp``, built by :mod:`snack.backends.cpu` when
this module is imported (at once when cached), wrapped as the backend protocol of
:mod:`snack.backends` asks.

Shapes follow :mod:`snack.backends`: ``spmm`` ``x (B, in)`` → ``(B, out)``, ``spmm_t``
``dy (B, out)`` → ``(B, in)``, ``sddmm`` → ``(nnz,)``.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import Tensor

from snack.backends.cpu import build
from snack.backends.derived import derived
from snack.topology import TopologyTensors

__all__ = [
    "GATHER_MODES",
    "forward_column_bytes",
    "gather_mode",
    "narrow_columns",
    "sddmm",
    "set_gather_mode",
    "spmm",
    "spmm_backward",
    "spmm_t",
    "supports",
]

# raises BuildError when the kernels cannot be built: snack.backends then reports the backend
# unavailable and runs the reference backend
build()
_ops = torch.ops.snack_cpu


def supports(device: torch.device) -> bool:
    return device.type == "cpu"


# How the batch-1 kernels of an AVX-512 build reach the entries of x (and of dX) that a row's
# columns pick: with the gather and scatter instructions, or with scalar loads and stores.
GATHER_MODES = ("vector", "scalar")


def gather_mode() -> str | None:
    """The batch-1 kernels' gather mode, one of :data:`GATHER_MODES`, or ``None`` for a build
    without AVX-512 (its batch-1 kernels have one way).

    Both modes give bit-identical results; only their speed differs, by CPU: the instructions
    were faster on an Intel Xeon, scalar loads and stores on AMD's Zen 4 (``kernels.cpp``,
    ``g_scalar_gathers``, has the figures). The default is ``"scalar"`` on AMD CPUs and
    ``"vector"`` elsewhere; the ``SNACK_CPU_GATHER`` environment variable, read when this module is imported,
    or :func:`set_gather_mode` overrides it.
    """
    mode = _ops.gather_mode()
    return None if mode == "none" else mode


def set_gather_mode(mode: str) -> None:
    """Set the batch-1 kernels' gather mode for this process (see :func:`gather_mode`).

    Raises:
        ValueError: ``mode`` is not one of :data:`GATHER_MODES`.
        RuntimeError: the build has no AVX-512 (:func:`gather_mode` is ``None``).
    """
    if mode not in GATHER_MODES:
        raise ValueError(f"gather mode must be one of {GATHER_MODES}, got {mode!r}")
    if gather_mode() is None:
        raise RuntimeError(
            f"cannot set gather mode {mode!r}: the native kernels were built for "
            f"{torch.backends.cpu.get_cpu_capability()}, without AVX-512 gathers to choose between"
        )
    _ops.set_gather_mode(mode)


def _gather_mode_from_environment() -> None:
    """Apply ``SNACK_CPU_GATHER`` if set: a bad value raises (so the backend reports itself
    unavailable with this message); on a build without AVX-512 it warns and changes nothing."""
    mode = os.environ.get("SNACK_CPU_GATHER")
    if not mode:
        return
    if mode not in GATHER_MODES:
        raise ValueError(f"SNACK_CPU_GATHER must be one of {GATHER_MODES} or unset, got {mode!r}")
    if gather_mode() is None:
        warnings.warn(
            f"SNACK_CPU_GATHER={mode} has no effect: the native kernels were built without AVX-512",
            RuntimeWarning,
            stacklevel=2,
        )
        return
    set_gather_mode(mode)


_gather_mode_from_environment()


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
