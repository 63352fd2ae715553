"""A CIFAR MobileNetV2 (depthwise convolutions) sparsified by ``snack.sparsify``, against the dense model.

Usage: ``.venv/bin/python benchmarks/mobilenet_step.py`` (about two minutes); writes
``benchmarks/mobilenet_step.txt``, which the README quotes.

MobileNetV2 as CIFAR-10 papers use it (stride 1 in the stem and the second stage, 32×32 inputs):
inverted residual blocks of a 1×1 expansion, a 3×3 depthwise convolution and a 1×1 projection,
batch norm, batch 32, float32. Sparsified with ERK densities at 90% and 95% (``init="random"``)
two ways: every convolution and the classifier, and all but the depthwise convolutions, which stay
dense (``exclude``; the sparsity then spreads over the other layers). Each variant's times
interleaved sample by sample in one process (:func:`snack.bench.timing.interleaved_medians`), as
medians: a training step (forward, backward, SGD with momentum) and a no-grad forward in eval
mode; then the memory of each model (as ``benchmarks/resnet_step.py`` measures it); then each
distinct convolution of the 95% model on its own, a training step against ``nn.Conv2d`` of the
same geometry and groups, with the ERK density it got.
"""

from __future__ import annotations

from pathlib import Path

import torch
from resnet_step import distinct_convolutions, layer_variants, memory_mb, model_variants  # (this script's folder)
from torch import nn

import snack
from snack.bench.report import ResultLines
from snack.bench.timing import interleaved_medians

BATCH = 32
SPARSITIES = [0.9, 0.95]
SAMPLES = 9
OUT = Path(__file__).with_name("mobilenet_step.txt")
# (expansion, channels out, blocks, stride of the first) per stage, CIFAR strides
STAGES = [(1, 16, 1, 1), (6, 24, 2, 1), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]


class InvertedResidual(nn.Module):
    """1×1 expansion to ``expansion · c_in`` channels, 3×3 depthwise (stride ``stride``), 1×1
    projection to ``c_out``, plus the input where the shape stays: ``(N, c_in, H, W) → (N, c_out,
    H / stride, W / stride)``."""

    def __init__(self, c_in: int, c_out: int, expansion: int, stride: int):
        super().__init__()
        hidden = c_in * expansion
        expand = [nn.Conv2d(c_in, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6()] if expansion > 1 else []
        self.body = nn.Sequential(
            *expand,
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(),
            nn.Conv2d(hidden, c_out, 1, bias=False), nn.BatchNorm2d(c_out),
        )  # fmt: skip
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x):
        return x + self.body(x) if self.residual else self.body(x)


def mobilenet_v2(classes: int = 10) -> nn.Sequential:
    """``(N, 3, 32, 32)`` images → ``(N, classes)`` logits."""
    layers: list[nn.Module] = [nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU6()]
    c_in = 32
    for expansion, c_out, blocks, stride in STAGES:
        for block in range(blocks):
            layers.append(InvertedResidual(c_in, c_out, expansion, stride if block == 0 else 1))
            c_in = c_out
    layers += [nn.Conv2d(c_in, 1280, 1, bias=False), nn.BatchNorm2d(1280), nn.ReLU6()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(1280, classes))


def depthwise_names(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, nn.Conv2d) and m.groups == m.in_channels > 1]


def models(device: torch.device) -> dict[str, nn.Module]:
    """The dense model and, per sparsity, one sparsified whole ("snack 0.9") and one with dense
    depthwise convolutions ("snack 0.9, dense dw")."""
    built = {"dense": mobilenet_v2()}
    for sparsity in SPARSITIES:
        built[f"snack {sparsity}"] = snack.sparsify(mobilenet_v2(), sparsity, distribution="erk", init="random")
        model = mobilenet_v2()
        built[f"snack {sparsity}, dense dw"] = snack.sparsify(
            model, sparsity, distribution="erk", init="random", exclude=depthwise_names(model)
        )
    return {name: model.to(device) for name, model in built.items()}


def main() -> None:
    torch.manual_seed(0)
    device = torch.device("cpu")
    emit = ResultLines(device)
    x, y = torch.randn(BATCH, 3, 32, 32), torch.randint(0, 10, (BATCH,))
    emit(f"CIFAR MobileNetV2, 32×32 inputs, batch {BATCH}, float32, {torch.get_num_threads()} threads; ERK "
         f"densities, random topology; medians of {SAMPLES} interleaved samples; dense/snack > 1: snack is faster")
    emit("")
    built = models(device)
    emit("| model | training ms | dense/snack | inference ms | dense/snack | weights MB | kept for the backward MB |")
    emit("|---|---|---|---|---|---|---|")
    tasks = model_variants(built, x, y)
    ms = {task: {name: s * 1e3 for name, s in interleaved_medians(fns, device, SAMPLES).items()}
          for task, fns in tasks.items()}  # fmt: skip
    for name, model in built.items():
        train, infer = ms["training"][name], ms["inference"][name]
        weights, kept = memory_mb(model, x, y)
        emit(f"| {name} | {train:.1f} | {ms['training']['dense'] / train:.2f} | {infer:.1f} | "
             f"{ms['inference']['dense'] / infer:.2f} | {weights:.1f} | {kept:.1f} |")  # fmt: skip
    emit("")
    emit(f"Each distinct convolution of the {SPARSITIES[-1]} model, a training step of the layer alone:")
    emit("")
    emit("| layer | input | out | kernel, stride, groups | density | dense ms | snack ms | dense/snack |")
    emit("|---|---|---|---|---|---|---|---|")
    for name, layer, shape in distinct_convolutions(built[f"snack {SPARSITIES[-1]}"], x):
        ms = {key: s * 1e3 for key, s in interleaved_medians(layer_variants(layer, shape), device, SAMPLES).items()}
        emit(
            f"| {name} | {'×'.join(map(str, shape))} | {layer.out_channels} | {layer.kernel_size[0]}×"
            f"{layer.kernel_size[1]}, {layer.stride[0]}, {layer.groups} | {1 - layer.sparsity:.3f} | "
            f"{ms['dense']:.2f} | {ms['snack']:.2f} | {ms['dense'] / ms['snack']:.2f} |"
        )
    emit.save(OUT)


if __name__ == "__main__":
    main()
