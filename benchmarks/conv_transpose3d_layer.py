"""SparseConvTranspose3d against nn.ConvTranspose3d, a dense weight times a mask, and its own
composite path, on the CPU.

Usage: ``.venv/bin/python benchmarks/conv_transpose3d_layer.py`` (about three minutes); writes
``benchmarks/conv_transpose3d_layer.txt``, which the README quotes.

The upsampling layers of a 3-D U-Net's decoder (float32): 2×2×2 kernels at stride 2 (no overlap)
and 3×3×3 ones at stride 2 (``padding=1, output_padding=1``) and stride 1, at 90% and 95%
sparsity; a no-grad forward (inference) and a training step (forward, backward into the input and
the parameters), each variant's times interleaved sample by sample in one process
(:func:`snack.bench.timing.interleaved_medians`), as medians. "mask" is the field's usual tool,
``F.conv_transpose3d(x, weight * mask)``; "fold" the layer's composite path (each input position
times the weight, its contributions added by two ``F.fold``s), which the direct kernels replace on
the CPU where they are faster. "snack" is the layer as it dispatches. Ratios above 1: snack is
faster.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from conv_layer import _Call, _tasks  # (this script's folder)

import snack
from snack.bench.report import ResultLines, out_argument
from snack.bench.timing import interleaved_medians

# (batch, channels in, channels out, side of the cubic input, kernel, stride, padding, output_padding)
SHAPES = [
    (4, 64, 32, 8, 2, 2, 0, 0),
    (1, 64, 32, 8, 2, 2, 0, 0),
    (4, 64, 32, 8, 3, 2, 1, 1),
    (4, 32, 32, 16, 3, 1, 1, 0),
]
SPARSITIES = [0.9, 0.95]
SAMPLES = 5
OUT = Path(__file__).with_name("conv_transpose3d_layer.txt")


def variants(batch: int, channels_in: int, channels_out: int, side: int, kernel: int, stride: int, padding: int,
             output_padding: int, sparsity: float) -> dict[str, dict]:  # fmt: skip
    """Per task ("inference", "training"), the callables of each variant."""
    geometry = dict(stride=stride, padding=padding, output_padding=output_padding)
    sparse = snack.SparseConvTranspose3d(channels_in, channels_out, kernel, sparsity=sparsity, **geometry)
    dense = snack.densify(snack.SparseConvTranspose3d.from_dense(sparse.to_dense().detach(), bias=sparse.bias,
                                                                 **geometry))  # fmt: skip
    mask = (dense.weight != 0).float()
    x = torch.randn(batch, channels_in, side, side, side)
    size = sparse._size_of_output(x, None)

    def masked(inp):
        return F.conv_transpose3d(inp, dense.weight * mask, dense.bias, **geometry)

    def fold(inp):
        return sparse._through_fold(inp, size)

    torch.testing.assert_close(sparse(x), dense(x), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fold(x), dense(x), atol=1e-4, rtol=1e-4)
    modules = {"dense": dense, "mask": _Call(masked, dense), "fold": _Call(fold, sparse), "snack": sparse}
    return _tasks(modules, x)


def main() -> None:
    out = out_argument(__doc__, OUT)
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    emit = ResultLines(cpu)
    emit(f"3-D transposed convolutions, float32, {torch.get_num_threads()} threads; medians of {SAMPLES} interleaved "
         "samples; dense/snack, mask/snack and fold/snack > 1: snack is faster")  # fmt: skip
    emit("")
    emit("| batch × in → out × side³ | kernel | stride | sparsity | task | dense ms | mask ms | fold ms | snack ms | "
         "dense/snack | mask/snack | fold/snack |")  # fmt: skip
    emit("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for shape in SHAPES:
        batch, channels_in, channels_out, side, kernel, stride = shape[:6]
        for sparsity in SPARSITIES:
            for task, fns in variants(*shape, sparsity).items():
                ms = {name: s * 1e3 for name, s in interleaved_medians(fns, cpu, SAMPLES).items()}
                emit(
                    f"| {batch}×{channels_in}→{channels_out}×{side}³ | {kernel}³ | {stride} | {sparsity} | {task} | "
                    f"{ms['dense']:.2f} | {ms['mask']:.2f} | {ms['fold']:.2f} | {ms['snack']:.2f} | "
                    f"{ms['dense'] / ms['snack']:.2f} | {ms['mask'] / ms['snack']:.2f} | "
                    f"{ms['fold'] / ms['snack']:.2f} |"
                )
    emit.save(out)


if __name__ == "__main__":
    main()
