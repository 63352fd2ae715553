"""Eager against ``torch.compile`` for one SparseLinear on the CPU: what the compiled call adds.

Usage: ``.venv/bin/python benchmarks/compile_overhead.py`` (about a minute); writes
``benchmarks/compile_overhead.txt``, which the README quotes.

Both variants run in one process, interleaved sample by sample, with the lead-in of
:class:`snack.bench.timing.Timer`; the figures are medians over the samples.
"""

from __future__ import annotations

from pathlib import Path

import torch

import snack
from snack.bench.report import compare_and_save

SIZE, SPARSITY, SAMPLES = 4096, 0.9, 15
OUT = Path(__file__).with_name("compile_overhead.txt")


def main() -> None:
    torch.manual_seed(0)
    layer = snack.SparseLinear(SIZE, SIZE, sparsity=SPARSITY)
    compiled = torch.compile(layer)
    x1, x32 = torch.randn(1, SIZE), torch.randn(32, SIZE)

    def inference(model):
        with torch.no_grad():
            model(x1)

    def training_step(model):
        layer.values.grad = layer.bias.grad = None
        model(x32).sum().backward()

    setting = f"SparseLinear {SIZE}x{SIZE} at sparsity {SPARSITY}, medians of {SAMPLES} interleaved samples"
    # (the compiled variants compile in the warm-up)
    compare_and_save(
        {"inference, batch 1": inference, "training step, batch 32": training_step},
        {"eager": layer, "compiled": compiled},
        samples=SAMPLES, setting=setting, unit="ms", digits=3, out=OUT,
    )  # fmt: skip


if __name__ == "__main__":
    main()
