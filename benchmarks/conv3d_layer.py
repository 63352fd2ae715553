"""SparseConv3d against nn.Conv3d, a dense weight times a mask, and its own im2col path, on the CPU.

Usage: ``.venv/bin/python benchmarks/conv3d_layer.py`` (about four minutes); writes
``benchmarks/conv3d_layer.txt``, which the README quotes.

3-D convolutions (float32) of the sizes a volumetric or video CNN has: 3×3×3 kernels at stride 1
and 2, and a (1, 3, 3) one (R(2+1)D's spatial half), at 90% and 95% sparsity; a no-grad forward
(inference) and a training step (forward, backward into the input and the parameters), each
variant's times interleaved sample by sample in one process
(:func:`snack.bench.timing.interleaved_medians`), as medians. "mask" is the field's usual tool,
``F.conv3d(x, weight * mask)``; "im2col" the layer's rows path (the input's windows unfolded,
``kd·kh·kw`` copies of it, through SparseLinear's kernels), which the direct kernels replace on the
CPU. Ratios above 1: snack is faster.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from conv_layer import _Call, _tasks  # (this script's folder)
from torch import nn

import snack
from snack.bench.report import ResultLines, out_argument
from snack.bench.timing import interleaved_medians

# (batch, channels in = out, side of the cubic input, kernel, stride); padding keeps the size at stride 1
SHAPES = [
    (4, 32, 16, (3, 3, 3), 1),
    (4, 64, 8, (3, 3, 3), 1),
    (1, 64, 16, (3, 3, 3), 1),
    (4, 32, 16, (3, 3, 3), 2),
    (4, 64, 8, (1, 3, 3), 1),
]
SPARSITIES = [0.9, 0.95]
SAMPLES = 7
OUT = Path(__file__).with_name("conv3d_layer.txt")


def variants(batch: int, channels: int, side: int, kernel: tuple[int, int, int], stride: int,
             sparsity: float) -> dict[str, dict]:  # fmt: skip
    """Per task ("inference", "training"), the callables of each variant."""
    padding = tuple(k // 2 for k in kernel)
    sparse = snack.SparseConv3d(channels, channels, kernel, stride, padding, sparsity=sparsity)
    dense = nn.Conv3d(channels, channels, kernel, stride, padding)
    with torch.no_grad():
        dense.weight.copy_(sparse.to_dense())
        dense.bias.copy_(sparse.bias)
    mask = (dense.weight != 0).float()
    x = torch.randn(batch, channels, side, side, side)

    def masked(inp):
        return F.conv3d(inp, dense.weight * mask, dense.bias, stride, padding)

    def im2col(inp):
        return sparse._through_rows(sparse._padded(inp), sparse._product)

    torch.testing.assert_close(sparse(x), dense(x), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(im2col(x), dense(x), atol=1e-4, rtol=1e-4)
    modules = {"dense": dense, "mask": _Call(masked, dense), "im2col": _Call(im2col, sparse), "snack": sparse}
    return _tasks(modules, x)


def main() -> None:
    out = out_argument(__doc__, OUT)
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    emit = ResultLines(cpu)
    emit(f"3-D convolutions, float32, {torch.get_num_threads()} threads; medians of {SAMPLES} interleaved samples; "
         "dense/snack, mask/snack and im2col/snack > 1: snack is faster")  # fmt: skip
    emit("")
    emit("| batch × channels × side³ | kernel | stride | sparsity | task | dense ms | mask ms | im2col ms | snack ms | "
         "dense/snack | mask/snack | im2col/snack |")  # fmt: skip
    emit("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for batch, channels, side, kernel, stride in SHAPES:
        for sparsity in SPARSITIES:
            for task, fns in variants(batch, channels, side, kernel, stride, sparsity).items():
                ms = {name: s * 1e3 for name, s in interleaved_medians(fns, cpu, SAMPLES).items()}
                emit(
                    f"| {batch}×{channels}×{side}³ | {'×'.join(map(str, kernel))} | {stride} | {sparsity} | {task} | "
                    f"{ms['dense']:.2f} | {ms['mask']:.2f} | {ms['im2col']:.2f} | {ms['snack']:.2f} | "
                    f"{ms['dense'] / ms['snack']:.2f} | {ms['mask'] / ms['snack']:.2f} | "
                    f"{ms['im2col'] / ms['snack']:.2f} |"
                )
    emit.save(out)


if __name__ == "__main__":
    main()
