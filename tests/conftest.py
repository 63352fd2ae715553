"""Shared fixtures and helpers: dense math on the masked weight is the ground truth."""

from __future__ import annotations

import pytest
import torch

import snack


def make_layer(
    out_features: int,
    in_features: int,
    sparsity: float,
    *,
    dtype=torch.float64,
    seed: int = 0,
    empty_rows=(),
    empty_cols=(),
    bias: bool = True,
) -> snack.SparseLinear:
    """A random SparseLinear whose rows ``empty_rows`` and columns ``empty_cols`` have no connection."""
    torch.manual_seed(seed)
    weight = torch.randn(out_features, in_features, dtype=dtype)
    weight[list(empty_rows), :] = 0
    weight[:, list(empty_cols)] = 0
    keep = torch.rand(out_features, in_features) >= sparsity
    b = torch.randn(out_features, dtype=dtype) if bias else None
    return snack.SparseLinear.from_dense(weight * keep, bias=b)


def dense_forward_and_grads(layer: snack.SparseLinear, x: torch.Tensor, grad_out: torch.Tensor):
    """``(y, dx, dvalues, dbias)`` computed with dense math on ``layer.to_dense()``."""
    weight = layer.to_dense().detach().requires_grad_()
    x = x.detach().requires_grad_()
    bias = layer.bias.detach().requires_grad_() if layer.bias is not None else None
    y = torch.nn.functional.linear(x, weight, bias)
    inputs = (x, weight) + ((bias,) if bias is not None else ())
    grads = torch.autograd.grad(y, inputs, grad_out)
    dvalues = grads[1][layer.row.long(), layer.col.long()]
    return y.detach(), grads[0], dvalues, grads[2] if bias is not None else None


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
