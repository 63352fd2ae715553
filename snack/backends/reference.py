"""Pure-torch implementation of the three sparse ops: the oracle for tests, and the fallback on
any device. Short and obviously right rather than fast.

Each op gathers the batch columns it needs, ``(B, nnz)``, and scatters or reduces them; nothing
of size ``out × in`` is ever formed. Half and bfloat16 inputs are summed in float32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from snack.topology import TopologyTensors


def supports(device: torch.device) -> bool:
    return True


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half and bfloat16, as the native kernels and ``nn.Linear`` sum (every partial
    sum rounded to 8 mantissa bits loses ~1e-1 relative over thousands of terms); else ``dtype``."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def spmm(x: Tensor, values: Tensor, topo: TopologyTensors, bias: Tensor | None = None) -> Tensor:
    """``Y[b, r] = bias[r] + Σ_{k: row_k = r} values[k] · x[b, col_k]``; ``x (B, in)`` → ``(B, out)``."""
    n_out, acc = topo.rowptr.numel() - 1, _accumulation_dtype(x.dtype)
    y = x.new_zeros(x.shape[0], n_out, dtype=acc) if bias is None else bias.to(acc).expand(x.shape[0], n_out).clone()
    return y.index_add_(1, topo.row, x[:, topo.col].to(acc) * values.to(acc)).to(x.dtype)


def spmm_t(dy: Tensor, values: Tensor, topo: TopologyTensors) -> Tensor:
    """``dX[b, c] = Σ_{k: col_k = c} values[k] · dy[b, row_k]``; ``dy (B, out)`` → ``(B, in)``."""
    acc = _accumulation_dtype(dy.dtype)
    dx = dy.new_zeros(dy.shape[0], topo.colptr.numel() - 1, dtype=acc)
    return dx.index_add_(1, topo.col, dy[:, topo.row].to(acc) * values.to(acc)).to(dy.dtype)


def sddmm(dy: Tensor, x: Tensor, topo: TopologyTensors) -> Tensor:
    """``out[k] = Σ_b dy[b, row_k] · x[b, col_k]``; ``dy (B, out)``, ``x (B, in)`` → ``(nnz,)``;
    with leading dimensions, ``dy (*, B, out)``, ``x (*, B, in)`` → ``(*, nnz)`` (``snack.func``'s
    vmap rule)."""
    acc = _accumulation_dtype(dy.dtype)
    return (dy[..., topo.row].to(acc) * x[..., topo.col].to(acc)).sum(-2).to(dy.dtype)
