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
    The transposed SpMM makes the same choice over columns. Under
    ``torch.use_deterministic_algorithms(True)`` the pointer form always runs: the segment
    form's atomic adds land in any order (asked for explicitly, it raises, as PyTorch's own
    non-deterministic ops do).

Which SDDMM form runs
    The *segment* SDDMM runs programs along blocks of non-zeros, each loading ``dy[:, row_k]``
    and ``x[:, col_k]`` per non-zero. The *pointer* SDDMM runs one program per row: it reads
    ``rowptr`` instead of ``row`` (4 bytes less per non-zero) and the row's ``dy`` once (up to
    batch 64), not once per non-zero. On the H200 (4096², 90%, ``benchmarks/gpu/kernel_bench.txt``)
    the pointer form was faster at every batch measured (B=1: 5.5 µs vs 6.8 µs of GPU time;
    B=32: 45.1 vs 51.7; bfloat16 alike), so it runs unless its grid would leave SMs idle (the
    SpMM rule, over rows), where the segment form does. In a training step (``spmm_backward``)
    the SDDMM's launch also writes the bias gradient ``Σ_b dy[b, r]``: each pointer program sums
    its row's ``dy``, the segment form adds programs for it.

The transposed SpMM reads column-ordered copies
    ``dX = dY·W`` walks ``W`` by column. The kernels read the row (and, for the segment form, the
    column) indices in column order from copies cached per topology (``row[csc_perm]``, 4 bytes
    per non-zero, :func:`_rows_in_column_order`). The first H200 run read them through ``csc_perm``
    inside the kernel: a chain of three dependent loads per non-zero (``csc_perm`` → ``row`` →
    ``dy``), 36.7 µs at batch 1 (90%, 4096²) against 12.5 µs for the forward.

    The values change every optimizer step, so they cannot be cached in column order: the
    kernels load ``values[csc_perm[k]]`` themselves (``INDIRECT_VALUES``), beside the ``dy``
    load. Gathering ``values[csc_perm]`` in a pass of its own first was slower on the H200 at
    every batch (B=1: 19.0 µs against 14.6 µs for the whole transposed SpMM, 90%, 4096²; B=32:
    50.5 against 40.0) and cost one more launch of host time.

The row walk (``spmm_backward(walk="row")``)
    The transposed SpMM's random value reads cost most of a training step at small batch (H200,
    B=1, 90%, 4096²: 14.7 of 26.8 µs, against 5.5 µs for the forward, which reads the values in
    order). The row walk reads the values in order instead, in the SDDMM's own pass: each row's
    program computes its ``dvalues`` and bias gradient as the pointer SDDMM does, and adds
    ``dy[b, r] · values[k]`` into ``dx[b, col_k]`` by float32 atomic adds (``B`` per non-zero,
    into a ``B × in`` accumulator that L2 holds), after a memset of ``dx``. Whether atomics beat
    the random reads has not been measured on a GPU yet (``kernel_bench`` times both walks);
    layers run the column walk until it has.

The patch forms (``form="patches"``)
    Another answer to the same random reads, and to the gathers of the forward and the SDDMM at
    larger batch, not measured on a GPU yet (``kernel_bench`` times them against the pointer
    forms). One program per *patch* of ``W`` — a block of ``PATCH_SEGMENTS`` (64) segments (rows
    of ``W`` for SpMM and SDDMM, columns for the transposed SpMM) × a band of ``PATCH_BAND`` (256)
    inputs — walks the patch's segments side by side, in segment order as the pointer form does.
    The SpMMs add their partial sums into a float32 output by one atomic add per segment, band
    and batch row (``B · n_out · bands`` in all: 65 536 at B=1 for 4096²). The loads stay inside
    the band, where L1 serves them again:

    * transposed SpMM, small batch: a row's non-zeros inside a block of 64 columns are neighbours
      in ``values`` (6.4 of them at 90%), so the values read through ``csc_perm`` share 32-byte
      sectors: by count about 2× the values' bytes of L2 traffic instead of 8× (one sector per
      4-byte value);
    * SpMM, batch 8-64: each gathered row of ``Xᵀ`` (``BLOCK_B`` values) serves every row of
      the patch that has a non-zero in that column (about 3 of 64 at 95%), where the pointer form
      fetches it from L2 once per non-zero (107 MB at B=32, 95%, 4096²);
    * SDDMM (``sddmm(form="patches")``), larger batch: the same for its gathers of ``Xᵀ``; each
      ``dvalues`` is written once (no atomics, so it also runs in deterministic mode), and the
      band-0 programs sum the bias gradient.

    A cached ``(bands + 1, n_out)`` pointer array (:func:`_band_pointers`) says where each
    segment's non-zeros of each band start. Batch tiles hold at most ``PATCH_MAX_BLOCK_B`` (32)
    rows: in the SpMMs each is a program of its own that walks its patch again; the SDDMM's
    programs loop over them. Layers run the pointer forms until a GPU has measured these.

Layout
    From ``B >= TRANSPOSE_MIN_BATCH`` (4) the pointer form and the SDDMM read the dense operands
    transposed, ``(n, B)``, so the ``BLOCK_B`` values of one non-zero are one coalesced load; the
    copy costs ``B · n`` elements against the ``B · nnz`` gathered ones. ``BLOCK_B`` is ``B``
    rounded up to a power of two, at most ``MAX_BLOCK_B`` (64).

Configs and launches
    Kernel configs (autotuned on a GPU, fixed otherwise) and the launch path live in
    :mod:`.tuning`.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor

from snack.backends.derived import derived
from snack.backends.triton import tuning
from snack.topology import TopologyTensors, column_order

__all__ = [
    "sddmm",
    "spmm",
    "spmm_backward",
    "spmm_form",
    "spmm_t",
    "supports",
    "FORMS",
    "PATCH_BAND",
    "PATCH_MAX_BLOCK_B",
    "PATCH_SEGMENTS",
    "WALKS",
]

# Below this many pointer-form programs per SM the segment form runs (module docstring).
MIN_POINTER_PROGRAMS_PER_SM = 2
# SMs assumed off the GPU (the interpreter), so that it takes the choices an H200 would.
_DEFAULT_SM_COUNT = 132
TRANSPOSE_MIN_BATCH = 4
# Largest batch tile of the pointer form and the SDDMM (accumulator BLOCK_B × BLOCK_K in registers).
MAX_BLOCK_B = 64
# The patches of form="patches": blocks of segments × bands of inputs, batch tiles of at most
# PATCH_MAX_BLOCK_B rows (module docstring).
PATCH_SEGMENTS = 64
PATCH_BAND = 256
PATCH_MAX_BLOCK_B = 32
# How spmm_backward walks the weight (module docstring, *The row walk*).
WALKS = ("column", "row")
# The forms spmm and spmm_t take (module docstring).
FORMS = ("segment", "pointer", "patches")
# CUDA caps grid axes 1 and 2 at 65535 programs.
_MAX_GRID_1 = 65535
# Programs along the batch: the segment SpMM and the patch forms stride over the rest of it, the
# pointer SpMM launches once per that many batch tiles; a name of its own so that tests can shrink it.
_BATCH_GRID_LIMIT = _MAX_GRID_1
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def supports(device: torch.device) -> bool:
    """CUDA devices always; CPU tensors only when the kernels were built for the interpreter."""
    device = torch.device(device)
    return device.type == "cuda" or (device.type == "cpu" and tuning.INTERPRETED)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


def spmm_form(batch: int, n_out: int, device: torch.device | str = "cuda") -> str:
    """``"segment"`` or ``"pointer"``: the SpMM form the heuristic picks for ``batch`` rows into
    ``n_out`` outputs on ``device`` (module docstring, *Which SpMM form runs*); always
    ``"pointer"`` under ``torch.use_deterministic_algorithms(True)`` (the segment form's atomic
    adds land in any order)."""
    if torch.are_deterministic_algorithms_enabled():
        return "pointer"
    programs = n_out * _cdiv(max(batch, 1), _block_b(max(batch, 1)))
    return "segment" if programs < MIN_POINTER_PROGRAMS_PER_SM * _sm_count(torch.device(device)) else "pointer"


# ---------------------------------------------------------------- ops


def _on_the_tensors_device(op):
    """``op`` run with its first argument's CUDA device current. Triton launches (and autotunes,
    and allocates) on the *current* device, not on the tensors' as ATen ops do: without this, a
    layer on ``cuda:1`` called while ``cuda:0`` is current would launch its kernels on the wrong
    GPU."""

    @functools.wraps(op)
    def on_device(a: Tensor, *args, **kwargs):
        device = a.device
        if device.type == "cuda" and device.index != torch.cuda.current_device():
            with torch.cuda.device(device):
                return op(a, *args, **kwargs)
        return op(a, *args, **kwargs)

    return on_device


def _alert_not_deterministic(caller: str) -> None:
    """As PyTorch's own non-deterministic ops do: raise under
    ``torch.use_deterministic_algorithms(True)``, warn with ``warn_only=True``."""
    if not torch.are_deterministic_algorithms_enabled():
        return
    message = (
        f"{caller} does not have a deterministic implementation (its atomic adds land in any order), but you set "
        f"'torch.use_deterministic_algorithms(True)'"
    )
    if torch.is_deterministic_algorithms_warn_only_enabled():
        warnings.warn(message, UserWarning, stacklevel=3)
    else:
        raise RuntimeError(message)


def _check_dtype(op: str, *tensors: Tensor) -> None:
    for t in tensors:
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"snack triton backend: {op} supports float32, float16 and bfloat16, got {t.dtype}")


def _cdiv(a: int, b: int) -> int:
    # plain Python: triton.cdiv and triton.next_power_of_2 are ConstexprFunctions, ~2 µs per host call
    return -(-a // b)


def _block_b(batch: int) -> int:
    return min(1 << (batch - 1).bit_length(), MAX_BLOCK_B)


def _batch_contiguous(a: Tensor) -> tuple[Tensor, int, int]:
    """``a (B, n)`` as (storage, stride over B, stride over n), transposed to ``(n, B)`` storage
    when the batch is large enough to pay for the copy (module docstring, *Layout*)."""
    if a.shape[0] >= TRANSPOSE_MIN_BATCH:
        return a.t().contiguous(), 1, a.shape[0]
    return a, a.shape[1], 1


def _batch_rows(layout: tuple[Tensor, int, int], batch: int, start: int, rows: int) -> Tensor:
    """Rows ``start : start + rows`` of the batch of a :func:`_batch_contiguous` layout, as a view
    (the batch is dim 0 of an untransposed storage, dim 1 of a transposed one); the storage itself
    when that is all of it (a view is an op, and every op costs host time)."""
    storage, stride_ab, _ = layout
    if start == 0 and rows == batch:
        return storage
    batch_dim = 0 if storage.shape[0] == batch and storage.stride(0) == stride_ab else 1
    return storage.narrow(batch_dim, start, rows)


def _csc_perm(topo: TopologyTensors) -> Tensor:
    """``topo.csc_perm``, or where a CPU topology carries none (under the interpreter: see
    :mod:`snack.topology`) the one derived from ``col``, cached per ``col``."""
    if topo.csc_perm.numel() == topo.col.numel():
        return topo.csc_perm
    return derived("triton_csc_perm", (topo.col,), lambda: column_order(topo.col, topo.colptr.numel() - 1))


def _rows_in_column_order(topo: TopologyTensors) -> Tensor:
    """``row[csc_perm]`` ``(nnz,)`` int32, cached per topology (module docstring)."""
    csc_perm = _csc_perm(topo)
    return derived("triton_rows_by_column", (topo.row, csc_perm), lambda: topo.row.index_select(0, csc_perm))


def _cols_in_column_order(topo: TopologyTensors) -> Tensor:
    """``col[csc_perm]`` ``(nnz,)`` int32 (sorted), cached per topology: only the segment form
    of the transposed SpMM reads it."""
    csc_perm = _csc_perm(topo)
    return derived("triton_cols_by_column", (topo.col, csc_perm), lambda: topo.col.index_select(0, csc_perm))


def _band_pointers(
    name: str, sources: tuple[Tensor, ...], segment: Tensor, gather: Tensor, n_out: int, n_in: int, band: int
) -> Tensor:  # fmt: skip
    """``(bands + 1, n_out)`` int32, cached under ``name`` for ``sources`` (the topology tensors
    ``segment`` and ``gather`` come from) and the band width: ``[t, s]`` is the position where
    segment ``s``'s non-zeros with ``gather >= t · band`` begin (``bands = cdiv(n_in, band)``; row
    ``bands`` is where the segment ends). ``segment``, ``gather``: ``(nnz,)`` int32 in segment
    order, which sorts ``gather`` within a segment."""

    def build() -> Tensor:
        keys = segment.long() * n_in + gather  # sorted: (segment, gather) in segment order
        band_starts = torch.arange(_cdiv(n_in, band) + 1, device=keys.device) * band
        queries = torch.arange(n_out, device=keys.device) * n_in + band_starts.clamp_(max=n_in)[:, None]
        return torch.searchsorted(keys, queries).to(torch.int32)

    return derived(f"{name}_{band}", sources, build)


def _band_width(band: int | None, n_in: int) -> int:
    """``band`` (default ``PATCH_BAND``), wider where the bands would outnumber a grid axis."""
    return max(band or PATCH_BAND, _cdiv(n_in, _MAX_GRID_1))


def _row_band_pointers(topo: TopologyTensors, band: int | None) -> Tensor:
    """:func:`_band_pointers` of the rows over bands of columns (the patch SpMM and SDDMM)."""
    n_rows, n_cols = topo.rowptr.numel() - 1, topo.colptr.numel() - 1
    # keyed on the pointers too: a topology of another shape may share row and col
    sources = (topo.row, topo.col, topo.rowptr, topo.colptr)
    return _band_pointers("triton_row_bands", sources, topo.row, topo.col, n_rows, n_cols, _band_width(band, n_cols))


def _column_band_pointers(topo: TopologyTensors, band: int | None) -> Tensor:
    """:func:`_band_pointers` of the columns (in column order) over bands of rows (the patch
    transposed SpMM)."""
    n_rows, n_cols = topo.rowptr.numel() - 1, topo.colptr.numel() - 1
    sources, columns = (topo.row, topo.col, _csc_perm(topo), topo.rowptr, topo.colptr), _cols_in_column_order(topo)
    rows, band = _rows_in_column_order(topo), _band_width(band, n_rows)
    return _band_pointers("triton_column_bands", sources, columns, rows, n_cols, n_rows, band)


def _segment_spmm(
    a: Tensor, values: Tensor, seg_ptr: Tensor, seg_index: Tensor, gather_index: Tensor, n_out: int,
    value_index: Tensor | None = None, bias: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """``y (B, n_out)`` from ``a (B, n_in)``; ``values[value_index]`` when ``value_index`` is given;
    ``bias (n_out,)`` added before the float32 sums are rounded to ``a``'s dtype."""
    _alert_not_deterministic("snack's Triton segment SpMM (form='segment')")
    batch, nnz = a.shape[0], gather_index.numel()
    # float32 scratch: atomics accumulate in fp32 (half-precision atomics would round per add)
    y = torch.zeros(batch, n_out, device=a.device, dtype=torch.float32)
    if nnz > 0 and batch > 0:
        grid = lambda meta: (  # noqa: E731
            _cdiv(nnz, meta["BLOCK_NNZ"]),
            min(_cdiv(batch, meta["ROWS_PER_PROGRAM"]), _BATCH_GRID_LIMIT),
        )
        tuning.launch(
            "segment_spmm", grid,
            a, values, gather_index if value_index is None else value_index, seg_ptr, seg_index, gather_index, y,
            nnz, batch, n_out, a.shape[1], 1, INDIRECT_VALUES=value_index is not None,
        )  # fmt: skip
    return _rounded(y, bias, a.dtype)


def _rounded(y: Tensor, bias: Tensor | None, dtype: torch.dtype) -> Tensor:
    """The float32 sums ``y`` plus ``bias`` in ``dtype``, rounded once (as the pointer form, the
    reference and ``nn.Linear`` do: a half-precision output rounded before the bias is added can
    lose the result, e.g. 257 - 256 in bfloat16)."""
    if bias is not None:
        y.add_(bias)
    return y.to(dtype)


def _pointer_spmm(
    a_layout: tuple[Tensor, int, int], batch: int, values: Tensor, seg_ptr: Tensor, gather_index: Tensor,
    n_out: int, bias: Tensor | None = None, value_index: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """``y (B, n_out)`` from ``a`` given as :func:`_batch_contiguous` lays it out;
    ``values[value_index]`` when ``value_index`` is given."""
    a_storage, stride_ab, stride_ai = a_layout
    y = torch.empty(batch, n_out, device=a_storage.device, dtype=a_storage.dtype)
    if batch > 0 and n_out > 0:
        block_b = _block_b(batch)
        # one program per batch tile along grid axis 1, which CUDA caps: past that many tiles
        # (4,194,240 rows at 64 per tile) the batch runs in chunks of rows
        chunk = _BATCH_GRID_LIMIT * block_b
        for start in range(0, batch, chunk):
            rows = min(chunk, batch - start)
            tuning.launch(
                "pointer_spmm", (n_out, _cdiv(rows, block_b)),
                _batch_rows(a_layout, batch, start, rows), values, gather_index if value_index is None else value_index,
                seg_ptr, gather_index, y if bias is None else bias, y[start:] if start else y, rows,
                stride_ab, stride_ai, y.stride(0), y.stride(1), HAS_BIAS=bias is not None,
                INDIRECT_VALUES=value_index is not None,
                WHILE_LOOP=tuning.INTERPRETED, BLOCK_B=block_b,
            )  # fmt: skip
    elif bias is not None:
        y.copy_(bias.expand_as(y))
    return y


def _check_form(form: str) -> None:
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")


@_on_the_tensors_device
def spmm(
    x: Tensor, values: Tensor, topo: TopologyTensors, bias: Tensor | None = None, *, form: str | None = None
) -> Tensor:
    """``Y = X·Wᵀ (+ bias)``: ``x (B, in)`` → ``(B, out)``.

    Args:
        bias: ``(out,)`` added to every row (inside the pointer form's kernel).
        form: ``"segment"`` or ``"pointer"`` to override :func:`spmm_form`, or ``"patches"``
            (module docstring, *The patch forms*): benchmarks, tests.
    """
    _check_dtype("spmm", x, values)
    n_out = topo.rowptr.numel() - 1
    form = form or spmm_form(x.shape[0], n_out, x.device)
    _check_form(form)
    if form == "pointer":
        return _pointer_spmm(_batch_contiguous(x), x.shape[0], values, topo.rowptr, topo.col, n_out, bias)
    if form == "patches":
        return _patch_spmm(_batch_contiguous(x), x.shape[0], values, topo, transposed=False, bias=bias)
    return _segment_spmm(x, values, topo.rowptr, topo.row, topo.col, n_out, bias=bias)


def _spmm_t(
    dy_layout: tuple[Tensor, int, int], dy: Tensor, values: Tensor, topo: TopologyTensors, form: str | None
) -> Tensor:
    """:func:`spmm_t` with ``dy`` also given as :func:`_batch_contiguous` laid it out (what the
    pointer form reads; the segment form reads ``dy`` itself)."""
    n_in = topo.colptr.numel() - 1
    form = form or spmm_form(dy.shape[0], n_in, dy.device)
    _check_form(form)
    rows = _rows_in_column_order(topo)
    if form == "pointer":
        return _pointer_spmm(dy_layout, dy.shape[0], values, topo.colptr, rows, n_in, value_index=_csc_perm(topo))
    if form == "patches":
        return _patch_spmm(dy_layout, dy.shape[0], values, topo, transposed=True)
    cols = _cols_in_column_order(topo)
    return _segment_spmm(dy, values, topo.colptr, cols, rows, n_in, value_index=_csc_perm(topo))


@_on_the_tensors_device
def spmm_t(dy: Tensor, values: Tensor, topo: TopologyTensors, *, form: str | None = None) -> Tensor:
    """``dX = dY·W``: ``dy (B, out)`` → ``(B, in)``, walking ``W`` by column (module docstring).

    Args:
        form: as for :func:`spmm`.
    """
    _check_dtype("spmm_t", dy, values)
    return _spmm_t(_batch_contiguous(dy), dy, values, topo, form)


def _patch_spmm(
    a_layout: tuple[Tensor, int, int], batch: int, values: Tensor, topo: TopologyTensors, transposed: bool,
    band: int | None = None, bias: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """``Y = X·Wᵀ (+ bias)`` (``transposed=False``) or ``dX = dY·W`` by patches of ``PATCH_SEGMENTS``
    segments × ``band`` inputs (default ``PATCH_BAND``), from ``a`` as :func:`_batch_contiguous`
    lays it out: ``(B, n_out)`` in its dtype (module docstring, *The patch forms*)."""
    op = "spmm_t" if transposed else "spmm"
    _alert_not_deterministic(f"snack's Triton {op}(form='patches')")
    a_storage, stride_ab, stride_ai = a_layout
    n_rows, n_cols = topo.rowptr.numel() - 1, topo.colptr.numel() - 1
    n_out, n_in = (n_cols, n_rows) if transposed else (n_rows, n_cols)
    # float32 scratch: atomics accumulate in fp32 (half-precision atomics would round per add)
    y = torch.zeros(batch, n_out, device=a_storage.device, dtype=torch.float32)
    if batch == 0 or topo.col.numel() == 0:
        return _rounded(y, bias, a_storage.dtype)
    if transposed:  # segments are columns, in column order
        gather, value_index = _rows_in_column_order(topo), _csc_perm(topo)
        band_pointers = _column_band_pointers(topo, band)
    else:
        gather, value_index = topo.col, None
        band_pointers = _row_band_pointers(topo, band)
    block_b = min(_block_b(batch), PATCH_MAX_BLOCK_B)
    grid = (_cdiv(n_out, PATCH_SEGMENTS), band_pointers.shape[0] - 1, min(_cdiv(batch, block_b), _BATCH_GRID_LIMIT))
    tuning.launch(
        "patch_spmm", grid,
        a_storage, values, gather if value_index is None else value_index, band_pointers, gather, y, batch, n_out,
        stride_ab, stride_ai, INDIRECT_VALUES=value_index is not None, WHILE_LOOP=tuning.INTERPRETED,
        BLOCK_S=PATCH_SEGMENTS, BLOCK_B=block_b,
    )  # fmt: skip
    return _rounded(y, bias, a_storage.dtype)


def _sddmm(
    dy_layout: tuple[Tensor, int, int], x_layout: tuple[Tensor, int, int], batch: int, topo: TopologyTensors,
    bias_grad: bool = False, form: str | None = None, band: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    """``dvalues (nnz,)``, and ``(dvalues, dbias (n_out,))`` when ``bias_grad`` (from the same
    launch), from ``dy`` and ``x`` as :func:`_batch_contiguous` lays them out; ``form`` as
    :func:`sddmm` takes it; ``band``: the patch form's band width (default ``PATCH_BAND``)."""
    nnz, n_out = topo.row.numel(), topo.rowptr.numel() - 1
    if form is not None:
        _check_form(form)
    (dy_storage, *dy_strides), (x_storage, *x_strides) = dy_layout, x_layout
    if batch == 0 or nnz + bias_grad * n_out == 0:
        out = dy_storage.new_zeros(nnz)
        return (out, dy_storage.new_zeros(n_out)) if bias_grad else out
    block_b = _block_b(batch)
    # the pointer SDDMM runs one program per row whatever the batch: the rule counts rows only
    form = form or spmm_form(1, n_out, dy_storage.device)
    out = torch.empty(nnz, device=dy_storage.device, dtype=dy_storage.dtype)
    dbias = torch.empty(n_out, device=dy_storage.device, dtype=dy_storage.dtype) if bias_grad else None
    dbias_arg = out if dbias is None else dbias  # a placeholder pointer when unused
    if form == "patches":
        band_pointers = _row_band_pointers(topo, band)
        block_b = min(block_b, PATCH_MAX_BLOCK_B)
        tuning.launch(
            "patch_sddmm", (_cdiv(n_out, PATCH_SEGMENTS), band_pointers.shape[0] - 1),
            dy_storage, x_storage, band_pointers, topo.col, out, dbias_arg, batch, n_out, *dy_strides, *x_strides,
            BIAS_GRAD=bias_grad, SINGLE_TILE=batch <= block_b, WHILE_LOOP=tuning.INTERPRETED, BLOCK_S=PATCH_SEGMENTS,
            BLOCK_B=block_b,
        )  # fmt: skip
    elif form == "pointer":
        tuning.launch(
            "pointer_sddmm", (n_out,),
            dy_storage, x_storage, topo.rowptr, topo.col, out, dbias_arg, batch, *dy_strides, *x_strides,
            BIAS_GRAD=bias_grad, SINGLE_TILE=batch <= block_b, WHILE_LOOP=tuning.INTERPRETED, BLOCK_B=block_b,
        )  # fmt: skip
    else:  # blocks of non-zeros, then (bias_grad) blocks of outputs
        grid = lambda meta: (_cdiv(nnz, meta["BLOCK_K"]) + bias_grad * _cdiv(n_out, meta["BLOCK_K"]),)  # noqa: E731
        tuning.launch(
            "segment_sddmm", grid,
            dy_storage, x_storage, topo.row, topo.col, out, dbias_arg, nnz, batch, n_out, *dy_strides, *x_strides,
            BIAS_GRAD=bias_grad, BLOCK_B=block_b,
        )  # fmt: skip
    return out if dbias is None else (out, dbias)


@_on_the_tensors_device
def sddmm(dy: Tensor, x: Tensor, topo: TopologyTensors, *, form: str | None = None) -> Tensor:
    """``out[k] = Σ_b dy[b, row_k] · x[b, col_k]``: ``dy (B, out)``, ``x (B, in)`` → ``(nnz,)``.

    Args:
        form: ``"segment"`` (programs along blocks of non-zeros) or ``"pointer"`` (one program per
            row) to override the rule of the module docstring, or ``"patches"`` (*The patch
            forms*): benchmarks, tests.
    """
    _check_dtype("sddmm", dy, x)
    return _sddmm(_batch_contiguous(dy), _batch_contiguous(x), dy.shape[0], topo, form=form)


@_on_the_tensors_device
def spmm_backward(
    dy: Tensor, x: Tensor, values: Tensor, topo: TopologyTensors, *, bias_grad: bool = False, walk: str = "column"
) -> tuple[Tensor, ...]:
    """``(spmm_t(dy, values), sddmm(dy, x))``, plus ``dy.sum(0)`` third when ``bias_grad``:
    ``dy (B, out)``, ``x (B, in)`` → ``(dx (B, in), dvalues (nnz,)[, dbias (out,)])``.

    Args:
        walk: ``"column"`` (what layers run): two launches, as :func:`spmm_t` and :func:`sddmm`,
            but ``dy`` is laid out (transposed) once for both, and the bias gradient comes from
            the SDDMM's launch. ``"row"``: one pass by row for a batch of at most
            ``MAX_BLOCK_B``, ``dx`` by atomic adds (module docstring, *The row walk*);
            not bitwise reproducible, so it raises under
            ``torch.use_deterministic_algorithms(True)``.
    """
    _check_dtype("spmm_backward", dy, x, values)
    if walk not in WALKS:
        raise ValueError(f"walk must be one of {WALKS}, got {walk!r}")
    if walk == "row" and dy.shape[0] > MAX_BLOCK_B:
        raise ValueError(f"snack triton backend: walk='row' takes a batch of at most {MAX_BLOCK_B}, got {dy.shape[0]}")
    dy_layout = _batch_contiguous(dy)
    if walk == "row":
        grads = _rowwise_backward(dy_layout, _batch_contiguous(x), dy, values, topo, x.shape[1], bias_grad)
        return grads if bias_grad else grads[:2]
    dx = _spmm_t(dy_layout, dy, values, topo, None)
    weight_grads = _sddmm(dy_layout, _batch_contiguous(x), dy.shape[0], topo, bias_grad)
    return (dx, *weight_grads) if bias_grad else (dx, weight_grads)


def _rowwise_backward(
    dy_layout: tuple[Tensor, int, int], x_layout: tuple[Tensor, int, int], dy: Tensor, values: Tensor,
    topo: TopologyTensors, n_in: int, bias_grad: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``(dx (B, n_in), dvalues (nnz,), dbias (n_out,))`` from one launch by row, for a batch of at
    most ``MAX_BLOCK_B`` (``dbias`` computed only when ``bias_grad``, else uninitialised), after
    zeroing ``dx``'s float32 accumulator."""
    batch, (dy_storage, *dy_strides), (x_storage, *x_strides) = dy.shape[0], dy_layout, x_layout
    _alert_not_deterministic("snack's Triton spmm_backward(walk='row')")
    nnz, n_out = topo.col.numel(), topo.rowptr.numel() - 1
    # float32 accumulator: half-precision atomics would round on every add
    dx = torch.zeros(batch, n_in, device=dy.device, dtype=torch.float32)
    dvalues = torch.empty(nnz, device=dy.device, dtype=dy.dtype)
    dbias = torch.empty(n_out, device=dy.device, dtype=dy.dtype)
    if batch == 0:
        return dx.to(dy.dtype), dvalues.zero_(), dbias.zero_()
    if n_out > 0:
        tuning.launch(
            "rowwise_backward", (n_out,),
            dy_storage, x_storage, values, topo.rowptr, topo.col, dx, dvalues, dbias, batch, *dy_strides, *x_strides,
            dx.stride(0), dx.stride(1), BIAS_GRAD=bias_grad, WHILE_LOOP=tuning.INTERPRETED, BLOCK_B=_block_b(batch),
        )  # fmt: skip
    return dx.to(dy.dtype), dvalues, dbias
