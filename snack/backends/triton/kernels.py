"""The Triton kernels of the three sparse ops (device code only; launches live in
:mod:`snack.backends.triton.backend`).

Notation: ``B`` batch, ``nnz`` non-zeros, a *segment* is the run of non-zeros that share one output
index — a row of ``W`` for SpMM (``Y = X·Wᵀ``), a column of ``W`` for the transposed SpMM
(``dX = dY·W``, which the host hands over in column order: ``row`` and ``col`` gathered through
``csc_perm`` and cached, so the kernels read them sequentially). The transposed SpMM reads the
values with ``INDIRECT_VALUES``, at ``values[value_index[k]]`` (``value_index`` = ``csc_perm``):
one random load per non-zero instead of a gather pass before the kernel (see :mod:`.backend`).
Every kernel multiplies and accumulates in float32 whatever the storage dtype (fp32, fp16, bf16).

* :func:`segment_spmm_kernel` — the small-batch COO form: one program per (block of non-zeros,
  batch row — or a few rows, ``ROWS_PER_PROGRAM``). Non-zeros are sorted by segment, so inside a
  block equal segments are contiguous; a segmented prefix sum reduces each run and only the last
  element of a run issues an atomic add. Atomics per block = runs in the block, not non-zeros.
* :func:`pointer_spmm_kernel` — the tiled form: one program per (segment, batch tile), walking
  the segment through its pointer array (``rowptr``/``colptr``); each output element is written
  once, no atomics.
* :func:`segment_sddmm_kernel` — ``out[k] = Σ_b dy[b, row_k] · x[b, col_k]``: one program per
  block of non-zeros, looping over batch tiles; optionally also the bias gradient
  ``Σ_b dy[b, r]``, in programs of its own within the same launch.
* :func:`pointer_sddmm_kernel` — the same product, one program per row through ``rowptr``: the
  row's ``dy`` is loaded once (up to batch 64), its row index never, and the bias gradient is
  the row's own sum.
* :func:`rowwise_backward_kernel` — a training step's whole backward in one pass by row, for
  small batches: the pointer SDDMM's products and bias gradient, and ``dX`` by atomic adds
  instead of a second pass by column (the backend's ``walk="row"``).
* :func:`patch_spmm_kernel` — either SpMM by *patches* of ``W`` (a block of segments × a band of
  inputs): a patch's loads stay inside its band, where L1 serves them again; one atomic add per
  segment, band and batch row (the backend's ``form="patches"``).
* :func:`patch_sddmm_kernel` — the SDDMM by the same patches (rows × a band of columns), each
  output written once.

Dense operands are addressed through explicit strides so the host can hand over either the
batch-major ``(B, n)`` layout or its transpose ``(n, B)`` (batch-contiguous: the ``BLOCK_B``
values one non-zero needs are then one coalesced load). Index tensors are int32; addresses are
formed in int64 wherever ``B · n`` may pass 2³¹.

Whether these functions are compiled for a GPU or run by the CPU interpreter is decided when
this module is imported (``TRITON_INTERPRET=1`` → interpreter), by ``triton.jit`` itself.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "KERNELS", "patch_sddmm_kernel", "patch_spmm_kernel", "pointer_sddmm_kernel", "pointer_spmm_kernel",
    "rowwise_backward_kernel", "segment_sddmm_kernel", "segment_spmm_kernel",
]  # fmt: skip


@triton.jit
def _load_values(values_ptr, value_index_ptr, offs, mask, INDIRECT_VALUES: tl.constexpr):
    # The values of positions ``offs`` as float32: ``values[offs]``, or ``values[value_index[offs]]``.
    if INDIRECT_VALUES:
        offs = tl.load(value_index_ptr + offs, mask=mask, other=0)
    return tl.load(values_ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _segmented_sum(value_a, start_a, value_b, start_b):
    # Combine step of a segmented inclusive scan: a run restarts wherever a start flag is set.
    # Associative: (a ∘ b) ∘ c == a ∘ (b ∘ c) for the pair (value, start).
    return tl.where(start_b != 0, value_b, value_a + value_b), start_a | start_b


# Sizes are not specialised on (they only bound loops and masks): a new batch size or matrix must
# not trigger a new compilation. Strides are, so a unit stride is known at compile time.
@triton.jit(do_not_specialize=["nnz", "batch", "n_out"])
def segment_spmm_kernel(
    a_ptr,  # dense input (B, n_in) read at [b, gather_index] through (stride_ab, stride_ai)
    values_ptr,  # (nnz,) in segment order, or in any order read through value_index_ptr
    value_index_ptr,  # (nnz,) int32 position in values of each non-zero; unused unless INDIRECT_VALUES
    seg_ptr_ptr,  # (n_out + 1,) int32 pointer of the segment index (rowptr or colptr)
    seg_index_ptr,  # (nnz,) int32 segment (output) index of each non-zero (row or col)
    gather_index_ptr,  # (nnz,) int32 input index of each non-zero (col or row)
    y_ptr,  # (B, n_out) float32, zero-filled: accumulated with atomics
    nnz,
    batch,
    n_out,
    stride_ab,
    stride_ai,
    INDIRECT_VALUES: tl.constexpr,
    BLOCK_NNZ: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,  # read by the host's grid only: axis 1 = cdiv(B, ROWS_PER_PROGRAM)
):
    """``y[b, s] += Σ_{k in block, seg_k = s} values[k] · a[b, gather_k]`` for one block of
    non-zeros (in segment order) and the batch rows ``program_id(1), + num_programs(1), ...``.

    With one batch row per program the indices of a block are re-read (from L2) once per row;
    several rows per program read them once, at the cost of fewer programs."""
    lane = tl.arange(0, BLOCK_NNZ)
    offs = tl.program_id(0) * BLOCK_NNZ + lane
    mask = offs < nnz
    seg = tl.load(seg_index_ptr + offs, mask=mask, other=0)
    gather = tl.load(gather_index_ptr + offs, mask=mask, other=0).to(tl.int64)
    value = _load_values(values_ptr, value_index_ptr, offs, mask, INDIRECT_VALUES)
    # Run boundaries from the pointer array (no neighbour loads): a non-zero starts a run when it is
    # its segment's first (or the block's first) and ends one when it is its segment's last (or the
    # block's last). Masked lanes end no run.
    seg_first = tl.load(seg_ptr_ptr + seg, mask=mask, other=0)
    seg_end = tl.load(seg_ptr_ptr + seg + 1, mask=mask, other=0)
    is_start = ((offs == seg_first) | (lane == 0)).to(tl.int32)
    is_end = mask & ((offs + 1 == seg_end) | (lane == BLOCK_NNZ - 1))
    # Batch rows are strided over grid axis 1, which CUDA caps at 65535 programs.
    b = tl.program_id(1).to(tl.int64)
    while b < batch:
        a = tl.load(a_ptr + b * stride_ab + gather * stride_ai, mask=mask, other=0.0).to(tl.float32)
        run_sum, _ = tl.associative_scan((value * a, is_start), 0, _segmented_sum)
        tl.atomic_add(y_ptr + b * n_out + seg, run_sum, mask=is_end, sem="relaxed")
        b += tl.num_programs(1)


@triton.jit
def _pointer_chunk(acc, k0, end, a_ptr, values_ptr, value_index_ptr, gather_index_ptr, row_b, mask_b, stride_ai,
                   INDIRECT_VALUES: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    # acc[b, j] += a[b, gather[k_j]] · values[k_j] for the positions k_j = k0 + j < end of a segment.
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask_k = offs_k < end
    gather = tl.load(gather_index_ptr + offs_k, mask=mask_k, other=0).to(tl.int64)
    value = _load_values(values_ptr, value_index_ptr, offs_k, mask_k, INDIRECT_VALUES)
    a = tl.load(a_ptr + row_b[:, None] + gather[None, :] * stride_ai, mask=mask_b[:, None] & mask_k[None, :], other=0.0)
    return acc + a.to(tl.float32) * value[None, :]


@triton.jit(do_not_specialize=["batch"])
def pointer_spmm_kernel(
    a_ptr,  # dense input (B, n_in) read at [b, gather_index] through (stride_ab, stride_ai)
    values_ptr,  # (nnz,) in segment order, or in any order read through value_index_ptr
    value_index_ptr,  # (nnz,) int32 position in values of each non-zero; unused unless INDIRECT_VALUES
    seg_ptr_ptr,  # (n_out + 1,) int32 pointer: segment s owns positions [ptr[s], ptr[s+1])
    gather_index_ptr,  # (nnz,) int32 input index of each non-zero
    bias_ptr,  # (n_out,) added to every output row; unused unless HAS_BIAS
    y_ptr,  # (B, n_out) output written at [b, s] through (stride_yb, stride_ys)
    batch,
    stride_ab,
    stride_ai,
    stride_yb,
    stride_ys,
    HAS_BIAS: tl.constexpr,
    INDIRECT_VALUES: tl.constexpr,
    WHILE_LOOP: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``y[b, s] = Σ_{k in segment s} values[k] · a[b, gather[k]] (+ bias[s])`` for segment
    ``program_id(0)`` and the batch tile ``program_id(1)``. The bias is added to the float32 sum
    (one rounding to the output dtype, and no second pass over ``y``).

    ``WHILE_LOOP`` walks the segment with a while loop, for Triton 3.6's interpreter, which cannot
    iterate ``range()`` over runtime bounds (its scalars are 1-element arrays that NumPy >= 2.4
    refuses to convert to int). Compiled kernels keep the for loop. Triton 3.6 does not
    software-pipeline it (its PTX has no ``cp.async``; :func:`patch_spmm_kernel` shows how to ask):
    these kernels hide load latency with many small programs per SM instead.
    """
    seg = tl.program_id(0)
    offs_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    mask_b = offs_b < batch
    row_b = offs_b.to(tl.int64) * stride_ab
    start = tl.load(seg_ptr_ptr + seg)
    end = tl.load(seg_ptr_ptr + seg + 1)
    # A 2-D accumulator, reduced once after the loop, keeps the inner loop free of reductions.
    acc = tl.zeros((BLOCK_B, BLOCK_K), dtype=tl.float32)
    if WHILE_LOOP:
        k0 = start
        while k0 < end:
            acc = _pointer_chunk(acc, k0, end, a_ptr, values_ptr, value_index_ptr, gather_index_ptr, row_b, mask_b,
                                 stride_ai, INDIRECT_VALUES, BLOCK_K)  # fmt: skip
            k0 += BLOCK_K
    else:
        for k0 in range(start, end, BLOCK_K):
            acc = _pointer_chunk(acc, k0, end, a_ptr, values_ptr, value_index_ptr, gather_index_ptr, row_b, mask_b,
                                 stride_ai, INDIRECT_VALUES, BLOCK_K)  # fmt: skip
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + seg).to(tl.float32)
    y_addr = y_ptr + offs_b.to(tl.int64) * stride_yb + seg.to(tl.int64) * stride_ys
    tl.store(y_addr, y.to(y_ptr.dtype.element_ty), mask=mask_b)


@triton.jit
def _segment_sddmm_block(dy_ptr, x_ptr, row_ptr, col_ptr, out_ptr, block, nnz, batch, stride_db, stride_dr,
                         stride_xb, stride_xc, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    # out[k] = Σ_b dy[b, row_k] · x[b, col_k] for the non-zeros k of block `block`.
    offs_k = block * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_k = offs_k < nnz
    dy_col = tl.load(row_ptr + offs_k, mask=mask_k, other=0).to(tl.int64) * stride_dr
    x_col = tl.load(col_ptr + offs_k, mask=mask_k, other=0).to(tl.int64) * stride_xc
    acc = tl.zeros((BLOCK_B, BLOCK_K), dtype=tl.float32)
    # A while loop: Triton 3.6's interpreter cannot run range() over a runtime argument (see
    # pointer_spmm_kernel); a batch of at most a few tiles gains nothing from pipelining.
    b0 = 0
    while b0 < batch:
        offs_b = b0 + tl.arange(0, BLOCK_B)
        mask = (offs_b < batch)[:, None] & mask_k[None, :]
        b64 = offs_b.to(tl.int64)[:, None]
        dy = tl.load(dy_ptr + b64 * stride_db + dy_col[None, :], mask=mask, other=0.0)
        x = tl.load(x_ptr + b64 * stride_xb + x_col[None, :], mask=mask, other=0.0)
        acc += dy.to(tl.float32) * x.to(tl.float32)
        b0 += BLOCK_B
    out = tl.sum(acc, axis=0)
    tl.store(out_ptr + offs_k, out.to(out_ptr.dtype.element_ty), mask=mask_k)


@triton.jit
def _batch_sum_block(dy_ptr, out_ptr, block, n_out, batch, stride_db, stride_dr, BLOCK_B: tl.constexpr,
                     BLOCK_K: tl.constexpr):  # fmt: skip
    # out[r] = Σ_b dy[b, r] for the BLOCK_K outputs r of block `block` (the bias gradient).
    offs_r = block * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_r = offs_r < n_out
    dy_col = offs_r.to(tl.int64) * stride_dr
    acc = tl.zeros((BLOCK_B, BLOCK_K), dtype=tl.float32)
    b0 = 0
    while b0 < batch:
        offs_b = b0 + tl.arange(0, BLOCK_B)
        mask = (offs_b < batch)[:, None] & mask_r[None, :]
        dy = tl.load(dy_ptr + offs_b.to(tl.int64)[:, None] * stride_db + dy_col[None, :], mask=mask, other=0.0)
        acc += dy.to(tl.float32)
        b0 += BLOCK_B
    tl.store(out_ptr + offs_r, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=mask_r)


@triton.jit(do_not_specialize=["nnz", "batch", "n_out"])
def segment_sddmm_kernel(
    dy_ptr,  # (B, n_out) read at [b, row] through (stride_db, stride_dr)
    x_ptr,  # (B, n_in) read at [b, col] through (stride_xb, stride_xc)
    row_ptr,  # (nnz,) int32
    col_ptr,  # (nnz,) int32
    out_ptr,  # (nnz,) output in the input dtype
    bias_grad_ptr,  # (n_out,) output in the input dtype; unused unless BIAS_GRAD
    nnz,
    batch,
    n_out,
    stride_db,
    stride_dr,
    stride_xb,
    stride_xc,
    BIAS_GRAD: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``out[k] = Σ_b dy[b, row_k] · x[b, col_k]`` for the block of non-zeros ``program_id(0)``.

    With ``BIAS_GRAD`` the grid has ``cdiv(n_out, BLOCK_K)`` programs more, after the
    ``cdiv(nnz, BLOCK_K)`` of the SDDMM, each writing ``bias_grad[r] = Σ_b dy[b, r]`` for a block
    of outputs: a training step's bias gradient without a launch of its own."""
    block = tl.program_id(0)
    if BIAS_GRAD:
        value_blocks = tl.cdiv(nnz, BLOCK_K)
        if block < value_blocks:
            _segment_sddmm_block(dy_ptr, x_ptr, row_ptr, col_ptr, out_ptr, block, nnz, batch, stride_db, stride_dr,
                                 stride_xb, stride_xc, BLOCK_B, BLOCK_K)  # fmt: skip
        else:
            _batch_sum_block(dy_ptr, bias_grad_ptr, block - value_blocks, n_out, batch, stride_db, stride_dr,
                             BLOCK_B, BLOCK_K)  # fmt: skip
    else:
        _segment_sddmm_block(dy_ptr, x_ptr, row_ptr, col_ptr, out_ptr, block, nnz, batch, stride_db, stride_dr,
                             stride_xb, stride_xc, BLOCK_B, BLOCK_K)  # fmt: skip


@triton.jit
def _pointer_sddmm_tile(dy_row, x_ptr, x_col, mask_k, b0, batch, stride_db, stride_xb, BLOCK_B: tl.constexpr):
    # Σ_b dy[b, r] · x[b, col_k] over the batch tile starting at b0, as float32 (BLOCK_K,).
    offs_b = b0 + tl.arange(0, BLOCK_B)
    mask_b = offs_b < batch
    b64 = offs_b.to(tl.int64)
    dy = tl.load(dy_row + b64 * stride_db, mask=mask_b, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + b64[:, None] * stride_xb + x_col[None, :], mask=mask_b[:, None] & mask_k[None, :], other=0.0)
    return tl.sum(dy[:, None] * x.to(tl.float32), axis=0)


@triton.jit
def _single_tile_sddmm(dy_tile, x_ptr, x_col, mask_k, batch, stride_xb, BLOCK_B: tl.constexpr):
    # Σ_b dy[b] · x[b, col_k] as float32 (BLOCK_K,), for a batch of one tile whose dy values are
    # dy_tile; x_col: the non-zeros' column offsets (col_k · stride_xc).
    b64 = tl.arange(0, BLOCK_B).to(tl.int64)
    mask = (b64 < batch)[:, None] & mask_k[None, :]
    x = tl.load(x_ptr + b64[:, None] * stride_xb + x_col[None, :], mask=mask, other=0.0)
    return tl.sum(dy_tile[:, None] * x.to(tl.float32), axis=0)


@triton.jit
def _pointer_sddmm_chunk(dy_row, dy_tile, k0, end, x_ptr, col_ptr, out_ptr, batch, stride_db, stride_xb, stride_xc,
                         SINGLE_TILE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    # out[k] = Σ_b dy[b, r] · x[b, col_k] for the positions k0 <= k < end of row r (dy_row points at
    # dy[0, r]). One batch tile: dy_tile holds its dy values. Several: a loop over them, in float32.
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask_k = offs_k < end
    x_col = tl.load(col_ptr + offs_k, mask=mask_k, other=0).to(tl.int64) * stride_xc
    if SINGLE_TILE:
        out = _single_tile_sddmm(dy_tile, x_ptr, x_col, mask_k, batch, stride_xb, BLOCK_B)
    else:
        out = tl.zeros((BLOCK_K,), dtype=tl.float32)
        b0 = 0
        while b0 < batch:
            out += _pointer_sddmm_tile(dy_row, x_ptr, x_col, mask_k, b0, batch, stride_db, stride_xb, BLOCK_B)
            b0 += BLOCK_B
    tl.store(out_ptr + offs_k, out.to(out_ptr.dtype.element_ty), mask=mask_k)


@triton.jit(do_not_specialize=["batch"])
def pointer_sddmm_kernel(
    dy_ptr,  # (B, n_out) read at [b, row] through (stride_db, stride_dr)
    x_ptr,  # (B, n_in) read at [b, col] through (stride_xb, stride_xc)
    rowptr_ptr,  # (n_out + 1,) int32: row r owns positions [rowptr[r], rowptr[r+1])
    col_ptr,  # (nnz,) int32
    out_ptr,  # (nnz,) output in the input dtype
    bias_grad_ptr,  # (n_out,) output in the input dtype; unused unless BIAS_GRAD
    batch,
    stride_db,
    stride_dr,
    stride_xb,
    stride_xc,
    BIAS_GRAD: tl.constexpr,
    SINGLE_TILE: tl.constexpr,
    WHILE_LOOP: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``out[k] = Σ_b dy[b, r] · x[b, col_k]`` for the non-zeros of row ``r = program_id(0)``, and
    ``bias_grad[r] = Σ_b dy[b, r]`` with ``BIAS_GRAD`` (an empty row writes only that).

    The row index is never read. With ``SINGLE_TILE`` (``batch <= BLOCK_B``: up to batch 64) the
    row's ``dy`` values are loaded once, before the loop over its non-zeros; a larger batch loops
    over its tiles inside each chunk of non-zeros, still summing in float32. ``WHILE_LOOP`` as for :func:`pointer_spmm_kernel`."""
    row = tl.program_id(0)
    start = tl.load(rowptr_ptr + row)
    end = tl.load(rowptr_ptr + row + 1)
    dy_row = dy_ptr + row.to(tl.int64) * stride_dr
    offs_b = tl.arange(0, BLOCK_B)
    dy_tile = tl.load(dy_row + offs_b.to(tl.int64) * stride_db, mask=offs_b < batch, other=0.0).to(tl.float32)
    if WHILE_LOOP:
        k0 = start
        while k0 < end:
            _pointer_sddmm_chunk(dy_row, dy_tile, k0, end, x_ptr, col_ptr, out_ptr, batch, stride_db, stride_xb,
                                 stride_xc, SINGLE_TILE, BLOCK_B, BLOCK_K)  # fmt: skip
            k0 += BLOCK_K
    else:
        for k0 in range(start, end, BLOCK_K):
            _pointer_sddmm_chunk(dy_row, dy_tile, k0, end, x_ptr, col_ptr, out_ptr, batch, stride_db, stride_xb,
                                 stride_xc, SINGLE_TILE, BLOCK_B, BLOCK_K)  # fmt: skip
    if BIAS_GRAD:
        dy_sum = dy_tile
        b0 = BLOCK_B
        while b0 < batch:  # the tiles after the first, if any
            offs_b = b0 + tl.arange(0, BLOCK_B)
            dy_sum += tl.load(dy_row + offs_b.to(tl.int64) * stride_db, mask=offs_b < batch, other=0.0).to(tl.float32)
            b0 += BLOCK_B
        tl.store(bias_grad_ptr + row, tl.sum(dy_sum, axis=0).to(bias_grad_ptr.dtype.element_ty))


@triton.jit
def _rowwise_backward_chunk(dy_tile, k0, end, x_ptr, values_ptr, col_ptr, dx_ptr, dvalues_ptr, batch, stride_xb,
                            stride_xc, stride_gb, stride_gc, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    # For the positions k0 <= k < end of one row (dy_tile: its dy values over the batch):
    # dvalues[k] = Σ_b dy[b] · x[b, col_k], and dx[b, col_k] += dy[b] · values[k] by atomic adds.
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask_k = offs_k < end
    col = tl.load(col_ptr + offs_k, mask=mask_k, other=0).to(tl.int64)
    value = tl.load(values_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    dvalues = _single_tile_sddmm(dy_tile, x_ptr, col * stride_xc, mask_k, batch, stride_xb, BLOCK_B)
    tl.store(dvalues_ptr + offs_k, dvalues.to(dvalues_ptr.dtype.element_ty), mask=mask_k)
    b64 = tl.arange(0, BLOCK_B).to(tl.int64)
    mask = (b64 < batch)[:, None] & mask_k[None, :]
    dx_addr = dx_ptr + b64[:, None] * stride_gb + (col * stride_gc)[None, :]
    tl.atomic_add(dx_addr, dy_tile[:, None] * value[None, :], mask=mask, sem="relaxed")


@triton.jit(do_not_specialize=["batch"])
def rowwise_backward_kernel(
    dy_ptr,  # (B, n_out) read at [b, row] through (stride_db, stride_dr)
    x_ptr,  # (B, n_in) read at [b, col] through (stride_xb, stride_xc)
    values_ptr,  # (nnz,) in row order
    rowptr_ptr,  # (n_out + 1,) int32: row r owns positions [rowptr[r], rowptr[r+1])
    col_ptr,  # (nnz,) int32
    dx_ptr,  # (B, n_in) float32, zeroed: accumulated into at [b, col] through (stride_gb, stride_gc)
    dvalues_ptr,  # (nnz,) output in the input dtype
    bias_grad_ptr,  # (n_out,) output in the input dtype; unused unless BIAS_GRAD
    batch,
    stride_db,
    stride_dr,
    stride_xb,
    stride_xc,
    stride_gb,
    stride_gc,
    BIAS_GRAD: tl.constexpr,
    WHILE_LOOP: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """A training step's backward in one pass over the weight *by row*, for row
    ``r = program_id(0)`` and a batch of at most ``BLOCK_B``: ``dvalues`` as
    :func:`pointer_sddmm_kernel` computes it, ``bias_grad[r] = Σ_b dy[b, r]`` with ``BIAS_GRAD``,
    and ``dX = dY·W`` by one float32 atomic add per non-zero and batch row into ``dx``.

    The values are read in order, once: the transposed SpMM walks ``W`` by column and reads each
    value through ``csc_perm``, one random load per non-zero; here that load becomes an atomic
    add into the small ``dx`` (``B × n_in``), and the SDDMM's pass is the same pass. Atomic adds
    land in any order, so ``dx`` is not bitwise reproducible. ``WHILE_LOOP`` as for
    :func:`pointer_spmm_kernel`."""
    row = tl.program_id(0)
    start = tl.load(rowptr_ptr + row)
    end = tl.load(rowptr_ptr + row + 1)
    offs_b = tl.arange(0, BLOCK_B)
    dy_row = dy_ptr + row.to(tl.int64) * stride_dr
    dy_tile = tl.load(dy_row + offs_b.to(tl.int64) * stride_db, mask=offs_b < batch, other=0.0).to(tl.float32)
    if WHILE_LOOP:
        k0 = start
        while k0 < end:
            _rowwise_backward_chunk(dy_tile, k0, end, x_ptr, values_ptr, col_ptr, dx_ptr, dvalues_ptr, batch,
                                    stride_xb, stride_xc, stride_gb, stride_gc, BLOCK_B, BLOCK_K)  # fmt: skip
            k0 += BLOCK_K
    else:
        for k0 in range(start, end, BLOCK_K):
            _rowwise_backward_chunk(dy_tile, k0, end, x_ptr, values_ptr, col_ptr, dx_ptr, dvalues_ptr, batch,
                                    stride_xb, stride_xc, stride_gb, stride_gc, BLOCK_B, BLOCK_K)  # fmt: skip
    if BIAS_GRAD:
        tl.store(bias_grad_ptr + row, tl.sum(dy_tile, axis=0).to(bias_grad_ptr.dtype.element_ty))


@triton.jit
def _patch_chunk(acc, k0, start, end, a_b, mask_b, values_ptr, value_index_ptr, gather_index_ptr, stride_ai,
                 INDIRECT_VALUES: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    # acc[s, j, b] += values[p] · a[b, gather[p]] at the positions p = start[s] + k0 + j < end[s] of
    # each segment s of the patch (a_b: the batch tile's row offsets into a, (1, 1, BLOCK_B)).
    pos = start[:, None] + k0 + tl.arange(0, BLOCK_K)[None, :]
    mask = pos < end[:, None]
    gather = tl.load(gather_index_ptr + pos, mask=mask, other=0).to(tl.int64)
    value = _load_values(values_ptr, value_index_ptr, pos, mask, INDIRECT_VALUES)
    a_mask = mask[:, :, None] & mask_b[None, None, :]
    a = tl.load(a_b + (gather * stride_ai)[:, :, None], mask=a_mask, other=0.0).to(tl.float32)
    return acc + value[:, :, None] * a


@triton.jit(do_not_specialize=["batch", "n_out"])
def patch_spmm_kernel(
    a_ptr,  # dense input (B, n_in) read at [b, gather_index] through (stride_ab, stride_ai)
    values_ptr,  # (nnz,) in segment order, or in any order read through value_index_ptr
    value_index_ptr,  # (nnz,) int32 position in values of each non-zero; unused unless INDIRECT_VALUES
    band_ptr_ptr,  # (bands + 1, n_out) int32: segment s's non-zeros in band t are [band_ptr[t, s], band_ptr[t+1, s])
    gather_index_ptr,  # (nnz,) int32 input index of each non-zero, in segment order
    y_ptr,  # (B, n_out) float32, zeroed: accumulated into with atomics
    batch,
    n_out,
    stride_ab,
    stride_ai,
    INDIRECT_VALUES: tl.constexpr,
    WHILE_LOOP: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """``y[b, s] += Σ_{k in segment s, gather_k in band t} values[k] · a[b, gather_k]`` for one
    *patch* of ``W`` — the ``BLOCK_S`` segments of block ``program_id(0)`` (rows for SpMM, columns
    for the transposed SpMM) × the inputs of band ``t = program_id(1)`` — and the batch tiles
    ``program_id(2), + num_programs(2), ...``; one atomic add per segment, band and batch row.

    The patch's segments are walked side by side, ``BLOCK_K`` non-zeros of each per step, so its
    loads stay inside the band: the band's inputs ``a[:, band]`` are gathered by every segment
    of the patch (served by L1 after the first), and in the transposed SpMM a row's non-zeros
    inside a block of columns sit side by side in ``values`` (row order), so the values read
    through ``value_index`` share 32-byte sectors. A whole segment's walk (the pointer form)
    pays L2 traffic for each.

    A program walks its patch in a long loop of dependent loads (indices, then what they point
    at), so ``NUM_STAGES > 1`` has Triton software-pipeline it (``cp.async`` copies that many
    steps ahead, through shared memory, which L1 gives up); a plain ``range`` loop is not
    pipelined. ``WHILE_LOOP`` as for :func:`pointer_spmm_kernel`."""
    offs_s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    mask_s = offs_s < n_out
    band_start = band_ptr_ptr + tl.program_id(1).to(tl.int64) * n_out
    start = tl.load(band_start + offs_s, mask=mask_s, other=0)
    end = tl.load(band_start + n_out + offs_s, mask=mask_s, other=0)
    length = tl.max(end - start, axis=0)
    has_nonzeros = mask_s & (end > start)
    tile = tl.program_id(2)
    while tile * BLOCK_B < batch:
        offs_b = tile * BLOCK_B + tl.arange(0, BLOCK_B)
        mask_b = offs_b < batch
        a_b = a_ptr + (offs_b.to(tl.int64) * stride_ab)[None, None, :]
        # A 3-D accumulator, reduced once after the loop, keeps the inner loop free of reductions.
        acc = tl.zeros((BLOCK_S, BLOCK_K, BLOCK_B), dtype=tl.float32)
        if WHILE_LOOP:
            k0 = 0
            while k0 < length:
                acc = _patch_chunk(acc, k0, start, end, a_b, mask_b, values_ptr, value_index_ptr, gather_index_ptr,
                                   stride_ai, INDIRECT_VALUES, BLOCK_K)  # fmt: skip
                k0 += BLOCK_K
        else:
            for k0 in tl.range(0, length, BLOCK_K, num_stages=NUM_STAGES):
                acc = _patch_chunk(acc, k0, start, end, a_b, mask_b, values_ptr, value_index_ptr, gather_index_ptr,
                                   stride_ai, INDIRECT_VALUES, BLOCK_K)  # fmt: skip
        y_addr = y_ptr + offs_b.to(tl.int64)[None, :] * n_out + offs_s[:, None]
        tl.atomic_add(y_addr, tl.sum(acc, axis=1), mask=has_nonzeros[:, None] & mask_b[None, :], sem="relaxed")
        tile += tl.num_programs(2)


@triton.jit
def _patch_dy_tile(dy_rows, mask_s, b0, batch, stride_db, BLOCK_B: tl.constexpr):
    # dy[b, r_s] as float32 (BLOCK_S, BLOCK_B) for the batch tile from b0 and the patch's rows
    # (dy_rows: their addresses, (BLOCK_S, 1); mask_s: which exist), and its batch indices.
    b64 = (b0 + tl.arange(0, BLOCK_B)).to(tl.int64)
    mask = mask_s[:, None] & (b64 < batch)[None, :]
    return tl.load(dy_rows + b64[None, :] * stride_db, mask=mask, other=0.0).to(tl.float32), b64


@triton.jit
def _patch_sddmm_chunk(k0, start, end, dy_rows, mask_s, dy_tile, x_ptr, col_ptr, out_ptr, batch, stride_db,
                       stride_xb, stride_xc, SINGLE_TILE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_B: tl.constexpr,
                       BLOCK_K: tl.constexpr):  # fmt: skip
    # out[p] = Σ_b dy[b, r_s] · x[b, col_p] at the positions p = start[s] + k0 + j < end[s] of each
    # row r_s of the patch (dy_rows, mask_s as for _patch_dy_tile; dy_tile: the rows' dy over the
    # first batch tile).
    pos = start[:, None] + k0 + tl.arange(0, BLOCK_K)[None, :]
    mask = pos < end[:, None]
    x_col = (tl.load(col_ptr + pos, mask=mask, other=0).to(tl.int64) * stride_xc)[:, :, None]
    if SINGLE_TILE:
        b64 = tl.arange(0, BLOCK_B).to(tl.int64)
        x_mask = mask[:, :, None] & (b64 < batch)[None, None, :]
        x = tl.load(x_ptr + b64[None, None, :] * stride_xb + x_col, mask=x_mask, other=0.0).to(tl.float32)
        out = tl.sum(dy_tile[:, None, :] * x, axis=2)
    else:
        out = tl.zeros((BLOCK_S, BLOCK_K), dtype=tl.float32)
        b0 = 0
        while b0 < batch:
            dy, b64 = _patch_dy_tile(dy_rows, mask_s, b0, batch, stride_db, BLOCK_B)
            x_mask = mask[:, :, None] & (b64 < batch)[None, None, :]
            x = tl.load(x_ptr + b64[None, None, :] * stride_xb + x_col, mask=x_mask, other=0.0).to(tl.float32)
            out += tl.sum(dy[:, None, :] * x, axis=2)
            b0 += BLOCK_B
    tl.store(out_ptr + pos, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["batch", "n_out"])
def patch_sddmm_kernel(
    dy_ptr,  # (B, n_out) read at [b, row] through (stride_db, stride_dr)
    x_ptr,  # (B, n_in) read at [b, col] through (stride_xb, stride_xc)
    band_ptr_ptr,  # (bands + 1, n_out) int32: row r's non-zeros in column band t are [band_ptr[t, r], band_ptr[t+1, r])
    col_ptr,  # (nnz,) int32
    out_ptr,  # (nnz,) output in the input dtype
    bias_grad_ptr,  # (n_out,) output in the input dtype; unused unless BIAS_GRAD
    batch,
    n_out,
    stride_db,
    stride_dr,
    stride_xb,
    stride_xc,
    BIAS_GRAD: tl.constexpr,
    SINGLE_TILE: tl.constexpr,
    WHILE_LOOP: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """``out[k] = Σ_b dy[b, row_k] · x[b, col_k]`` for the non-zeros of one patch — the
    ``BLOCK_S`` rows of block ``program_id(0)`` × the columns of band ``program_id(1)`` — and,
    with ``BIAS_GRAD``, ``bias_grad[r] = Σ_b dy[b, r]`` for those rows from the band-0 programs.

    The SDDMM's form of :func:`patch_spmm_kernel`: the rows' non-zeros inside the band are walked
    side by side, so the band's ``x[:, band]`` gathered for one row is there in L1 for the next.
    Each output is written once (no atomics). With ``SINGLE_TILE`` (``batch <= BLOCK_B``) the
    rows' ``dy`` is loaded once, before the loop; otherwise each step loops over the batch
    tiles. ``NUM_STAGES`` and ``WHILE_LOOP`` as for :func:`patch_spmm_kernel`."""
    offs_s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    mask_s = offs_s < n_out
    band_start = band_ptr_ptr + tl.program_id(1).to(tl.int64) * n_out
    start = tl.load(band_start + offs_s, mask=mask_s, other=0)
    end = tl.load(band_start + n_out + offs_s, mask=mask_s, other=0)
    length = tl.max(end - start, axis=0)
    dy_rows = dy_ptr + (offs_s.to(tl.int64) * stride_dr)[:, None]
    dy_tile, _ = _patch_dy_tile(dy_rows, mask_s, 0, batch, stride_db, BLOCK_B)
    if WHILE_LOOP:
        k0 = 0
        while k0 < length:
            _patch_sddmm_chunk(k0, start, end, dy_rows, mask_s, dy_tile, x_ptr, col_ptr, out_ptr, batch, stride_db,
                               stride_xb, stride_xc, SINGLE_TILE, BLOCK_S, BLOCK_B, BLOCK_K)  # fmt: skip
            k0 += BLOCK_K
    else:
        for k0 in tl.range(0, length, BLOCK_K, num_stages=NUM_STAGES):
            _patch_sddmm_chunk(k0, start, end, dy_rows, mask_s, dy_tile, x_ptr, col_ptr, out_ptr, batch, stride_db,
                               stride_xb, stride_xc, SINGLE_TILE, BLOCK_S, BLOCK_B, BLOCK_K)  # fmt: skip
    if BIAS_GRAD:
        if tl.program_id(1) == 0:
            dy_sum = dy_tile
            b0 = BLOCK_B
            while b0 < batch:  # the tiles after the first, if any
                dy_sum += _patch_dy_tile(dy_rows, mask_s, b0, batch, stride_db, BLOCK_B)[0]
                b0 += BLOCK_B
            tl.store(bias_grad_ptr + offs_s, tl.sum(dy_sum, axis=1).to(bias_grad_ptr.dtype.element_ty), mask=mask_s)


# name -> kernel, for tools that walk every kernel (compile-check).
KERNELS = {
    "segment_spmm": segment_spmm_kernel,
    "pointer_spmm": pointer_spmm_kernel,
    "segment_sddmm": segment_sddmm_kernel,
    "pointer_sddmm": pointer_sddmm_kernel,
    "rowwise_backward": rowwise_backward_kernel,
    "patch_spmm": patch_spmm_kernel,
    "patch_sddmm": patch_sddmm_kernel,
}
