"""The Python cost of an eager SparseLinear: a small layer against ``nn.Linear`` on one thread.

Usage: ``.venv/bin/python benchmarks/eager_overhead.py`` (about half a minute); writes
``benchmarks/eager_overhead.txt``, which the README quotes.

At 64×64 the kernels take a few microseconds, so the figures are mostly host work: input
checks, the thread-safe state snapshot, the topology cache lookup and one autograd node for
snack, C++ for ``nn.Linear``. Both layers run in one process, interleaved sample by sample,
with the lead-in of :class:`snack.bench.timing.Timer`; the figures are medians over the samples.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import snack
from snack.bench.report import compare_and_save

SIZE, SPARSITY, BATCH, SAMPLES = 64, 0.9, 32, 15
OUT = Path(__file__).with_name("eager_overhead.txt")


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = {"nn.Linear": nn.Linear(SIZE, SIZE), "SparseLinear": snack.SparseLinear(SIZE, SIZE, sparsity=SPARSITY)}
    x = torch.randn(BATCH, SIZE)
    x_grad = x.clone().requires_grad_()

    def inference(layer):
        with torch.no_grad():
            layer(x)

    def training_step(layer):
        x_grad.grad = None
        for parameter in layer.parameters():
            parameter.grad = None
        layer(x_grad).sum().backward()

    setting = f"{SIZE}x{SIZE} at sparsity {SPARSITY}, batch {BATCH}, medians of {SAMPLES} interleaved samples"
    compare_and_save(
        {"no-grad forward": inference, "training step": training_step}, layers,
        samples=SAMPLES, setting=setting, unit="µs", digits=1, out=OUT,
    )  # fmt: skip


if __name__ == "__main__":
    main()
