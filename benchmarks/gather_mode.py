"""The batch-1 CPU kernels' two gather modes: AVX-512 gather/scatter instructions against scalar loads and stores.

Usage: ``.venv/bin/python benchmarks/gather_mode.py`` (about two minutes; an AVX-512 build only);
writes ``benchmarks/gather_mode.txt``, which the README quotes.

Both modes give bit-identical results (checked here before timing); which is faster depends on
the CPU, and ``snack.backends.cpu.native.gather_mode()`` defaults by vendor. This times the
batch-1 forward (``spmv_u16``, 16-bit columns) and the fused backward (dX, dvalues and dbias in
one pass) in each mode, interleaved sample by sample in one process (the lead-in of
:class:`snack.bench.timing.Timer`), as medians. The mode is process-wide: each timed function
switches to its own mode when the one before it ran in the other (a Python comparison per call
otherwise).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import snack
from snack.backends.cpu import native
from snack.bench.report import ResultLines, out_argument
from snack.bench.timing import interleaved_medians

SHAPES = [(4096, 4096), (768, 3072), (3072, 768)]  # (out, in)
SPARSITIES = [0.9, 0.95, 0.99]
SAMPLES = 9
OUT = Path(__file__).with_name("gather_mode.txt")


class InMode:
    """``fn`` called in gather mode ``mode``, switching the process's mode only when it differs
    from the last one an ``InMode`` set."""

    _current: str | None = None

    def __init__(self, fn, mode: str):
        self.fn, self.mode = fn, mode

    def __call__(self):
        if InMode._current != self.mode:
            native.set_gather_mode(self.mode)
            InMode._current = self.mode
        return self.fn()


def main() -> None:
    out = out_argument(__doc__, OUT)
    if native.gather_mode() is None:
        sys.exit(f"this build ({torch.backends.cpu.get_cpu_capability()}) has no AVX-512 gather modes to compare")
    default = native.gather_mode()
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    emit = ResultLines(cpu)
    emit(
        f"native batch-1 kernels (float32) in each gather mode, medians of {SAMPLES} interleaved samples; "
        f"scalar/vector < 1: scalar loads and stores are faster; this CPU's default: {default}"
    )
    emit("")
    emit("| layer (out×in) | sparsity | kernel | vector ms | scalar ms | scalar/vector |")
    emit("|---|---|---|---|---|---|")
    for out_features, in_features in SHAPES:
        for sparsity in SPARSITIES:
            layer = snack.SparseLinear(in_features, out_features, sparsity=sparsity)
            topo, values = layer.topology.tensors(), layer.values.detach()
            x, dy = torch.randn(1, in_features), torch.randn(1, out_features)
            kernels = {
                "forward": lambda: native.spmm(x, values, topo),
                "fused backward": lambda: native.spmm_backward(dy, x, values, topo, bias_grad=True),
            }
            for kernel, fn in kernels.items():
                results = {mode: InMode(fn, mode)() for mode in native.GATHER_MODES}
                as_tuples = [r if isinstance(r, tuple) else (r,) for r in results.values()]
                assert all(torch.equal(a, b) for a, b in zip(*as_tuples, strict=True)), f"{kernel}: modes differ"
                ms = {
                    mode: s * 1e3
                    for mode, s in interleaved_medians(
                        {mode: InMode(fn, mode) for mode in native.GATHER_MODES}, cpu, SAMPLES
                    ).items()
                }
                emit(
                    f"| {out_features}×{in_features} | {sparsity} | {kernel} | {ms['vector']:.3f} | "
                    f"{ms['scalar']:.3f} | {ms['scalar'] / ms['vector']:.2f} |"
                )
    native.set_gather_mode(default)
    emit.save(out)


if __name__ == "__main__":
    main()
