"""Pure-torch implementation of the three sparse ops: the oracle for tests, and the fallback on
any device. Short and obviously right rather than fast.

Each op gathers the batch columns it needs, ``(B, nnz)``, and scatters or reduces them; nothing
of size ``out × in`` is ever formed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from snack.topology import TopologyTensors


def supports(device: torch.device) -> bool:
    return True


def spmm(x: Tensor, values: Tensor, topo: TopologyTensors, bias: Tensor | None = None) -> Tensor:
    """``Y[b, r] = bias[r] + Σ_{k: row_k = r} values[k] · x[b, col_k]``; ``x (B, in)`` → ``(B, out)``."""
    n_out = topo.rowptr.numel() - 1
    y = x.new_zeros(x.shape[0], n_out) if bias is None else bias.expand(x.shape[0], n_out).clone()
    return y.index_add_(1, topo.row, x[:, topo.col] * values)


def spmm_t(dy: Tensor, values: Tensor, topo: TopologyTensors) -> Tensor:
    """``dX[b, c] = Σ_{k: col_k = c} values[k] · dy[b, row_k]``; ``dy (B, out)`` → ``(B, in)``."""
    dx = dy.new_zeros(dy.shape[0], topo.colptr.numel() - 1)
    return dx.index_add_(1, topo.col, dy[:, topo.row] * values)


def sddmm(dy: Tensor, x: Tensor, topo: TopologyTensors) -> Tensor:
    """``out[k] = Σ_b dy[b, row_k] · x[b, col_k]``; ``dy (B, out)``, ``x (B, in)`` → ``(nnz,)``."""
    return (dy[:, topo.row] * x[:, topo.col]).sum(0)
