"""The optimizer step of a sparse layer on the CPU: AdamW's three implementations.

Usage: ``.venv/bin/python benchmarks/optimizer_step.py`` (about 15 s); writes
``benchmarks/optimizer_step.txt``, which the README quotes.

A sparse layer's parameters are its ``values`` (nnz,) and ``bias``; the optimizer steps them as it
would any parameter, so its cost is torch's. AdamW by default runs a loop over parameters of
several elementwise passes each (``foreach`` is the default on CUDA only); ``fused=True`` runs
one pass over every element. Each variant steps its own copy of the layer (its own state), with
the same gradients, interleaved sample by sample in one process (:mod:`snack.bench.timing`); the
layer's forward and backward at batch 32 are timed alongside for scale. The variants' updates
are checked to agree before timing.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

import snack
from snack.bench.report import ResultLines, out_argument
from snack.bench.timing import interleaved_medians

CASES = [(4096, 4096, 0.9), (4096, 4096, 0.99), (768, 3072, 0.9)]  # (out, in, sparsity)
IMPLEMENTATIONS = {"for-loop": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}
BATCH, SAMPLES = 32, 9
OUT = Path(__file__).with_name("optimizer_step.txt")


def _optimizers(layer: snack.SparseLinear) -> dict[str, torch.optim.AdamW]:
    """AdamW per implementation, each on its own copy of ``layer`` with ``layer``'s gradients."""
    optimizers = {}
    for name, flags in IMPLEMENTATIONS.items():
        copied = copy.deepcopy(layer)
        for mine, theirs in zip(copied.parameters(), layer.parameters()):
            mine.grad = theirs.grad.clone()
        optimizers[name] = torch.optim.AdamW(copied.parameters(), lr=1e-3, **flags)
    return optimizers


def _check_agreement(optimizers: dict[str, torch.optim.AdamW]) -> None:
    for optimizer in optimizers.values():
        optimizer.step()
    stepped = {name: optimizer.param_groups[0]["params"][0] for name, optimizer in optimizers.items()}
    for name, values in stepped.items():
        torch.testing.assert_close(values, stepped["for-loop"], msg=f"AdamW {name} stepped otherwise")


def main() -> None:
    out = out_argument(__doc__, OUT)
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    emit = ResultLines(cpu)
    emit(f"AdamW.step() on a SparseLinear's values and bias, float32, medians of {SAMPLES} interleaved samples")
    emit("")
    names = list(IMPLEMENTATIONS)
    emit(f"| layer (out×in) | sparsity | nnz | forward + backward, batch {BATCH}, ms | "
         f"{' | '.join(f'{name} ms' for name in names)} | for-loop / fused |")  # fmt: skip
    emit("|---|---|---|---|" + "---|" * len(names) + "---|")
    for out_features, in_features, sparsity in CASES:
        layer = snack.SparseLinear(in_features, out_features, sparsity=sparsity)
        x, dy = torch.randn(BATCH, in_features), torch.randn(BATCH, out_features)
        layer(x).backward(dy)
        optimizers = _optimizers(layer)
        _check_agreement(optimizers)

        def forward_backward():
            layer.zero_grad()
            layer(x).backward(dy)

        calls = {"forward + backward": forward_backward, **{n: o.step for n, o in optimizers.items()}}
        ms = {name: seconds * 1e3 for name, seconds in interleaved_medians(calls, cpu, SAMPLES).items()}
        emit(
            f"| {out_features}×{in_features} | {sparsity} | {layer.nnz:,} | {ms['forward + backward']:.2f} | "
            f"{' | '.join(f'{ms[n]:.2f}' for n in names)} | {ms['for-loop'] / ms['fused']:.1f} |"
        )
    emit.save(out)


if __name__ == "__main__":
    main()
