"""Eager against ``torch.compile`` on the CPU: what compiling adds to one large SparseLinear, and
what a compiled model pays per sparse layer against the same model dense.

Usage: ``.venv/bin/python benchmarks/compile_overhead.py`` (about two minutes); writes
``benchmarks/compile_overhead.txt`` (one 4096² layer) and ``benchmarks/compile_overhead_mlp.txt``
(an MLP of eight 256² layers, compiled before its first call as a user would), which the README
quotes.

The variants of each table run in one process, interleaved sample by sample, with the lead-in of
:class:`snack.bench.timing.Timer`; the figures are medians over the samples.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import snack
from snack.bench.report import compare_and_save

SIZE, SPARSITY, SAMPLES = 4096, 0.9, 15
MLP_WIDTH, MLP_DEPTH, MLP_BATCH, MLP_SAMPLES = 256, 8, 8, 40
HERE = Path(__file__).parent


def inference(model: nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        model(x)


def training_step(model: nn.Module, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()


def one_layer() -> None:
    torch.manual_seed(0)
    layer = snack.SparseLinear(SIZE, SIZE, sparsity=SPARSITY)
    x1, x32 = torch.randn(1, SIZE), torch.randn(32, SIZE)
    setting = f"SparseLinear {SIZE}x{SIZE} at sparsity {SPARSITY}, medians of {SAMPLES} interleaved samples"
    # (the compiled variants compile in the warm-up)
    compare_and_save(
        {"inference, batch 1": lambda model: inference(model, x1),
         "training step, batch 32": lambda model: training_step(model, x32)},
        {"eager": layer, "compiled": torch.compile(layer)},
        samples=SAMPLES, setting=setting, unit="ms", digits=3, out=HERE / "compile_overhead.txt",
    )  # fmt: skip


def mlp() -> None:
    torch.manual_seed(0)

    def build() -> nn.Sequential:
        layers = [module for _ in range(MLP_DEPTH) for module in (nn.Linear(MLP_WIDTH, MLP_WIDTH), nn.ReLU())]
        return nn.Sequential(*layers[:-1])

    models = {"dense": build(), "sparse": snack.sparsify(build(), sparsity=SPARSITY)}
    # compiled before any call, as a user would: the sparse layers derive their index data then
    compiled = {kind: torch.compile(model) for kind, model in models.items()}
    x = torch.randn(MLP_BATCH, MLP_WIDTH)
    for model in compiled.values():  # (the eager variants would derive them first in the warm-up)
        training_step(model, x)
    calls = {
        f"{name}, {kind}": (lambda variant, run=run, kind=kind: run(variant[kind], x))
        for name, run in (("inference", inference), ("training step", training_step))
        for kind in models
    }
    setting = (
        f"MLP of {MLP_DEPTH} Linear {MLP_WIDTH}x{MLP_WIDTH} (ReLU between), batch {MLP_BATCH}, dense or sparsified "
        f"at {SPARSITY}; compiled before its first call; medians of {MLP_SAMPLES} interleaved samples"
    )
    compare_and_save(
        calls, {"eager": models, "compiled": compiled},
        samples=MLP_SAMPLES, setting=setting, unit="µs", digits=0, out=HERE / "compile_overhead_mlp.txt",
    )  # fmt: skip


if __name__ == "__main__":
    one_layer()
    mlp()
