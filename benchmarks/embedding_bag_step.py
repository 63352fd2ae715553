"""A recommender's embedding table: snack.SparseEmbeddingBag against nn.EmbeddingBag.

Usage: ``.venv/bin/python benchmarks/embedding_bag_step.py`` (about two minutes); writes
``benchmarks/embedding_bag_step.txt``, which the README quotes.

The table is a large categorical feature's, as in DLRM: 1,000,000 rows × 64. A batch is ``B``
bags of 20 ids each (1-D ids with offsets), summed (``mode="sum"``). A training step looks the
bags up, backpropagates a fixed output gradient and takes an Adam step:

- ``dense``: ``nn.EmbeddingBag`` with Adam (fused). Its backward forms a gradient of the table's
  size, and Adam updates all 64 M entries.
- ``dense, sparse grad``: ``nn.EmbeddingBag(sparse=True)`` with ``torch.optim.SparseAdam``,
  PyTorch's own answer for large tables: a gradient of the rows looked up, Adam on those rows
  only. The table and Adam's moments stay dense.
- ``Dense+Mask``: the dense table times a fixed 0/1 mask (the usual way to train a sparse
  embedding), with Adam (fused).
- ``snack``: ``snack.SparseEmbeddingBag`` at the same sparsity with Adam (fused).
- ``snack, sparse grad``: ``snack.SparseEmbeddingBag(sparse=True)`` with ``SparseAdam``: the
  gradient holds the connections of the rows looked up, and Adam steps only those.

Inference is the lookup alone under ``torch.no_grad()``, dense against snack. All variants run in
one process, interleaved sample by sample; the figures are medians. The memory column is the
table (values and indices for snack, the mask for Dense+Mask) plus Adam's two moments.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn.functional as F
from embedding_step import medians_and_memory  # (this script's folder)
from torch import nn

import snack
from snack.bench.page_faults import keep_freed_memory
from snack.bench.report import ResultLines, out_argument
from snack.bench.timing import interleaved_medians

ROWS, WIDTH, BAG = 1_000_000, 64, 20
BATCHES = [2048, 128]  # bags per step
SPARSITIES = [0.9, 0.99]
SAMPLES = 7
OUT = Path(__file__).with_name("embedding_bag_step.txt")
NAMES = ["dense", "dense, sparse grad", "Dense+Mask", "snack", "snack, sparse grad"]


class _DenseTimesMask(nn.Module):
    """A dense table times a fixed 0/1 mask of the sparse layer's connections."""

    def __init__(self, sparse: snack.SparseEmbeddingBag):
        super().__init__()
        self.weight = nn.Parameter(sparse.to_dense().detach().clone())
        self.register_buffer("mask", self.weight.detach() != 0)

    def forward(self, ids, offsets):
        return F.embedding_bag(ids, self.weight * self.mask, offsets, mode="sum")


def _step(module, optimizer, ids, offsets, grad):
    def run() -> None:
        optimizer.zero_grad(set_to_none=True)
        module(ids, offsets).backward(grad)
        optimizer.step()

    return run


def _inference(module, ids, offsets):
    def run() -> None:
        with torch.no_grad():
            module(ids, offsets)

    return run


def _modules(sparsity: float) -> dict:
    sparse = snack.SparseEmbeddingBag(ROWS, WIDTH, mode="sum", sparsity=sparsity)
    dense = nn.EmbeddingBag(ROWS, WIDTH, mode="sum")
    dense_sparse_grad = nn.EmbeddingBag(ROWS, WIDTH, mode="sum", sparse=True)
    masked = _DenseTimesMask(sparse)
    sparse_grad = copy.deepcopy(sparse)
    sparse_grad.sparse = True
    return {
        "dense": (dense, torch.optim.Adam(dense.parameters(), lr=1e-3, fused=True)),
        "dense, sparse grad": (dense_sparse_grad, torch.optim.SparseAdam(dense_sparse_grad.parameters(), lr=1e-3)),
        "Dense+Mask": (masked, torch.optim.Adam(masked.parameters(), lr=1e-3, fused=True)),
        "snack": (sparse, torch.optim.Adam(sparse.parameters(), lr=1e-3, fused=True)),
        "snack, sparse grad": (sparse_grad, torch.optim.SparseAdam(sparse_grad.parameters(), lr=1e-3)),
    }


def main() -> None:
    out = out_argument(__doc__, OUT)
    # the dense table's 256 MB gradient would otherwise be fresh memory in most steps, faulted in a
    # page at a time (snack.bench.page_faults); the results' machine line says it is kept
    keep_freed_memory()
    torch.manual_seed(0)
    device = torch.device("cpu")
    lines = ResultLines(device)
    lines(f"A {ROWS:,}×{WIDTH} table, bags of {BAG} ids summed. Training step (lookup, backward, fused Adam; "
          f"SparseAdam for sparse grad) and no-grad inference; medians of {SAMPLES} interleaved samples, ms; "
          "memory: table + Adam state, MiB")
    lines("")
    lines("| bags | sparsity | " + " | ".join(f"{name} ms" for name in NAMES)
          + " | snack vs dense | snack vs dense, sparse grad | inference dense ms | snack ms | "
          + "snack vs dense | "
          + " | ".join(f"{name} MiB" for name in NAMES) + " |")
    lines("|---" * (8 + 2 * len(NAMES)) + "|")
    for sparsity in SPARSITIES:
        modules = _modules(sparsity)
        for bags in BATCHES:
            ids = torch.randint(0, ROWS, (bags * BAG,))
            offsets = torch.arange(0, bags * BAG, BAG)
            grad = torch.randn(bags, WIDTH)
            variants = {name: (_step(m, o, ids, offsets, grad), m, o) for name, (m, o) in modules.items()}
            ms, mib = medians_and_memory(variants, device, SAMPLES)
            inference = interleaved_medians(
                {name: _inference(modules[name][0], ids, offsets) for name in ("dense", "snack")}, device, SAMPLES
            )
            dense_ms, snack_ms = inference["dense"] * 1e3, inference["snack"] * 1e3
            lines(
                f"| {bags} | {sparsity} | " + " | ".join(f"{ms[n]:.1f}" for n in NAMES)
                + f" | {ms['dense'] / ms['snack']:.1f}× "
                + f"| {ms['dense, sparse grad'] / ms['snack']:.1f}× | "
                + f"{dense_ms:.2f} | {snack_ms:.2f} | {dense_ms / snack_ms:.2f}× | "
                + " | ".join(f"{mib[n]:.1f}" for n in NAMES) + " |"
            )
        del modules
    lines.save(out)


if __name__ == "__main__":
    main()
