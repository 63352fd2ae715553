"""SparseConvTranspose2d against nn.ConvTranspose2d and a dense weight times a mask, on the CPU.

Usage: ``.venv/bin/python benchmarks/conv_transpose_layer.py`` (about four minutes); writes
``benchmarks/conv_transpose_layer.txt``, which the README quotes.

Transposed convolutions of the shapes decoders have (float32): a U-Net's 2×2 stride-2
upsampling, a DCGAN generator's 4×4 stride-2 one (at batch 32 and 1), and a 3×3 stride-1 one, at
90%, 95% and 99% sparsity: a no-grad forward (inference) and a training step (forward, backward
into the input and the parameters), each variant's times interleaved sample by sample in one
process (:func:`snack.bench.timing.interleaved_medians`), as medians. "mask" is
``F.conv_transpose2d(x, weight * mask)``; "snack" is the layer as it dispatches (direct kernels,
or im2col rows where those are faster), "direct" the same layer held to the direct kernels
(``snack.use_backend("cpu")``). Ratios above 1: snack is faster.

A second table times the layer's two paths against each other on decoder shapes at batch 1 and
4: the direct kernels and im2col rows (the input's rows times the transposed weight, folded),
with ``q = nnz / (rows · out_channels · kh · kw)``, the quantity
:func:`snack.backends.cpu.conv.rows_are_faster` decides by (its transposed thresholds are read off
this table).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import snack
from snack.bench.report import ResultLines, out_argument
from snack.bench.timing import interleaved_medians

# (batch, channels in, channels out, input side, kernel, stride, padding)
SHAPES = [
    (32, 128, 64, 8, 2, 2, 0),  # U-Net decoder: 8² → 16²
    (32, 64, 32, 16, 4, 2, 1),  # DCGAN generator: 16² → 32²
    (1, 256, 128, 8, 4, 2, 1),  # the same, one image
    (32, 64, 64, 16, 3, 1, 1),  # stride 1: 16² → 16²
]
SPARSITIES = [0.9, 0.95, 0.99]
# (channels in, channels out, input side, kernel, stride, padding) of the paths table, at batch 1 and 4
PATH_SHAPES = [
    (512, 256, 4, 4, 2, 1), (256, 128, 8, 4, 2, 1), (128, 64, 16, 4, 2, 1),
    (256, 128, 8, 2, 2, 0), (512, 256, 4, 2, 2, 0), (256, 256, 4, 3, 1, 1),
]
PATH_SPARSITIES = [0.9, 0.98]
SAMPLES = 9
OUT = Path(__file__).with_name("conv_transpose_layer.txt")


def variants(batch, in_channels, out_channels, side, kernel, stride, padding, sparsity) -> dict[str, dict]:
    """Per task ("inference", "training"), the callables of each variant."""
    sparse = snack.SparseConvTranspose2d(in_channels, out_channels, kernel, stride, padding, sparsity=sparsity)
    dense = nn.ConvTranspose2d(in_channels, out_channels, kernel, stride, padding)
    with torch.no_grad():
        dense.weight.copy_(sparse.to_dense())
        dense.bias.copy_(sparse.bias)
    mask = (dense.weight != 0).float()
    x = torch.randn(batch, in_channels, side, side)
    x_grad = x.clone().requires_grad_()

    def masked(inp):
        return F.conv_transpose2d(inp, dense.weight * mask, dense.bias, stride, padding)

    def direct(inp):
        with snack.use_backend("cpu"):
            return sparse(inp)

    torch.testing.assert_close(sparse(x), dense(x), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(direct(x), dense(x), atol=1e-4, rtol=1e-4)
    calls = {"dense": (dense, dense), "mask": (dense, masked), "snack": (sparse, sparse), "direct": (sparse, direct)}
    return {
        "inference": {name: _inference(call, x) for name, (_, call) in calls.items()},
        "training": {name: _training_step(module, call, x_grad) for name, (module, call) in calls.items()},
    }


def _training_step(module: nn.Module, call, x: torch.Tensor):
    """A training step of ``call`` (a layer or a function of ``module``'s parameters) on ``x``."""

    def run():
        module.zero_grad(set_to_none=True)
        x.grad = None
        call(x).sum().backward()

    return run


def _inference(call, x: torch.Tensor):
    def run():
        with torch.no_grad():
            call(x)

    return run


def main() -> None:
    out = out_argument(__doc__, OUT)
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    emit = ResultLines(cpu)
    emit(f"Transposed convolutions, float32, {torch.get_num_threads()} threads; medians of {SAMPLES} interleaved "
         "samples; dense/snack and mask/snack > 1: snack is faster; direct: the layer held to the direct "
         "kernels")  # fmt: skip
    emit("")
    emit("| batch × in → out channels × side | kernel, stride | sparsity | task | dense ms | mask ms | snack ms | "
         "direct ms | dense/snack | mask/snack |")  # fmt: skip
    emit("|---|---|---|---|---|---|---|---|---|---|")
    for batch, cin, cout, side, kernel, stride, padding in SHAPES:
        for sparsity in SPARSITIES:
            for task, fns in variants(batch, cin, cout, side, kernel, stride, padding, sparsity).items():
                ms = {name: s * 1e3 for name, s in interleaved_medians(fns, cpu, SAMPLES).items()}
                emit(
                    f"| {batch}×{cin}→{cout}×{side}² | {kernel}, {stride} | {sparsity} | {task} | "
                    f"{ms['dense']:.2f} | {ms['mask']:.2f} | {ms['snack']:.2f} | {ms['direct']:.2f} | "
                    f"{ms['dense'] / ms['snack']:.2f} | "
                    f"{ms['mask'] / ms['snack']:.2f} |"
                )
    emit("")
    emit("The two paths of the layer (rows/direct > 1: the rows are faster):")
    emit("")
    emit("| batch × in → out channels × side | kernel, stride | sparsity | q | direct inference ms | rows inference "
         "ms | rows/direct | direct training ms | rows training ms | rows/direct |")  # fmt: skip
    emit("|---|---|---|---|---|---|---|---|---|---|")
    for batch in (1, 4):
        for cin, cout, side, kernel, stride, padding in PATH_SHAPES:
            for sparsity in PATH_SPARSITIES:
                q, ms = paths(batch, cin, cout, side, kernel, stride, padding, sparsity)
                emit(
                    f"| {batch}×{cin}→{cout}×{side}² | {kernel}, {stride} | {sparsity} | {q:.3f} | "
                    f"{ms['direct inference']:.2f} | {ms['rows inference']:.2f} | "
                    f"{ms['direct inference'] / ms['rows inference']:.2f} | {ms['direct training']:.2f} | "
                    f"{ms['rows training']:.2f} | {ms['direct training'] / ms['rows training']:.2f} |"
                )
    emit.save(out)


def paths(batch, in_channels, out_channels, side, kernel, stride, padding, sparsity) -> tuple[float, dict[str, float]]:
    """``q`` and the medians (ms) of the direct kernels' and the rows' inference and training step."""
    layer = snack.SparseConvTranspose2d(in_channels, out_channels, kernel, stride, padding, sparsity=sparsity)
    x = torch.randn(batch, in_channels, side, side, requires_grad=True)
    size = layer._size_of_output(x, None)

    def direct(inp):
        with snack.use_backend("cpu"):  # held to the kernels
            return layer(inp)

    def rows(inp):
        return layer._through_fold(inp, size)

    torch.testing.assert_close(rows(x), direct(x), atol=1e-4, rtol=1e-4)
    fns = {"direct inference": _inference(direct, x), "rows inference": _inference(rows, x),
           "direct training": _training_step(layer, direct, x),
           "rows training": _training_step(layer, rows, x)}  # fmt: skip
    ms = {name: s * 1e3 for name, s in interleaved_medians(fns, torch.device("cpu"), SAMPLES).items()}
    return layer.nnz / (batch * side * side * layer._rows_width), ms


if __name__ == "__main__":
    main()
