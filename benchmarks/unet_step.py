"""A small U-Net (transposed convolutions) sparsified by ``snack.sparsify``, against the dense model.

Usage: ``.venv/bin/python benchmarks/unet_step.py`` (about three minutes); writes
``benchmarks/unet_step.txt``, which the README quotes.

A U-Net as image-to-image models use it, sized for 32×32 inputs: two encoder stages of two 3×3
convolutions with batch norm (64 and 128 channels), a 256-channel bottleneck, and a decoder that
upsamples with 2×2 stride-2 transposed convolutions and joins the encoder's features (skip
connections), then a 1×1 head; a denoising loss (MSE), batch 32, float32. Sparsified with ERK
densities at 90%, 95% and 98% (``init="random"``). Each variant's times interleaved sample by
sample in one process (:func:`snack.bench.timing.interleaved_medians`), as medians: a training
step (forward, backward, SGD with momentum) and a no-grad forward in eval mode, the weights' memory
(as ``benchmarks/resnet_step.py`` measures it), and for the 90% model a training step that
records for a RigL update plus the update (``dst.step()`` at every step), which rewires the
transposed convolutions too.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from resnet_step import memory_mb  # (this script's folder)
from torch import nn

import snack
from snack.bench.report import ResultLines
from snack.bench.timing import interleaved_medians

BATCH = 32
SPARSITIES = [0.9, 0.95, 0.98]
SAMPLES = 7
OUT = Path(__file__).with_name("unet_step.txt")


def double_conv(c_in: int, c_out: int) -> nn.Sequential:
    """Two 3×3 convolutions (padding 1), each with batch norm and ReLU."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(),
        nn.Conv2d(c_out, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(),
    )  # fmt: skip


class UNet(nn.Module):
    """``(N, 3, H, W)`` → ``(N, 3, H, W)``, ``H`` and ``W`` multiples of 4."""

    def __init__(self, widths: tuple[int, int, int] = (64, 128, 256)):
        super().__init__()
        a, b, c = widths
        self.enc1, self.enc2, self.bottleneck = double_conv(3, a), double_conv(a, b), double_conv(b, c)
        self.up2, self.dec2 = nn.ConvTranspose2d(c, b, 2, stride=2), double_conv(2 * b, b)
        self.up1, self.dec1 = nn.ConvTranspose2d(b, a, 2, stride=2), double_conv(2 * a, a)
        self.head = nn.Conv2d(a, 3, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        z = self.bottleneck(F.max_pool2d(e2, 2))
        d2 = self.dec2(torch.cat([self.up2(z), e2], 1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], 1))
        return self.head(d1)


def models() -> dict[str, nn.Module]:
    built = {"dense": UNet()}
    for sparsity in SPARSITIES:
        built[f"snack {sparsity}"] = snack.sparsify(UNet(), sparsity, distribution="erk", init="random")
    return built


def variants(built: dict[str, nn.Module], noisy: torch.Tensor, clean: torch.Tensor) -> dict[str, dict]:
    """Per task ("training", "inference"), a callable per model; "training" also has the 90% model
    under RigL updating at every step ("snack 0.9 + RigL update", on a copy)."""
    tasks: dict[str, dict] = {"training": {}, "inference": {}}
    rigl_model = snack.sparsify(UNet(), SPARSITIES[0], distribution="erk", init="random")
    rigl_optimizer = torch.optim.SGD(rigl_model.parameters(), lr=0.01, momentum=0.9)
    dst = snack.dst.RigL(rigl_model, rigl_optimizer, update_every=1, total_steps=10**6, schedule="constant")
    runs = {name: (model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), None)
            for name, model in built.items()}  # fmt: skip
    runs[f"snack {SPARSITIES[0]} + RigL update"] = (rigl_model, rigl_optimizer, dst)
    for name, (model, optimizer, rigl) in runs.items():

        def step(model=model, optimizer=optimizer, rigl=rigl):
            model.train()
            optimizer.zero_grad(set_to_none=True)
            F.mse_loss(model(noisy), clean).backward()
            optimizer.step()
            if rigl is not None:
                rigl.step()

        def infer(model=model):
            model.eval()
            with torch.no_grad():
                model(noisy)

        tasks["training"][name] = step
        if rigl is None:
            tasks["inference"][name] = infer
    return tasks


def main() -> None:
    torch.manual_seed(0)
    device = torch.device("cpu")
    emit = ResultLines(device)
    clean = torch.randn(BATCH, 3, 32, 32)
    noisy = clean + 0.1 * torch.randn_like(clean)
    emit(f"U-Net (64-128-256 channels, 2×2 stride-2 transposed convolutions), 32×32 inputs, batch {BATCH}, float32, "
         f"{torch.get_num_threads()} threads; ERK densities, random topology; medians of {SAMPLES} interleaved "
         "samples; dense/snack > 1: snack is faster")  # fmt: skip
    emit("")
    built = models()
    transposed = [m for m in built[f"snack {SPARSITIES[0]}"].modules() if isinstance(m, snack.SparseConvTranspose2d)]
    emit(f"ERK densities of the {SPARSITIES[0]} model's transposed convolutions: "
         + ", ".join(f"{1 - m.sparsity:.3f}" for m in transposed))  # fmt: skip
    emit("")
    emit("| model | training ms | dense/snack | inference ms | dense/snack | weights MB |")
    emit("|---|---|---|---|---|---|")
    tasks = variants(built, noisy, clean)
    ms = {task: {name: s * 1e3 for name, s in interleaved_medians(fns, device, SAMPLES).items()}
          for task, fns in tasks.items()}  # fmt: skip
    dense_train, dense_infer = ms["training"]["dense"], ms["inference"]["dense"]
    for name, train in ms["training"].items():
        infer = ms["inference"].get(name)
        model = built.get(name)
        inference = f"{infer:.1f} | {dense_infer / infer:.2f}" if infer is not None else "– | –"
        weights = f"{memory_mb(model, noisy, clean)[0]:.1f}" if model is not None else "–"
        emit(f"| {name} | {train:.1f} | {dense_train / train:.2f} | {inference} | {weights} |")
    emit.save(OUT)


if __name__ == "__main__":
    main()
