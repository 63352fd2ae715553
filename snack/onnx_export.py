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
- ``embedding_lookup`` (a :class:`snack.SparseEmbedding`) from the same padded rows of its table:
  each id's row of columns and values gathered, then scattered into a zero row.
- ``embedding_bag`` (a :class:`snack.SparseEmbeddingBag`'s sum or mean) as those rows, each
  times its weight, added into its bag's row (``ScatterElements`` with ``reduction="add"``; a
  bag layer's ``max`` exports as torch ops on the looked-up rows).
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
        torch.ops.snack.embedding_lookup.default: _embedding_lookup,
        torch.ops.snack.embedding_bag.default: _embedding_bag,
    }


def _topology_index_data(row, col, out_features: int, in_features: int):
    """``(rowptr (out + 1,), colptr (in + 1,), csc_perm (0,))`` int32 zeros: only their sizes are read."""
    return _zeros_int32(out_features + 1), _zeros_int32(in_features + 1), _zeros_int32(0)


def _zeros_int32(length: int):
    """``(length,)`` int32 zeros."""
    return op.ConstantOfShape(_ints(length), value=onnxscript.ir.tensor(np.zeros(1, np.int32)))


def _spmm(x, values, row, col, rowptr, colptr, csc_perm):
    """``(B, out)``: ``x (B, in)`` times the transposed sparse weight."""
    return _padded_product(x, values, row, col, _static_length(rowptr) - 1)


def _spmm_t(dy, values, row, col, rowptr, colptr, csc_perm):
    """``(B, in)``: ``dy (B, out)`` times the sparse weight: the product with the transposed
    weight, whose connections are these sorted by ``(col, row)`` (a sort of unique keys)."""
    int64 = onnxscript.INT64.dtype
    keys = op.Add(op.Mul(op.Cast(col, to=int64), _ints(_static_length(rowptr) - 1)), op.Cast(row, to=int64))
    _, order = op.TopK(keys, op.Shape(keys), largest=0, sorted=1)
    transposed = (op.Gather(values, order), op.Gather(col, order), op.Gather(row, order))
    return _padded_product(dy, *transposed, _static_length(colptr) - 1)


def _embedding_lookup(values, row, col, rowptr, indices, embedding_dim: int):
    """``(N, embedding_dim)``: the table rows of ``indices (N,)``, each gathered from the padded
    rows (:func:`_padded_rows`, padding column ``embedding_dim``) and scattered into a row one
    wider, whose last column, where every padding slot lands (a zero), is cut off."""
    columns, padded_values = _padded_rows(row, col, values, _static_length(rowptr) - 1, padding_column=embedding_dim)
    shape = op.Concat(op.Shape(indices), _ints(embedding_dim + 1), axis=0)
    wider = op.ScatterElements(
        _zeros_like(values, shape), op.Gather(columns, indices, axis=0), op.Gather(padded_values, indices, axis=0),
        axis=1,
    )
    return op.Slice(wider, _ints(0), _ints(embedding_dim), _ints(1))


def _embedding_bag(values, row, col, rowptr, indices, bag, weights, bags, embedding_dim: int):
    """``(bags, embedding_dim)``: the rows of ``indices (N,)`` (:func:`_embedding_lookup`), each
    times its weight, added into its bag's row."""
    rows = op.Mul(_embedding_lookup(values, row, col, rowptr, indices, embedding_dim), op.Unsqueeze(weights, _ints(1)))
    shape = op.Concat(op.Reshape(bags, _ints(1)), _ints(embedding_dim), axis=0)
    where = op.Expand(op.Unsqueeze(bag, _ints(1)), op.Shape(rows))
    return op.ScatterElements(_zeros_like(values, shape), where, rows, axis=0, reduction="add")


def _static_length(pointer) -> int:
    """The length of a pointer array (``out + 1`` or ``in + 1``): known when the program is
    exported, as the layer's shape is."""
    return int(pointer.shape[0])


def _padded_product(x, values, row, col, out_features: int):
    """``(B, out)``: ``x (B, in)`` times the transposed ``(out, in)`` weight of the connections
    ``row``/``col``/``values`` (sorted by ``(row, col)``), by padded rows."""
    in_features = int(x.shape[1])  # (static: the layer's width)
    columns, padded_values = _padded_rows(row, col, values, out_features, padding_column=in_features)
    with_zero_column = op.Concat(x, _zeros_like(x, op.Concat(op.Shape(x, start=0, end=1), _ints(1), axis=0)), axis=1)
    gathered = op.Gather(op.Transpose(with_zero_column, perm=[1, 0]), columns, axis=0)  # (out, K, B)
    products = op.MatMul(op.Unsqueeze(padded_values, _ints(1)), gathered)  # (out, 1, B)
    return op.Transpose(op.Squeeze(products, _ints(1)), perm=[1, 0])


def _padded_rows(row, col, values, out_features: int, padding_column: int):
    """``(out, K)`` int32 columns (``padding_column`` where a row has fewer than ``K``) and
    values (0 there) of the connections, row by row in their order, ``K`` the longest row's count.

    Index arithmetic in int32, as ``row``/``col`` are (``out · K ≤ out · in`` fits, checked), so
    that what the exporter folds into the file from them (it does for small layers) is no larger."""
    if out_features * (padding_column + 1) >= 2**31:
        raise ValueError(
            f"snack.onnx_translations: a {out_features}×{padding_column} layer has more positions than int32 indexes"
        )
    int32 = onnxscript.INT32.dtype
    nnz = op.Shape(row)  # (1,) int64
    ones = op.Expand(_int32s(1), nnz)
    counts = op.ScatterElements(_zeros_int32(out_features), row, ones, axis=0, reduction="add")  # (out,)
    # a connection's slot in its row: its position minus its row's first (rows are sorted)
    starts = op.CumSum(counts, _int(0), exclusive=1)
    positions = op.Range(_int32(0), op.Cast(op.Squeeze(nnz, _ints(0)), to=int32), _int32(1))
    slots = op.Sub(positions, op.Gather(starts, row))
    longest = op.ReduceMax(op.Concat(counts, _int32s(0), axis=0), keepdims=1)  # (the 0: a layer without connections)
    flat = op.Add(op.Mul(row, longest), slots)  # (nnz,) int32: row · K + slot
    longest64 = op.Cast(longest, to=onnxscript.INT64.dtype)
    size = op.Mul(_ints(out_features), longest64)  # (1,) int64: out · K
    shape = op.Concat(_ints(out_features), longest64, axis=0)
    columns = op.ScatterElements(op.Expand(_int32s(padding_column), size), flat, col, axis=0)
    padded_values = op.ScatterElements(_zeros_like(values, size), flat, values, axis=0)
    # (allowzero: K is 0 for a layer without connections, not "keep that dimension")
    return op.Reshape(columns, shape, allowzero=1), op.Reshape(padded_values, shape, allowzero=1)


def _ints(*values: int):
    """A 1-D int64 constant (shapes, axes)."""
    return op.Constant(value_ints=list(values))


def _int32s(*values: int):
    """A 1-D int32 constant (index arithmetic)."""
    return op.Constant(value=onnxscript.ir.tensor(np.array(values, dtype=np.int32)))


def _int32(value: int):
    """A scalar int32 constant."""
    return op.Constant(value=onnxscript.ir.tensor(np.array(value, dtype=np.int32)))


def _int(value: int):
    """A scalar int64 constant."""
    return op.Constant(value_int=value)


def _zeros_like(like, shape):
    """Zeros of ``like``'s dtype and the 1-D int64 ``shape``."""
    return op.Expand(op.CastLike(op.Constant(value_float=0.0), like), shape)
