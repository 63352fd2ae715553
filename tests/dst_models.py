"""Small float64 models and a training loop shared by the tests of GraNet, MEST and SRigL, whose
updates are checked against the dense model's gradient (``snack.densify`` of a copy)."""

from __future__ import annotations

import copy

import torch
from torch import nn

import snack


def mlp(sparsity: float) -> tuple[nn.Module, torch.Tensor]:
    """A sparse 12-10-10-6 tanh MLP (random topology, seeded) and a ``(5, 12)`` input."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 10), nn.Tanh(), nn.Linear(10, 10), nn.Tanh(), nn.Linear(10, 6)).double()
    return snack.sparsify(net, sparsity, init="random"), torch.randn(5, 12, dtype=torch.float64)


def cnn(sparsity: float) -> tuple[nn.Module, torch.Tensor]:
    """A sparse 3×3 convolution (2 → 4 channels) and linear layer, and a ``(5, 2, 5, 5)`` input."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 5 * 5, 6)).double()
    return snack.sparsify(net, sparsity, init="random"), torch.randn(5, 2, 5, 5, dtype=torch.float64)


def sparse_layers(model: nn.Module) -> list[snack.SparseLinear]:
    return [m for m in model.modules() if isinstance(m, snack.SparseLinear)]


def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).sin().sum()


def batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    """``n`` seeded ``(8, 12)`` inputs of :func:`mlp`."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 12, generator=generator, dtype=torch.float64) for _ in range(n)]


def train(model: nn.Module, opt: torch.optim.Optimizer, dst, inputs: list[torch.Tensor]) -> list[bool]:
    """One training step per input, ``dst.step()`` after each optimizer step: what each returned."""
    flags = []
    for x in inputs:
        opt.zero_grad()
        loss(model, x).backward()
        opt.step()
        flags.append(dst.step())
    return flags


def step_with_dense_gradients(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> list[torch.Tensor]:
    """One training step of ``model`` on ``x`` (``dst.step()`` is the caller's), and the gradient
    ``(out, in)`` of each weight of a dense copy made before it: what growth scores at the step."""
    dense = snack.densify(copy.deepcopy(model))
    opt.zero_grad()
    loss(model, x).backward()
    opt.step()
    loss(dense, x).backward()
    return [m.weight.grad.reshape(m.weight.shape[0], -1) for m in dense.modules() if hasattr(m, "weight")]
