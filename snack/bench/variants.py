"""The layer implementations ``snack bench`` compares, all computing ``y = x · Wᵀ + b``.

Each variant is built from the same sparse topology and values, so all four compute the same
function. A variant offers:

* ``infer(x)`` — forward without autograd, ``x (B, in)`` → ``(B, out)``;
* ``train_step(x, dy)`` — forward, then the backward that a training step needs: ``dX (B, in)``
  and the weight and bias gradients (``dy (B, out)`` is the incoming gradient);
* ``state_bytes()`` — the memory the layer needs for training with Adam (see :class:`Memory`).

Variants:

* ``dense`` — ``nn.Linear``: MKL/cuBLAS GEMMs on the full weight.
* ``dense+mask`` — a dense weight times a 0/1 float mask in every forward, as mask-based sparse
  training does (``torch.nn.utils.prune`` style); autograd masks the weight gradient too.
* ``torch.sparse`` — the weight as a ``torch.sparse_csr`` tensor (int64 indices, torch's
  default): ``torch.sparse.mm`` forward, ``torch.sparse.mm`` with the transposed CSR matrix
  for ``dX`` (its values gathered from the current ones every step), and
  ``torch.sparse.sampled_addmm`` for the weight gradient at the non-zeros only.
* ``snack`` — :class:`snack.SparseLinear` on the default backend for the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from snack.nn import SparseLinear

__all__ = ["VARIANTS", "Memory", "build_variants"]


@dataclass(frozen=True)
class Memory:
    """Bytes a layer needs for training with Adam.

    ``params``: the trainable tensors (weight values, bias); ``grads``: one gradient per
    parameter; ``adam``: Adam's two moments per parameter; ``structure``: what else the layer
    keeps (indices, cached index permutations, the mask).
    """

    params: int
    grads: int
    adam: int
    structure: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.adam + self.structure


def _nbytes(*tensors: Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _training_memory(params: list[Tensor], structure: list[Tensor]) -> Memory:
    size = _nbytes(*params)
    return Memory(params=size, grads=size, adam=2 * size, structure=_nbytes(*structure))


def _clear_grads(*tensors: Tensor) -> None:
    # what optimizer.zero_grad() does by default: the next backward allocates fresh gradients
    for t in tensors:
        t.grad = None


class _ModuleVariant:
    """A variant that is one ``nn.Module`` (``self.module``) run as is."""

    module: nn.Module

    def infer(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            return self.module(x)

    def train_step(self, x: Tensor, dy: Tensor) -> None:
        _clear_grads(x, *self.module.parameters())
        self.module(x).backward(dy)


class Dense(_ModuleVariant):
    name = "dense"

    def __init__(self, layer: SparseLinear):
        self.module = nn.Linear(layer.in_features, layer.out_features, device=layer.values.device)
        with torch.no_grad():
            self.module.weight.copy_(layer.to_dense())
            self.module.bias.copy_(layer.bias)

    def state_bytes(self) -> Memory:
        return _training_memory(list(self.module.parameters()), [])


class DenseMask:
    name = "dense+mask"

    def __init__(self, layer: SparseLinear):
        dense = layer.to_dense().detach()
        self.weight = dense.clone().requires_grad_()
        self.mask = (dense != 0).to(dense.dtype)
        self.bias = layer.bias.detach().clone().requires_grad_()

    def _forward(self, x: Tensor) -> Tensor:
        return nn.functional.linear(x, self.weight * self.mask, self.bias)

    def infer(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            return self._forward(x)

    def train_step(self, x: Tensor, dy: Tensor) -> None:
        _clear_grads(x, self.weight, self.bias)
        self._forward(x).backward(dy)

    def state_bytes(self) -> Memory:
        return _training_memory([self.weight, self.bias], [self.mask])


class TorchSparseCSR:
    name = "torch.sparse"

    def __init__(self, layer: SparseLinear):
        out_features, in_features = layer.out_features, layer.in_features
        self.shape = (out_features, in_features)
        self.values = layer.values.detach().clone()
        self.bias = layer.bias.detach().clone()
        csr = torch.sparse_coo_tensor(layer.indices(), self.values, self.shape).to_sparse_csr()
        self.crow, self.col = csr.crow_indices(), csr.col_indices()
        # the transpose (in × out) for dX: its structure once, its values gathered every step
        # (int64 positions: float32 ones would round above 2**24 non-zeros)
        position = torch.arange(layer.nnz, device=self.values.device, dtype=torch.int64)
        csr_t = torch.sparse_coo_tensor(layer.indices().flip(0), position, (in_features, out_features)).to_sparse_csr()
        self.crow_t, self.col_t = csr_t.crow_indices(), csr_t.col_indices()
        self.perm_t = csr_t.values()

    def _weight(self) -> Tensor:
        return torch.sparse_csr_tensor(self.crow, self.col, self.values, self.shape)

    def infer(self, x: Tensor) -> Tensor:
        # (out × in) CSR times x (in × B)
        return torch.sparse.mm(self._weight(), x.t()).t() + self.bias

    def train_step(self, x: Tensor, dy: Tensor) -> None:
        x = x.detach()  # gradients are computed explicitly below, not by autograd
        weight = self._weight()
        torch.sparse.mm(weight, x.t()).t() + self.bias  # forward; its output only feeds the loss
        weight_t = torch.sparse_csr_tensor(self.crow_t, self.col_t, self.values[self.perm_t], self.shape[::-1])
        torch.sparse.mm(weight_t, dy.t()).t()  # dX
        torch.sparse.sampled_addmm(weight, dy.t(), x, beta=0.0)  # dW at the non-zeros only
        dy.sum(0)  # dbias

    def state_bytes(self) -> Memory:
        return _training_memory([self.values, self.bias], [self.crow, self.col, self.crow_t, self.col_t, self.perm_t])


class Snack(_ModuleVariant):
    name = "snack"

    def __init__(self, layer: SparseLinear):
        self.module = self.layer = layer

    def state_bytes(self) -> Memory:
        # the index buffers and every index tensor derived from them that the runs left cached
        # (the CPU backend's 16-bit columns only if a batch-1 point ran)
        return _training_memory(list(self.layer.parameters()), self.layer.index_tensors())


VARIANTS = (Dense, DenseMask, TorchSparseCSR, Snack)


def build_variants(out_features: int, in_features: int, sparsity: float, device: torch.device, seed: int = 0) -> list:
    """One instance of every variant, all with the same random topology, values and bias."""
    torch.manual_seed(seed)
    layer = SparseLinear(in_features, out_features, sparsity=sparsity, device=device)
    return [variant(layer) for variant in VARIANTS]
