"""SparseConv2d and SparseConv1d against dense convolutions and dense weights times masks, on the CPU.

Usage: ``.venv/bin/python benchmarks/conv_layer.py`` (about five minutes); writes
``benchmarks/conv_layer.txt``, which the README quotes.

3×3 convolutions (padding 1, float32) of the sizes a CIFAR ResNet has, and kernel-3 1-D ones of
sizes a temporal CNN might have, at 90%, 95% and 99% sparsity, and grouped 3×3 ones (ResNeXt's
cardinality 32, depthwise) at 50% and 90%: a no-grad forward (inference) and a
training step (forward, backward into the input and the parameters), each variant's times
interleaved sample by sample in one process (:func:`snack.bench.timing.interleaved_medians`), as
medians. "mask" is the field's usual tool: ``F.conv2d(x, weight * mask)``, dense cost for sparse
math. Ratios above 1: snack is faster.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import snack
from snack.bench.report import ResultLines, out_argument
from snack.bench.timing import interleaved_medians

# (batch, channels in = out, image side)
SHAPES = [(32, 64, 32), (32, 128, 16), (32, 256, 8), (1, 256, 16)]
# (batch, channels in = out, length) of 1-D convolutions
SHAPES_1D = [(32, 64, 1024), (32, 256, 128)]
# (batch, channels in = out, image side, groups) of grouped 2-D convolutions
SHAPES_GROUPED = [(32, 128, 16, 4), (32, 128, 16, 32), (32, 128, 16, 128)]
SPARSITIES = [0.9, 0.95, 0.99]
SPARSITIES_GROUPED = [0.5, 0.9]
SAMPLES = 9
OUT = Path(__file__).with_name("conv_layer.txt")


def variants(batch: int, channels: int, side: int, sparsity: float, dims: int = 2, groups: int = 1) -> dict[str, dict]:
    """Per task ("inference", "training"), the callables of each variant: 2-D convolutions on
    ``side × side`` images, or 1-D ones on inputs of length ``side``."""
    sparse_class, dense_class, conv = (
        (snack.SparseConv2d, nn.Conv2d, F.conv2d) if dims == 2 else (snack.SparseConv1d, nn.Conv1d, F.conv1d)
    )
    sparse = sparse_class(channels, channels, 3, padding=1, groups=groups, sparsity=sparsity)
    dense = dense_class(channels, channels, 3, padding=1, groups=groups)
    with torch.no_grad():
        dense.weight.copy_(sparse.to_dense())
        dense.bias.copy_(sparse.bias)
    mask = (dense.weight != 0).float()
    x = torch.randn(batch, channels, *(side,) * dims)

    def masked(inp):
        return conv(inp, dense.weight * mask, dense.bias, padding=1, groups=groups)

    torch.testing.assert_close(sparse(x), dense(x), atol=1e-4, rtol=1e-4)
    return _tasks({"dense": dense, "mask": _Call(masked, dense), "snack": sparse}, x)


def _tasks(modules: dict[str, nn.Module], x: torch.Tensor) -> dict[str, dict]:
    """Per task, each module's callable: "inference" a no-grad forward of ``x``, "training" a
    step (forward, backward of the output's sum into a copy of ``x`` and the parameters)."""
    x_grad = x.clone().requires_grad_()

    def step(module):
        def run():
            module.zero_grad(set_to_none=True)
            x_grad.grad = None
            module(x_grad).sum().backward()

        return run

    def infer(module):
        def run():
            with torch.no_grad():
                module(x)

        return run

    return {
        "inference": {name: infer(module) for name, module in modules.items()},
        "training": {name: step(module) for name, module in modules.items()},
    }


class _Call(nn.Module):
    """``fn`` as a module whose parameters are ``owner``'s (for ``zero_grad``)."""

    def __init__(self, fn, owner: nn.Module):
        super().__init__()
        self.fn, self.owner = fn, owner

    def forward(self, x):
        return self.fn(x)


def main() -> None:
    out = out_argument(__doc__, OUT)
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    emit = ResultLines(cpu)
    emit(f"3×3 convolutions, padding 1, float32, {torch.get_num_threads()} threads; medians of {SAMPLES} "
         "interleaved samples; dense/snack and mask/snack > 1: snack is faster")  # fmt: skip
    # (dims, shapes (batch, channels, side, groups), sparsities, what side means, a title, a groups column)
    tables = [
        (2, [(*shape, 1) for shape in SHAPES], SPARSITIES, "side", None, False),
        (1, [(*shape, 1) for shape in SHAPES_1D], SPARSITIES, "length",
         "1-D convolutions (SparseConv1d against nn.Conv1d), kernel 3, padding 1:", False),
        (2, SHAPES_GROUPED, SPARSITIES_GROUPED, "side",
         "Grouped 3×3 convolutions, padding 1 (groups = channels: depthwise), against nn.Conv2d with the same groups:",
         True),
    ]  # fmt: skip
    for dims, shapes, sparsities, size, title, show_groups in tables:
        if title is not None:
            emit("")
            emit(title)
        emit("")
        emit(f"| batch × channels × {size} | {'groups | ' * show_groups}sparsity | task | dense ms | mask ms | "
             "snack ms | dense/snack | mask/snack |")  # fmt: skip
        emit("|---|---|---|---|---|---|---|---|" + "---|" * show_groups)
        for batch, channels, side, groups in shapes:
            for sparsity in sparsities:
                for task, fns in variants(batch, channels, side, sparsity, dims, groups).items():
                    ms = {name: s * 1e3 for name, s in interleaved_medians(fns, cpu, SAMPLES).items()}
                    emit(
                        f"| {batch}×{channels}×{side}{'²' if dims == 2 else ''} | {f'{groups} | ' * show_groups}"
                        f"{sparsity} | {task} | {ms['dense']:.2f} | {ms['mask']:.2f} | {ms['snack']:.2f} | "
                        f"{ms['dense'] / ms['snack']:.2f} | {ms['mask'] / ms['snack']:.2f} |"
                    )
    emit.save(out)


if __name__ == "__main__":
    main()
