"""RigL's grow step on the CPU: ``gradient_grow`` as it runs against the two ways it ran before.

Usage: ``.venv/bin/python benchmarks/gradient_grow.py`` (about two minutes); writes
``benchmarks/gradient_grow.txt``, which the README quotes.

``gradient_grow`` picks the ``k`` free positions of a layer with the largest ``|dyᵀ·x|`` (here
``k`` = 30% of the connections, RigL's default drop fraction). Three variants, interleaved sample
by sample in one process (the lead-in of :class:`snack.bench.timing.Timer`), as medians:

- *torch, old bar*: the scores by torch's matrix product, a block of rows at a time, and a bar
  sampled from strided rows only for a layer of 4 blocks or more (what ran before 2026-12-01);
- *torch*: the same with the sampled bar for every layer from 65536 scores;
- *native*: the default on the CPU up to batch 128, the scores formed and compared by
  ``torch.ops.snack_cpu.gradient_scores_above`` (``snack/backends/cpu/grow_scores.cpp``).

All three return the same positions on these inputs (checked here before timing).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

import snack
from snack.bench.report import ResultLines, out_argument
from snack.bench.timing import interleaved_medians
from snack.dst import prune_grow

CASES = [  # (out, in, sparsity, batch); the largest batch last: after it the allocator's state
    # slowed the next case here (4096² at 99%: 79 ms against 28-36 ms run first)
    (4096, 4096, 0.9, 8), (4096, 4096, 0.9, 32), (4096, 4096, 0.99, 32), (768, 3072, 0.9, 32),
    (3072, 768, 0.9, 32), (768, 3072, 0.99, 32), (512, 512, 0.9, 32), (4096, 4096, 0.9, 128),
]  # fmt: skip
DROP_FRACTION, SAMPLES = 0.3, 7
OUT = Path(__file__).with_name("gradient_grow.txt")

VARIANTS = {  # name -> module settings of snack.dst.prune_grow
    "torch, old bar": {"_NATIVE_MAX_BATCH": -1, "_SAMPLE_FROM_SCORES": float("inf")},
    "torch": {"_NATIVE_MAX_BATCH": -1},
    "native": {},
}


@contextlib.contextmanager
def _settings(values: dict):
    """``snack.dst.prune_grow``'s module constants set to ``values`` inside the block."""
    saved = {name: getattr(prune_grow, name) for name in values}
    for name, value in values.items():
        setattr(prune_grow, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(prune_grow, name, value)


def _grow(settings: dict, x, dy, topology, k):
    with _settings(settings):
        return prune_grow.gradient_grow(x, dy, topology, k)


def main() -> None:
    out = out_argument(__doc__, OUT)
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    emit = ResultLines(cpu)
    emit(f"gradient_grow, float32, k = {DROP_FRACTION:.0%} of the connections, medians of {SAMPLES} samples")
    emit("")
    names = list(VARIANTS)
    emit(f"| layer (out×in) | sparsity | batch | {' | '.join(f'{name} ms' for name in names)} | old / native |")
    emit("|---|---|---|" + "---|" * len(names) + "---|")
    for out_features, in_features, sparsity, batch in CASES:
        topology = snack.SparseLinear(in_features, out_features, sparsity=sparsity).topology
        x, dy = torch.randn(batch, in_features), torch.randn(batch, out_features)
        k = int(DROP_FRACTION * topology.nnz)
        picks = [_grow(settings, x, dy, topology, k) for settings in VARIANTS.values()]
        if not all(torch.equal(picks[0], other) for other in picks[1:]):
            raise AssertionError(f"the variants picked different positions for {out_features}×{in_features}")
        calls = {name: (lambda s=settings: _grow(s, x, dy, topology, k)) for name, settings in VARIANTS.items()}
        ms = {name: seconds * 1e3 for name, seconds in interleaved_medians(calls, cpu, SAMPLES).items()}
        emit(
            f"| {out_features}×{in_features} | {sparsity} | {batch} | {' | '.join(f'{ms[n]:.1f}' for n in names)} "
            f"| {ms[names[0]] / ms['native']:.2f} |"
        )
    emit.save(out)


if __name__ == "__main__":
    main()
