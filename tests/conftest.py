"""Shared fixtures and helpers: dense math on the masked weight is the ground truth."""

from __future__ import annotations

import copy

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


def tiny_gpt2():
    """``transformers``' GPT-2 at a test's size (one block, width 32, 50 tokens, 16 positions; its
    ``lm_head`` tied to ``wte``), randomly initialised; the test is skipped without ``transformers``."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


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


def check_topology_invariants(layer: snack.SparseLinear, nnz: int) -> None:
    """``layer`` holds ``nnz`` sorted, unique, in-range connections, and its cached topology data
    was built from its current buffers."""
    from snack.dst.prune_grow import linear_index

    assert layer.nnz == nnz == layer.values.numel() == layer.col.numel()
    key = linear_index(layer.topology)
    assert bool((key[1:] > key[:-1]).all()), "sorted and unique"
    assert int(layer.row.min()) >= 0 and int(layer.row.max()) < layer.out_features
    assert int(layer.col.min()) >= 0 and int(layer.col.max()) < layer.in_features
    topo = layer.topology
    assert topo.row is layer.row and topo.col is layer.col, "cache built from the current buffers"
    assert torch.equal(topo.rowptr.diff(), torch.bincount(layer.row.long(), minlength=layer.out_features).int())
    assert torch.equal(layer.col[topo.csc_perm.long()], layer.col.sort().values)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


def same_size_other(layer):
    """A layer of ``layer``'s shape and nnz with other connections and values."""
    other = copy.deepcopy(layer)
    positions = torch.randperm(layer.in_features * layer.out_features)[: layer.nnz].sort().values
    row, col = positions // layer.in_features, positions % layer.in_features
    other.set_topology(row, col, torch.randn(layer.nnz, dtype=layer.values.dtype))
    return other
