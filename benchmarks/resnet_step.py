"""A CIFAR ResNet-18 sparsified by ``snack.sparsify``, against the dense model.

Usage: ``.venv/bin/python benchmarks/resnet_step.py`` (about two minutes); writes
``benchmarks/resnet_step.txt``, which the README quotes. ``--device cuda --out FILE`` measures on a
GPU (``benchmarks/gpu_check.sh`` does), where ``SparseConv2d`` runs im2col through the Triton
kernels.

The model DST papers train on CIFAR-10 (a 3×3 stem, four stages of two basic blocks, 64-128-256-512
channels, 1×1 stride-2 shortcuts), on 32×32 inputs at batch 32, float32. Every convolution and
the classifier are sparsified with ERK densities at 90%, 95% and 98% (``init="random"``), as a
RigL run would start. Two tables, each variant's times interleaved sample by sample in one process
(:func:`snack.bench.timing.interleaved_medians`), as medians:

1. the whole model: a training step (forward, backward, SGD with momentum) and a no-grad forward
   in eval mode, and that forward at batch 1; then its memory: parameters, buffers and derived index arrays (a sparse layer's
   values and indices), and the tensors autograd keeps from the training forward for the backward
   (the activations);
2. RigL on the 90% model: a training step that records for an update plus the update
   (``dst.step()``), against a plain training step, and what the records hold (a convolution's
   padded input, and what its im2col rows would take);
3. each distinct convolution of the 90% model on its own: a training step (forward, backward into
   the input and the weights) against ``nn.Conv2d`` of the same geometry, with the ERK density it
   got. It shows where the model's time goes and which layers a sparse kernel cannot win.
"""

from __future__ import annotations

import copy
import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import snack
from snack.bench.report import ResultLines
from snack.bench.timing import interleaved_medians

BATCH = 32
SPARSITIES = [0.9, 0.95, 0.98]
SAMPLES = 9
OUT = Path(__file__).with_name("resnet_step.txt")


class BasicBlock(nn.Module):
    """Two 3×3 convolutions with batch norm, plus the input (through a 1×1 strided convolution
    when the shape changes): ``(N, c_in, H, W) → (N, c_out, H / stride, W / stride)``."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


def resnet18(classes: int = 10) -> nn.Sequential:
    """``(N, 3, 32, 32)`` images → ``(N, classes)`` logits."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU()]
    c_in = 64
    for c_out, stride in [(64, 1), (64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2), (512, 1)]:
        layers.append(BasicBlock(c_in, c_out, stride))
        c_in = c_out
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes))


def models(device: torch.device) -> dict[str, nn.Module]:
    """The dense model and one sparsified per sparsity, by name ("dense", "snack 0.9", ...)."""
    built = {"dense": resnet18()}
    for sparsity in SPARSITIES:
        built[f"snack {sparsity}"] = snack.sparsify(resnet18(), sparsity, distribution="erk", init="random")
    return {name: model.to(device) for name, model in built.items()}


def model_variants(models: dict[str, nn.Module], x: torch.Tensor, y: torch.Tensor) -> dict[str, dict]:
    """Per task ("training", "inference"), a callable per model."""
    tasks: dict[str, dict] = {"training": {}, "inference": {}}
    for name, model in models.items():
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step(model=model, optimizer=optimizer):
            model.train()
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()

        def infer(model=model):
            model.eval()
            with torch.no_grad():
                model(x)

        tasks["training"][name], tasks["inference"][name] = step, infer
    return tasks


def memory_mb(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """MB of ``model``'s parameters, buffers and the index arrays its sparse layers derived (after
    a step), and of the tensors autograd keeps from a training forward for the backward, those not
    counted (each storage once)."""
    derived = [t for m in model.modules() if isinstance(m, snack.SparseLinear)
               for t in m.topology.derived_so_far()]  # fmt: skip
    tensors = (*model.parameters(), *model.buffers(), *derived)
    state = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    saved = {}

    def keep(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in state:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        loss = F.cross_entropy(model(x), y)  # alive until the sums: no saved storage is freed and reused
    mb = sum(state.values()) / 2**20, sum(saved.values()) / 2**20
    del loss
    return mb


def rigl_variants(x: torch.Tensor, y: torch.Tensor) -> tuple[dict, snack.dst.RigL]:
    """A plain training step of the 90% model and one of a copy under RigL updating at every step
    (each step records ``X`` and ``dY``, then ``dst.step()`` rewires; ``update=False`` skips that),
    and that RigL object."""
    plain = snack.sparsify(resnet18(), SPARSITIES[0], distribution="erk", init="random").to(x.device)
    rewired = copy.deepcopy(plain)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
    rewired_optimizer = torch.optim.SGD(rewired.parameters(), lr=0.01, momentum=0.9)
    dst = snack.dst.RigL(rewired, rewired_optimizer, update_every=1, total_steps=10**6)

    def train(model, optimizer):
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    def update_step(update: bool = True):
        train(rewired, rewired_optimizer)
        if update:
            dst.step()

    return {"plain": lambda: train(plain, plain_optimizer), "RigL update": update_step}, dst


def record_mb(dst: snack.dst.RigL) -> tuple[float, float, float]:
    """MB of what ``dst`` recorded in the last training step: the inputs as kept, the same inputs
    as im2col rows, the output gradients."""
    kept = rows = gradients = 0
    for (_, layer), calls in zip(dst.layers, dst._capture._records):
        for x, dy in calls:
            kept += x.numel() * x.element_size()
            rows += layer._rows_of_record(x).numel() * x.element_size()
            gradients += dy.numel() * dy.element_size()
    return kept / 2**20, rows / 2**20, gradients / 2**20


def distinct_convolutions(model: nn.Module, x: torch.Tensor) -> list[tuple[str, snack.SparseConv2d, torch.Size]]:
    """``(name, layer, input shape)`` of each convolution of ``model`` with a geometry, density
    and input shape not seen before, in forward order."""
    seen, found = set(), []

    def record(name):
        def hook(module, inputs, output):
            key = (inputs[0].shape, module.out_channels, module.kernel_size, module.stride, module.groups, module.nnz)
            if key not in seen:
                seen.add(key)
                found.append((name, module, inputs[0].shape))

        return hook

    convolutions = [(n, m) for n, m in model.named_modules() if isinstance(m, snack.SparseConv2d)]
    handles = [m.register_forward_hook(record(n)) for n, m in convolutions]
    with torch.no_grad():
        model(x)
    for handle in handles:
        handle.remove()
    return found


def layer_variants(layer: snack.SparseConv2d, shape: torch.Size) -> dict:
    """A training step of ``layer`` and of a dense ``nn.Conv2d`` of its geometry."""
    dense = nn.Conv2d(layer.in_channels, layer.out_channels, layer.kernel_size, layer.stride, layer.padding,
                      layer.dilation, layer.groups, bias=layer.bias is not None, device=layer.values.device)  # fmt: skip
    x = torch.randn(shape, device=layer.values.device, requires_grad=True)

    def step(module):
        def run():
            module.zero_grad(set_to_none=True)
            x.grad = None
            module(x).sum().backward()

        return run

    return {"dense": step(dense), "snack": step(layer)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=torch.device, default=torch.device("cpu"), help="cpu (default) or cuda")
    parser.add_argument("--out", type=Path, default=OUT, help=f"the results file (default {OUT})")
    args = parser.parse_args()
    device = args.device
    torch.manual_seed(0)
    emit = ResultLines(device)
    x, y = torch.randn(BATCH, 3, 32, 32, device=device), torch.randint(0, 10, (BATCH,), device=device)
    threads = f"{torch.get_num_threads()} threads" if device.type == "cpu" else device.type
    emit(f"CIFAR ResNet-18, 32×32 inputs, batch {BATCH}, float32, {threads}; ERK densities, random topology; "
         f"medians of {SAMPLES} interleaved samples; dense/snack > 1: snack is faster")  # fmt: skip
    emit("")
    emit("| task | dense ms | " + " | ".join(f"snack {s} ms | dense/snack" for s in SPARSITIES) + " |")
    emit("|---|---|" + "---|---|" * len(SPARSITIES))
    built = models(device)
    tasks = model_variants(built, x, y)
    tasks["inference, batch 1"] = model_variants(built, x[:1], y[:1])["inference"]  # serving one image
    for task, fns in tasks.items():
        ms = {name: s * 1e3 for name, s in interleaved_medians(fns, device, SAMPLES).items()}
        cells = [f"{ms[f'snack {s}']:.1f} | {ms['dense'] / ms[f'snack {s}']:.2f}" for s in SPARSITIES]
        emit(f"| {task} | {ms['dense']:.1f} | " + " | ".join(cells) + " |")
    emit("")
    emit("Memory of a training step (MB): the weights (parameters, buffers, derived index arrays), and what "
         "autograd keeps for the backward (activations, weights not counted):")  # fmt: skip
    emit("")
    emit("| model | weights | kept for the backward |")
    emit("|---|---|---|")
    for name, model in built.items():
        state, kept = memory_mb(model, x, y)
        emit(f"| {name} | {state:.1f} | {kept:.1f} |")
    emit("")
    steps, dst = rigl_variants(x, y)
    ms = {name: s * 1e3 for name, s in interleaved_medians(steps, device, SAMPLES).items()}
    emit(f"RigL on the {SPARSITIES[0]} model (update_every=1): a training step {ms['plain']:.1f} ms, with the "
         f"recording and the update {ms['RigL update']:.1f} ms (+{ms['RigL update'] - ms['plain']:.1f} ms).")  # fmt: skip
    steps["RigL update"](update=False)  # the records stay until dst.step(): measure them
    kept, rows, gradients = record_mb(dst)
    emit(f"Its records of a step: inputs {kept:.1f} MB (as im2col rows they would be {rows:.1f} MB), output "
         f"gradients {gradients:.1f} MB.")  # fmt: skip
    emit("")
    emit(f"Each distinct convolution of the {SPARSITIES[0]} model, a training step of the layer alone:")
    emit("")
    emit("| layer | input | out | kernel, stride | density | dense ms | snack ms | dense/snack |")
    emit("|---|---|---|---|---|---|---|---|")
    model = snack.sparsify(resnet18(), SPARSITIES[0], distribution="erk", init="random").to(device)
    for name, layer, shape in distinct_convolutions(model, x):
        ms = {key: s * 1e3 for key, s in interleaved_medians(layer_variants(layer, shape), device, SAMPLES).items()}
        emit(
            f"| {name} | {'×'.join(map(str, shape))} | {layer.out_channels} | {layer.kernel_size[0]}×"
            f"{layer.kernel_size[1]}, {layer.stride[0]} | {1 - layer.sparsity:.3f} | {ms['dense']:.2f} | "
            f"{ms['snack']:.2f} | {ms['dense'] / ms['snack']:.2f} |"
        )
    emit.save(args.out)


if __name__ == "__main__":
    main()
