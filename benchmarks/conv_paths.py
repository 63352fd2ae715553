"""Where im2col rows beat SparseConv2d's direct kernels on the CPU: the data behind
``snack.backends.cpu.conv.rows_are_faster``.

Usage: ``.venv/bin/python benchmarks/conv_paths.py`` (about two minutes); writes
``benchmarks/conv_paths.txt``.

Every distinct sparse convolution of a 90%, 95% and 98% ERK CIFAR ResNet-18 and a 95% MobileNetV2
(``benchmarks/resnet_step.py``, ``benchmarks/mobilenet_step.py``; full layers, which run
``F.conv2d`` either way, and layers of more than 4096 output positions left out) at several batch
sizes: a no-grad forward and a training step of the layer (forward, backward into the input and the
parameters) by the direct kernels (forced with ``snack.use_backend("cpu")``) and by im2col rows
through SparseLinear's kernels (the composite path, and for training the node that keeps the input,
``snack/nn/conv_rows.py``), interleaved, as medians. Each layer's ``q = nnz / (rows · C · kh · kw)``
is its connections per element of the im2col rows (rows = N · H_out · W_out); the summary gives, per
threshold, the ratios direct/rows of the layers at and above it and below it (> 1: the rows are
faster).
"""

from __future__ import annotations

from pathlib import Path

import torch
from mobilenet_step import mobilenet_v2
from resnet_step import distinct_convolutions, resnet18  # (this script's folder)

import snack
from snack.backends.cpu import conv as direct
from snack.bench.report import ResultLines
from snack.bench.timing import interleaved_medians

# (model, sparsity, batch sizes)
CASES = [(resnet18, 0.9, (1, 4, 32)), (resnet18, 0.95, (1, 8)), (resnet18, 0.98, (1, 8)), (mobilenet_v2, 0.95, (1, 8))]
MAX_ROWS = 4096
SAMPLES = 5
THRESHOLDS = [0.1, 0.25, 0.5, 1.0]
OUT = Path(__file__).with_name("conv_paths.txt")


def variants(layer: snack.SparseConv2d, shape: torch.Size) -> dict:
    """Inference and a training step of ``layer`` on an input of ``shape``, each by the direct
    kernels and by im2col rows."""
    x = torch.randn(shape)
    x_grad = x.clone().requires_grad_()

    def direct_inference():
        with torch.no_grad(), snack.use_backend("cpu"):
            layer(x)

    def rows_inference():
        with torch.no_grad():
            layer._through_rows(layer._padded(x), layer._product)

    def direct_training():
        layer.zero_grad(set_to_none=True)
        x_grad.grad = None
        with snack.use_backend("cpu"):
            y = layer(x_grad)
        y.sum().backward()

    def rows_training():
        layer.zero_grad(set_to_none=True)
        x_grad.grad = None
        values, bias, topology = layer._consistent_state()
        geometry = direct.ConvGeometry(layer._kernel2d, layer._stride2d, layer._dilation2d, layer._padding_amounts())
        layer._rows_keeping_input(x_grad, values, bias, topology, geometry).sum().backward()

    return {"direct inference": direct_inference, "rows inference": rows_inference,
            "direct training": direct_training, "rows training": rows_training}  # fmt: skip


def main() -> None:
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    emit = ResultLines(cpu)
    emit(f"SparseConv2d's direct kernels against im2col rows, float32, {torch.get_num_threads()} threads; medians of "
         f"{SAMPLES} interleaved samples; direct/rows > 1: the rows are faster")  # fmt: skip
    emit("")
    emit("| model | layer | batch | rows | kernel, stride, groups | density | q | inference direct/rows | "
         "training direct/rows |")  # fmt: skip
    emit("|---|---|---|---|---|---|---|---|---|")
    measured = []  # (q, inference ratio, training ratio)
    for build, sparsity, batches in CASES:
        model = snack.sparsify(build(), sparsity, distribution="erk", init="random").eval()
        for batch in batches:
            for name, layer, shape in distinct_convolutions(model, torch.randn(batch, 3, 32, 32)):
                height, width = layer._output_size(*shape[-2:], layer._padding_amounts())
                rows = batch * height * width
                if layer.nnz == layer.out_features * layer.in_features or rows > MAX_ROWS:
                    continue
                ms = interleaved_medians(variants(layer, shape), cpu, SAMPLES)
                q = layer.nnz / (rows * layer._rows_width)
                inference = ms["direct inference"] / ms["rows inference"]
                training = ms["direct training"] / ms["rows training"]
                measured.append((q, inference, training))
                emit(
                    f"| {build.__name__} {sparsity} | {name} | {batch} | {rows} | {layer.kernel_size[0]}×"
                    f"{layer.kernel_size[1]}, {layer.stride[0]}, {layer.groups} | {1 - layer.sparsity:.3f} | {q:.3f} | "
                    f"{inference:.2f} | {training:.2f} |"
                )
    emit("")
    emit(f"Summary over {len(measured)} layer shapes: direct/rows of the layers with q at or above and below each "
         "threshold (min-max, and how many had the rows faster):")  # fmt: skip
    emit("")
    emit("| q threshold | inference, q ≥ | inference, q < | training, q ≥ | training, q < |")
    emit("|---|---|---|---|---|")
    for threshold in THRESHOLDS:
        cells = []
        for task in (1, 2):
            for side in (True, False):
                ratios = [m[task] for m in measured if (m[0] >= threshold) == side]
                faster = sum(r > 1 for r in ratios)
                cells.append(f"{min(ratios):.2f}-{max(ratios):.2f} ({faster} of {len(ratios)})" if ratios else "-")
        emit(f"| {threshold} | " + " | ".join(cells) + " |")
    emit.save(OUT)


if __name__ == "__main__":
    main()
