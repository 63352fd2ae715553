"""ONNX translations of snack's custom ops, for ``torch.onnx.export(..., dynamo=True)``.

``torch.onnx.export`` records a model through ``torch.export``, where a sparse layer is the
custom ops ``snack::topology_index_data`` (its index data from ``row``/``col``) and
``snack::spmm`` (``snack::spmm_t`` for transposed convolutions), which ONNX has no operator for.
:func:`translations` gives the ``custom_translation_table`` that writes them with standard ONNX
operators (opset 18), so the ONNX file holds a layer's ``values`` and its int32 ``row``/``col``,
never a dense weight, and an ONNX runtime computes with its connections only:

- ``spmm`` (``Y[B, out] = X[B, in] · Wᵀ``) as ELLPACK: each output row's connections padded to
  the longest row's count ``K`` (padding reads an appended zero column of ``X``, so an inf or
  NaN input reaches only the rows connected to it, as in snack), the ``(out, K)`` columns and
  values laid out from ``row``/``col``/``values`` (which an ONNX runtime can fold once, at load:
  they depend on the file's tensors only), then one batched product ``(out, 1, K) · (out, K, B)``
  of the gathered inputs. No scatter: ONNX Runtime's ``ScatterElements`` with ``reduction="add"``
  took 455 ms at batch 32 for a 4096² layer at 90%, this 29-32 ms (one ad-hoc run of each, and
  ``benchmarks/onnx_runtime.txt``; summing a ``(B, out, K)`` product instead took 138 ms there).
- ``spmm_t`` (``dX[B, in] = dY[B, out] · W``, the forward of a transposed convolution) the same
  way with the transposed weight: the connections sorted by ``(col, row)`` (``TopK`` of unique
  keys, also folded at load) are its rows.
- ``topology_index_data`` as placeholders of its outputs' sizes: the translations above derive
  what they need from ``row``/``col``, and the exporter drops the unused placeholders.

Inference programs only: the backward ops (``sddmm``, ``spmm_backward``) have no translation.
"""

from __future__ import annotations

try:
    import numpy as np
    import onnxscript
    from onnxscript import opset18 as op
except ImportError as error:  # an optional dependency: the extra snack[onnx]
    raise ImportError(
        "snack.onnx_translations() needs onnxscript (with onnx): pip install onnx onnxscript, or the extra "
        "snack[onnx] (which adds onnxruntime, to run the exported file)"
    ) from error

import torch

__all__ = ["translations"]


def translations() -> dict:
    """``{op overload: ONNX translation}`` for ``torch.onnx.export``'s ``custom_translation_table``."""
    return {
        torch.ops.snack.topology_index_data.default: _topology_index_data,
        torch.ops.snack.spmm.default: _spmm,
        torch.ops.snack.spmm_t.default: _spmm_t,
    }


def _topology_index_data(row, col, out_features: int, in_features: int):
    """``(rowptr (out + 1,), colptr (in + 1,), csc_perm (0,))`` int32 zeros: only their sizes are read."""
    return _zeros_int32(out_features + 1), _zeros_int32(in_features + 1), _zeros_int32(0)


def _zeros_int32(length: int):
    """``(length,)`` int32 zeros."""
    return op.ConstantOfShape(_ints(length), value=onnxscript.ir.tensor(np.zeros(1, np.int32)))


def _spmm(x, values, row, col, rowptr, colptr, csc_perm):
    """``(B, out)``: ``x (B, in)`` times the transposed sparse weight."""
    return _padded_product(x, values, row, col, op.Sub(op.Shape(rowptr), _ints(1)))


def _spmm_t(dy, values, row, col, rowptr, colptr, csc_perm):
    """``(B, in)``: ``dy (B, out)`` times the sparse weight: the product with the transposed
    weight, whose connections are these sorted by ``(col, row)`` (a sort of unique keys)."""
    out_features = op.Sub(op.Shape(rowptr), _ints(1))
    int64 = onnxscript.INT64.dtype
    keys = op.Add(op.Mul(op.Cast(col, to=int64), out_features), op.Cast(row, to=int64))
    _, order = op.TopK(keys, op.Shape(keys), largest=0, sorted=1)
    transposed = (op.Gather(values, order), op.Gather(col, order), op.Gather(row, order))
    return _padded_product(dy, *transposed, op.Sub(op.Shape(colptr), _ints(1)))


def _padded_product(x, values, row, col, out_features):
    """``(B, out)``: ``x (B, in)`` times the transposed ``(out, in)`` weight of the connections
    ``row``/``col``/``values`` (sorted by ``(row, col)``), by padded rows. ``out_features``: ``(1,)``."""
    in_features = op.Shape(x, start=1, end=2)
    columns, padded_values = _padded_rows(row, col, values, out_features, padding_column=in_features)
    with_zero_column = op.Concat(x, _zeros_like(x, op.Concat(op.Shape(x, start=0, end=1), _ints(1), axis=0)), axis=1)
    gathered = op.Gather(op.Transpose(with_zero_column, perm=[1, 0]), columns, axis=0)  # (out, K, B)
    products = op.MatMul(op.Unsqueeze(padded_values, _ints(1)), gathered)  # (out, 1, B)
    return op.Transpose(op.Squeeze(products, _ints(1)), perm=[1, 0])


def _padded_rows(row, col, values, out_features, padding_column):
    """``(out, K)`` int32 columns (``padding_column`` where a row has fewer than ``K``) and
    values (0 there) of the connections, row by row in their order, ``K`` the longest row's count.
    ``out_features``, ``padding_column``: ``(1,)`` int64."""
    row64 = op.Cast(row, to=onnxscript.INT64.dtype)  # (ScatterND takes int64 positions only)
    nnz = op.Shape(row)
    ones = op.Expand(_ints(1), nnz)
    counts = op.ScatterElements(op.Expand(_ints(0), out_features), row64, ones, axis=0, reduction="add")  # (out,)
    # a connection's slot in its row: its position minus its row's first (rows are sorted)
    starts = op.CumSum(counts, _int(0), exclusive=1)
    slots = op.Sub(op.Range(_int(0), op.Squeeze(nnz, _ints(0)), _int(1)), op.Gather(starts, row64))
    longest = op.ReduceMax(op.Concat(counts, _ints(0), axis=0), keepdims=1)  # (the 0: a layer without connections)
    shape = op.Concat(out_features, longest, axis=0)
    where = op.Concat(op.Unsqueeze(row64, _ints(1)), op.Unsqueeze(slots, _ints(1)), axis=1)  # (nnz, 2)
    columns = op.ScatterND(op.Expand(op.Cast(padding_column, to=onnxscript.INT32.dtype), shape), where, col)
    padded_values = op.ScatterND(_zeros_like(values, shape), where, values)
    return columns, padded_values


def _ints(*values: int):
    """A 1-D int64 constant (shapes, axes)."""
    return op.Constant(value_ints=list(values))


def _int(value: int):
    """A scalar int64 constant."""
    return op.Constant(value_int=value)


def _zeros_like(like, shape):
    """Zeros of ``like``'s dtype and the 1-D int64 ``shape``."""
    return op.Expand(op.CastLike(op.Constant(value_float=0.0), like), shape)
