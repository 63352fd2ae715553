"""Eager against ``torch.compile`` for one SparseLinear on the CPU: what the compiled call adds.

Usage: ``.venv/bin/python benchmarks/compile_overhead.py`` (about a minute); writes
``benchmarks/compile_overhead.txt``, which the README quotes.

Both variants run in one process, interleaved sample by sample, with the lead-in of
:class:`snack.bench.timing.Timer`; the figures are medians over the samples.
"""

from __future__ import annotations

import datetime
import statistics
from pathlib import Path

import torch

import snack
from snack.bench.cli import machine_line
from snack.bench.timing import Timer

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

    cases = {
        (case, name): Timer(lambda run=run, model=model: run(model), torch.device("cpu"))
        for case, run in (("inference, batch 1", inference), ("training step, batch 32", training_step))
        for name, model in (("eager", layer), ("compiled", compiled))
    }
    for timer in cases.values():
        timer.warm_up()  # the compiled variants compile here
    samples = {key: [] for key in cases}
    for _ in range(SAMPLES):
        for key, timer in cases.items():
            samples[key].append(timer.sample())
    medians = {key: statistics.median(values) * 1e3 for key, values in samples.items()}

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"{stamp} · {machine_line(torch.device('cpu'))}",
        f"SparseLinear {SIZE}x{SIZE} at sparsity {SPARSITY}, medians of {SAMPLES} interleaved samples",
        "",
        "| call | eager ms | compiled ms | compiled / eager |",
        "|---|---|---|---|",
    ]
    for case in ("inference, batch 1", "training step, batch 32"):
        eager, compiled_ms = medians[(case, "eager")], medians[(case, "compiled")]
        lines.append(f"| {case} | {eager:.3f} | {compiled_ms:.3f} | {compiled_ms / eager:.2f} |")
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
