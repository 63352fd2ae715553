"""Host side of the Triton backend: check → allocate → launch for each sparse op.

Shapes follow :mod:`snack.backends`: ``x (B, in)``, ``dy (B, out)``, ``values (nnz,)``; outputs
are new tensors in the input dtype. All arithmetic is float32 (see :mod:`.kernels`).

Which SpMM form runs (:func:`spmm_form`)
    The *pointer* (tiled) form runs one program per (output row, tile of ``BLOCK_B`` batch rows),
    reads the indices once per tile and writes each output once, without atomics. The *segment*
    (COO) form runs ``cdiv(nnz, BLOCK_NNZ)`` programs along the non-zeros times
    ``cdiv(B, ROWS_PER_PROGRAM)`` along the batch, with one atomic add per run of equal output
    index in a block: its parallelism does not depend on how the non-zeros spread over rows.
    Measured on an H200 (4096², 95% sparsity, ``benchmarks/gpu/kernel_bench.txt``), the pointer
    form was faster at every batch from 1 to 64 (B=1: 5.0 µs vs 7.7 µs of GPU time), because
    4096 rows already give 31 programs per SM. So the pointer form runs unless its grid would
    leave SMs idle — fewer than ``MIN_POINTER_PROGRAMS_PER_SM`` programs per SM, as for a
    10-wide classifier layer — where the segment form's parallelism along the non-zeros wins.
    The transposed SpMM makes the same choice over columns (``colptr`` + ``csc_perm``).

Layout
    From ``B >= TRANSPOSE_MIN_BATCH`` (4) the pointer form and the SDDMM read the dense operands
    transposed, ``(n, B)``, so the ``BLOCK_B`` values of one non-zero are one coalesced load; the
    copy costs ``B · n`` elements against the ``B · nnz`` gathered ones. ``BLOCK_B`` is ``B``
    rounded up to a power of two, at most ``MAX_BLOCK_B`` (64).

Configs
    On a GPU, ``triton.autotune`` picks among a few configs, so a first call per key costs
    seconds, not minutes: segment ``BLOCK_NNZ`` ∈ {128, 256, 512} × ``ROWS_PER_PROGRAM`` ∈ {1, 4}
    (key: batch, walk); pointer and SDDMM ``BLOCK_K`` ∈ {32, 64, 128} (key: ``BLOCK_B``, walk).
    Under the interpreter (``TRITON_INTERPRET=1``), or with ``SNACK_TRITON_AUTOTUNE=0``, the fixed
    :data:`FIXED_CONFIGS` run instead (``@triton.autotune`` cannot run in the interpreter).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
from torch import Tensor

from snack.backends.triton import kernels
from snack.topology import TopologyTensors

__all__ = ["AUTOTUNE", "FIXED_CONFIGS", "INTERPRETED", "sddmm", "spmm", "spmm_form", "spmm_t", "supports"]

# triton.jit returns an interpreter-backed function when TRITON_INTERPRET=1 was set at import.
INTERPRETED = not isinstance(kernels.sddmm_kernel, triton.runtime.JITFunction)
AUTOTUNE = not INTERPRETED and os.environ.get("SNACK_TRITON_AUTOTUNE", "1") != "0"

# Below this many pointer-form programs per SM the segment form runs (module docstring).
MIN_POINTER_PROGRAMS_PER_SM = 2
# SMs assumed off the GPU (the interpreter), so that it takes the choices an H200 would.
_DEFAULT_SM_COUNT = 132
TRANSPOSE_MIN_BATCH = 4
# Largest batch tile of the pointer form and the SDDMM (accumulator BLOCK_B × BLOCK_K in registers).
MAX_BLOCK_B = 64
# CUDA caps grid axis 1 at 65535; the segment kernel strides over the rest of the batch.
_MAX_GRID_1 = 65535
_SEGMENT_MAX_GRID_1 = _MAX_GRID_1  # its own name so tests can shrink it
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Used when not autotuning. Tests shrink them to cross block boundaries on small shapes.
FIXED_CONFIGS: dict[str, dict[str, int]] = {
    "segment_spmm": {"BLOCK_NNZ": 128, "ROWS_PER_PROGRAM": 1, "num_warps": 4},
    "pointer_spmm": {"BLOCK_K": 64, "num_warps": 4},
    "sddmm": {"BLOCK_K": 64, "num_warps": 4},
}


def supports(device: torch.device) -> bool:
    """CUDA devices always; CPU tensors only when the kernels were built for the interpreter."""
    device = torch.device(device)
    return device.type == "cuda" or (device.type == "cpu" and INTERPRETED)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


def spmm_form(batch: int, n_out: int, device: torch.device | str = "cuda") -> str:
    """``"segment"`` or ``"pointer"``: the SpMM form the heuristic picks for ``batch`` rows into
    ``n_out`` outputs on ``device`` (module docstring, *Which SpMM form runs*)."""
    programs = n_out * triton.cdiv(max(batch, 1), _block_b(max(batch, 1)))
    return "segment" if programs < MIN_POINTER_PROGRAMS_PER_SM * _sm_count(torch.device(device)) else "pointer"


# ---------------------------------------------------------------- autotuning (GPU only)


def _autotuned(kernel, configs, key, **options):
    if not AUTOTUNE:
        return None
    # Short benchmarks per config: tuning happens on the first call of every new key.
    bench = lambda fn, quantiles: triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)  # noqa: E731
    return triton.autotune(configs, key=key, do_bench=bench, **options)(kernel)


_SEGMENT_CONFIGS = [
    triton.Config({"BLOCK_NNZ": n, "ROWS_PER_PROGRAM": r}, num_warps=4) for n in (128, 256, 512) for r in (1, 4)
]
_TILE_CONFIGS = [triton.Config({"BLOCK_K": k}, num_warps=w) for k, w in ((32, 4), (64, 4), (128, 8))]
_TUNED = {
    # The segment kernel accumulates into its output: every trial must start from zeros. Its batch
    # is in the key: rows per program depend on it.
    "segment_spmm": _autotuned(
        kernels.segment_spmm_kernel, _SEGMENT_CONFIGS, ["HAS_PERM", "batch"], reset_to_zero=["y_ptr"]
    ),
    "pointer_spmm": _autotuned(kernels.pointer_spmm_kernel, _TILE_CONFIGS, ["HAS_PERM", "BLOCK_B"]),
    "sddmm": _autotuned(kernels.sddmm_kernel, _TILE_CONFIGS, ["BLOCK_B"]),
}


def _launch(name: str, grid, *args, **constexprs) -> None:
    """Run kernel ``name`` with the autotuned configs, else with ``FIXED_CONFIGS[name]``."""
    tuned = _TUNED[name]
    if tuned is not None:
        tuned[grid](*args, **constexprs)
    else:
        kernels.KERNELS[name][grid](*args, **constexprs, **FIXED_CONFIGS[name])


# ---------------------------------------------------------------- ops


def _check_dtype(op: str, *tensors: Tensor) -> None:
    for t in tensors:
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"snack triton backend: {op} supports float32, float16 and bfloat16, got {t.dtype}")


def _block_b(batch: int) -> int:
    return min(triton.next_power_of_2(batch), MAX_BLOCK_B)


def _batch_contiguous(a: Tensor) -> tuple[Tensor, int, int]:
    """``a (B, n)`` as (storage, stride over B, stride over n), transposed to ``(n, B)`` storage
    when the batch is large enough to pay for the copy (module docstring, *Layout*)."""
    if a.shape[0] >= TRANSPOSE_MIN_BATCH:
        return a.t().contiguous(), 1, a.shape[0]
    return a, a.shape[1], 1


def _segment_spmm(a: Tensor, values: Tensor, seg_ptr, seg_index, gather_index, perm, n_out: int) -> Tensor:
    batch, nnz = a.shape[0], values.numel()
    # float32 scratch: atomics accumulate in fp32 (half-precision atomics would round per add)
    y = torch.zeros(batch, n_out, device=a.device, dtype=torch.float32)
    if nnz > 0 and batch > 0:
        grid = lambda meta: (  # noqa: E731
            triton.cdiv(nnz, meta["BLOCK_NNZ"]),
            min(triton.cdiv(batch, meta["ROWS_PER_PROGRAM"]), _SEGMENT_MAX_GRID_1),
        )
        _launch(
            "segment_spmm", grid,
            a, values, seg_ptr, seg_index, gather_index, perm, y, nnz, batch, n_out, a.shape[1], 1,
            HAS_PERM=perm is not None,
        )  # fmt: skip
    return y.to(a.dtype)


def _pointer_spmm(a: Tensor, values: Tensor, seg_ptr, gather_index, perm, n_out: int) -> Tensor:
    batch = a.shape[0]
    y = torch.empty(batch, n_out, device=a.device, dtype=a.dtype)
    if batch > 0 and n_out > 0:
        block_b = _block_b(batch)
        a_storage, stride_ab, stride_ai = _batch_contiguous(a)
        grid = (n_out, triton.cdiv(batch, block_b))
        if grid[1] > _MAX_GRID_1:
            raise ValueError(f"snack triton backend: batch {batch} exceeds {_MAX_GRID_1 * block_b} rows per call")
        _launch(
            "pointer_spmm", grid,
            a_storage, values, seg_ptr, gather_index, perm, y, batch, stride_ab, stride_ai, y.stride(0), y.stride(1),
            HAS_PERM=perm is not None, WHILE_LOOP=INTERPRETED, BLOCK_B=block_b,
        )  # fmt: skip
    return y


def spmm(
    x: Tensor, values: Tensor, topo: TopologyTensors, bias: Tensor | None = None, *, form: str | None = None
) -> Tensor:
    """``Y = X·Wᵀ (+ bias)``: ``x (B, in)`` → ``(B, out)``.

    Args:
        bias: ``(out,)`` added to every row (one extra pass; not fused into the kernels yet).
        form: ``"segment"`` or ``"pointer"`` to override :func:`spmm_form` (benchmarks, tests).
    """
    _check_dtype("spmm", x, values)
    n_out = topo.rowptr.numel() - 1
    form = form or spmm_form(x.shape[0], n_out, x.device)
    if form == "segment":
        y = _segment_spmm(x, values, topo.rowptr, topo.row, topo.col, None, n_out)
    elif form == "pointer":
        y = _pointer_spmm(x, values, topo.rowptr, topo.col, None, n_out)
    else:
        raise ValueError(f"form must be 'segment' or 'pointer', got {form!r}")
    return y if bias is None else y.add_(bias)


def spmm_t(dy: Tensor, values: Tensor, topo: TopologyTensors, *, form: str | None = None) -> Tensor:
    """``dX = dY·W``: ``dy (B, out)`` → ``(B, in)``, walking ``W`` by column through ``csc_perm``.

    Args:
        form: as for :func:`spmm`.
    """
    _check_dtype("spmm_t", dy, values)
    n_in = topo.colptr.numel() - 1
    form = form or spmm_form(dy.shape[0], n_in, dy.device)
    if form == "segment":
        return _segment_spmm(dy, values, topo.colptr, topo.col, topo.row, topo.csc_perm, n_in)
    if form == "pointer":
        return _pointer_spmm(dy, values, topo.colptr, topo.row, topo.csc_perm, n_in)
    raise ValueError(f"form must be 'segment' or 'pointer', got {form!r}")


def sddmm(dy: Tensor, x: Tensor, topo: TopologyTensors) -> Tensor:
    """``out[k] = Σ_b dy[b, row_k] · x[b, col_k]``: ``dy (B, out)``, ``x (B, in)`` → ``(nnz,)``."""
    _check_dtype("sddmm", dy, x)
    batch, nnz = dy.shape[0], topo.row.numel()
    if batch == 0 or nnz == 0:
        return dy.new_zeros(nnz)
    out = torch.empty(nnz, device=dy.device, dtype=dy.dtype)
    dy_storage, stride_db, stride_dr = _batch_contiguous(dy)
    x_storage, stride_xb, stride_xc = _batch_contiguous(x)
    grid = lambda meta: (triton.cdiv(nnz, meta["BLOCK_K"]),)  # noqa: E731
    _launch(
        "sddmm", grid,
        dy_storage, x_storage, topo.row, topo.col, out, nnz, batch, stride_db, stride_dr, stride_xb, stride_xc,
        BLOCK_B=_block_b(batch),
    )  # fmt: skip
    return out
