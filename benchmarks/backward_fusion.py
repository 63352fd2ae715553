"""The CPU backward in one pass or two: ``spmm_backward`` fused against ``spmm_t`` then ``sddmm``.

Usage: ``.venv/bin/python benchmarks/backward_fusion.py`` (about a minute); writes
``benchmarks/backward_fusion.txt``, which the README quotes.

The fused kernel reads the weight once for dX and dvalues, but keeps two ``(in, W)`` batch tiles
in L2 (the dX accumulator and x) where each kernel alone keeps one, so on a small L2 it may run
with a narrower tile, hence more passes. ``spmm_backward``'s default picks by that
(``torch.ops.snack_cpu.fuses_backward``); this measures both forms, and the default, interleaved
sample by sample in one process (the lead-in of :class:`snack.bench.timing.Timer`), as medians.
"""

from __future__ import annotations

from pathlib import Path

import torch

import snack
from snack.backends.cpu import native
from snack.bench.report import ResultLines, out_argument
from snack.bench.timing import interleaved_medians

SHAPES = [(4096, 4096), (768, 3072), (3072, 768)]  # (out, in)
SPARSITIES = [0.9, 0.99]
BATCHES = [8, 16, 24, 32, 48, 64, 128]
SAMPLES = 7
OUT = Path(__file__).with_name("backward_fusion.txt")


def main() -> None:
    out = out_argument(__doc__, OUT)
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    emit = ResultLines(cpu)
    emit(
        f"native spmm_backward (dX and dvalues, float32), medians of {SAMPLES} interleaved samples; "
        "two/one = (two passes) / (one pass): above 1 the fused pass is faster"
    )
    emit("")
    emit("| layer (out×in) | sparsity | batch | one pass ms | two passes ms | two/one | default |")
    emit("|---|---|---|---|---|---|---|")
    for out_features, in_features in SHAPES:
        for sparsity in SPARSITIES:
            layer = snack.SparseLinear(in_features, out_features, sparsity=sparsity)
            topo, values = layer.topology.tensors(), layer.values.detach()
            for batch in BATCHES:
                x, dy = torch.randn(batch, in_features), torch.randn(batch, out_features)
                forms = {
                    form: (lambda fuse=fuse: native.spmm_backward(dy, x, values, topo, fuse=fuse))
                    for form, fuse in (("one", True), ("two", False), ("default", None))
                }
                ms = {form: s * 1e3 for form, s in interleaved_medians(forms, cpu, SAMPLES).items()}
                default = "one pass" if torch.ops.snack_cpu.fuses_backward(batch, in_features, x.dtype) else "two"
                emit(
                    f"| {out_features}×{in_features} | {sparsity} | {batch} | {ms['one']:.2f} | {ms['two']:.2f} "
                    f"| {ms['two'] / ms['one']:.2f} | {default} ({ms['default']:.2f} ms) |"
                )
    emit.save(out)


if __name__ == "__main__":
    main()
