"""A sparse layer exported to ONNX (snack.onnx_translations) and run by ONNX Runtime, against the dense layer's export.

Usage: ``.venv/bin/python benchmarks/onnx_runtime.py`` (about two minutes); writes
``benchmarks/onnx_runtime.txt``, which the README quotes.

One 4096×4096 layer (float32, bias) per sparsity, its weights those of one ``nn.Linear``: the
dense layer exported as it is and the sparse one with snack's translations, both with a dynamic
batch, each run by its own ``onnxruntime.InferenceSession`` (CPU, default threads, not spinning), and the two
layers eagerly in torch (``no_grad``) for reference. Also each ONNX file's size. The variants run
in one process, interleaved sample by sample; the figures are medians over the samples.
"""

from __future__ import annotations

import logging
import tempfile
import warnings
from pathlib import Path

import onnxruntime
import torch
from torch import nn

import snack
from snack.bench.report import ResultLines, out_argument
from snack.bench.timing import interleaved_medians

SIZE, SPARSITIES, BATCHES, SAMPLES = 4096, (0.9, 0.99), (1, 8, 32), 9
OUT = Path(__file__).with_name("onnx_runtime.txt")


def _session(model: nn.Module, folder: Path, name: str) -> tuple[onnxruntime.InferenceSession, int]:
    """An ONNX Runtime session of ``model`` exported with a dynamic batch, and the file's size in bytes."""
    path = folder / f"{name}.onnx"
    batch = torch.export.Dim("batch", min=1, max=4096)
    torch.onnx.export(
        model.eval(), (torch.randn(2, SIZE),), dynamo=True, custom_translation_table=snack.onnx_translations(),
        dynamic_shapes=({0: batch},), verbose=False,
    ).save(path)
    options = onnxruntime.SessionOptions()
    # no busy-waiting of ORT's threads after a run: it took the cores from the next variant
    # interleaved (nn.Linear's batch-1 forward measured 3.4 ms instead of 1.3)
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session, path.stat().st_size


def main() -> None:
    out = out_argument(__doc__, OUT)
    logging.disable(logging.WARNING)  # the exporter's notes on torchvision's ops
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.manual_seed(0)
    lines = ResultLines(torch.device("cpu"))
    lines(f"onnxruntime {onnxruntime.__version__}; {SIZE}×{SIZE} float32, medians of {SAMPLES} interleaved samples, "
          "ms")
    lines("")
    lines("| sparsity | batch | ORT dense | ORT sparse | ORT sparse / ORT dense | torch nn.Linear | snack eager | "
          "dense file MB | sparse file MB |")
    lines("|---" * 9 + "|")
    with tempfile.TemporaryDirectory() as folder:
        for sparsity in SPARSITIES:
            dense = nn.Linear(SIZE, SIZE)
            sparse = snack.SparseLinear.from_dense(dense, sparsity=sparsity)
            (dense_session, dense_bytes), (sparse_session, sparse_bytes) = (
                _session(dense, Path(folder), "dense"), _session(sparse, Path(folder), "sparse"),
            )
            for batch in BATCHES:
                x = torch.randn(batch, SIZE)
                feed = x.numpy()

                def run(session, feed=feed):
                    session.run(None, {session.get_inputs()[0].name: feed})

                def eager(layer, x=x):
                    with torch.no_grad():
                        layer(x)

                variants = {
                    "ORT dense": lambda: run(dense_session), "ORT sparse": lambda: run(sparse_session),
                    "nn.Linear": lambda: eager(dense), "snack": lambda: eager(sparse),
                }
                ms = {name: s * 1e3 for name, s in interleaved_medians(variants, torch.device("cpu"), SAMPLES).items()}
                lines(
                    f"| {sparsity} | {batch} | {ms['ORT dense']:.2f} | {ms['ORT sparse']:.2f} | "
                    f"{ms['ORT sparse'] / ms['ORT dense']:.2f} | {ms['nn.Linear']:.2f} | {ms['snack']:.2f} | "
                    f"{dense_bytes / 1e6:.1f} | {sparse_bytes / 1e6:.1f} |"
                )
    lines.save(out)


if __name__ == "__main__":
    main()
