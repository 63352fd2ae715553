"""Proof that a sparse layer never materialises an out × in tensor, and its peak memory."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import snack


class LargestTensorMode(TorchDispatchMode):
    """Records the largest number of elements of any tensor produced by any ATen op."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.largest_op = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest, self.largest_op = t.numel(), func
        return out


def _largest_tensor_in_a_training_step(out_features, in_features, sparsity, batch):
    with LargestTensorMode() as mode:
        layer = snack.SparseLinear(in_features, out_features, sparsity=sparsity)
        x = torch.randn(batch, in_features, requires_grad=True)
        y = layer(x)
        y.square().sum().backward()
        torch.optim.Adam(layer.parameters()).step()
    assert layer.values.grad is not None and x.grad is not None
    return mode.largest, mode.largest_op


def test_no_out_by_in_tensor_in_construction_forward_backward_and_step():
    largest, op = _largest_tensor_in_a_training_step(300, 500, 0.95, batch=4)
    assert largest < 300 * 500 // 4, f"{op} produced {largest} elements"


def test_no_out_by_in_tensor_for_a_20000_square_layer():
    largest, op = _largest_tensor_in_a_training_step(20_000, 20_000, 0.999, batch=8)
    # the dense weight would have 4e8 elements; the biggest sparse temporary is batch x nnz
    assert largest <= 8 * 400_000, f"{op} produced {largest} elements"


def test_the_mode_would_catch_a_dense_weight():
    layer = snack.SparseLinear(50, 40, sparsity=0.9)
    with LargestTensorMode() as mode:
        layer.to_dense()
    assert mode.largest == 50 * 40


PEAK_SCRIPT = textwrap.dedent(
    """
    import resource, torch, snack
    # warm up first: the first forward/backward loads libraries, which is not the layer's memory
    warm = snack.SparseLinear(100, 100)
    warm(torch.randn(8, 100, requires_grad=True)).sum().backward()
    x = torch.randn(8, 20_000)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    layer = snack.SparseLinear(20_000, 20_000, sparsity=0.999)
    y = layer(x.requires_grad_())
    y.square().sum().backward()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print((after - before) * 1024)
    """
)


def test_peak_memory_of_a_20000_square_layer_is_tiny():
    """A dense fp32 20,000² weight is 1.6 GB; the sparse layer (400k connections) needs a few MB."""
    result = subprocess.run([sys.executable, "-c", PEAK_SCRIPT], capture_output=True, text=True, check=True)
    peak_growth = int(result.stdout.strip().splitlines()[-1])
    assert peak_growth < 100 * 2**20, f"peak RSS grew by {peak_growth / 2**20:.1f} MiB"


class LargestNewStorageMode(TorchDispatchMode):
    """Records the largest storage, in elements, that any ATen op allocates (views of existing
    storage, such as a reshape of the weight, are not allocations)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.untyped_storage().nbytes() // t.element_size())
        return out


def test_picking_the_largest_weights_allocates_no_copy_of_the_dense_weight():
    # from_dense/sparsify(init="magnitude") of a large weight: a full sort took ~6x its memory
    weight = torch.randn(3000, 3000)
    with LargestNewStorageMode() as mode:
        layer = snack.SparseLinear.from_dense(weight, sparsity=0.999)
    assert layer.nnz == 9000
    assert mode.largest <= snack.topology.BLOCK_ELEMENTS, f"an op allocated {mode.largest} elements"


def test_snack_trains_sparse_model_is_built_without_its_dense_layers():
    from snack.train import mlp, sparse_mlp

    with LargestTensorMode() as mode:
        model = sparse_mlp(784, 3000, 0.99, "erk", "cpu")
    assert mode.largest < 3000 * 3000 // 4, f"{mode.largest_op} produced {mode.largest} elements"
    # the layers sparsify(init="random") makes of the dense MLP
    expected = snack.sparsify(mlp(784, 3000), 0.99, distribution="erk", init="random")
    shapes = [(m.out_features, m.in_features, m.nnz) for m in model if isinstance(m, snack.SparseLinear)]
    assert shapes == [(m.out_features, m.in_features, m.nnz) for m in expected if isinstance(m, snack.SparseLinear)]
    assert [type(m) for m in model] == [type(m) for m in expected]
