"""A training step of a GPT-2-sized token embedding: snack.SparseEmbedding against nn.Embedding.

Usage: ``.venv/bin/python benchmarks/embedding_step.py`` (about two minutes); writes
``benchmarks/embedding_step.txt``, which the README quotes.

The table is GPT-2's (50,257 tokens × 768). A step looks up a batch of token ids (8 sequences of
1,024, and 1 of 1,024), backpropagates a fixed output gradient and takes an Adam step:

- ``dense``: ``nn.Embedding`` with Adam. Its backward forms a gradient of the table's size, and
  Adam updates all 38.6 M entries.
- ``dense, sparse grad``: ``nn.Embedding(sparse=True)`` with ``torch.optim.SparseAdam``, PyTorch's
  own answer for large tables: a gradient of the rows looked up, Adam on those rows only. The
  table and Adam's moments stay dense.
- ``Dense+Mask``: the dense table times a fixed 0/1 mask (the usual way to train a sparse
  embedding), with Adam.
- ``snack``: ``snack.SparseEmbedding`` at the same sparsity with Adam.
- ``snack, sparse grad``: ``snack.SparseEmbedding(sparse=True)`` with ``SparseAdam``: the gradient
  holds the connections of the rows looked up, and Adam steps only those.

Adam runs with ``fused=True`` (one pass over each parameter; ``SparseAdam`` has no fused form):
the default multi-tensor Adam took 8.5 ms a step on the 3.86 M values of the 90% table, the
fused one 1.2 ms, which made snack's step at 1,024 tokens 3.6 ms instead of 10.8.

All variants run in one process, interleaved sample by sample; the figures are medians. The
memory column is the table (values and indices for snack, the mask for Dense+Mask) plus Adam's
two moments, as allocated after the timed steps.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import snack
from snack.bench.page_faults import keep_freed_memory
from snack.bench.report import ResultLines, out_argument
from snack.bench.timing import interleaved_medians

VOCABULARY, WIDTH = 50_257, 768
TOKENS = [(8, 1024), (1, 1024)]  # (sequences, length)
SPARSITIES = [0.9, 0.99]
SAMPLES = 7
OUT = Path(__file__).with_name("embedding_step.txt")


class _DenseTimesMask(nn.Module):
    """A dense table times a fixed 0/1 mask of the sparse layer's connections."""

    def __init__(self, sparse: snack.SparseEmbedding):
        super().__init__()
        self.weight = nn.Parameter(sparse.to_dense().detach().clone())
        self.register_buffer("mask", self.weight.detach() != 0)

    def forward(self, ids):
        return F.embedding(ids, self.weight * self.mask)


def _step(module: nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor, grad: torch.Tensor):
    def run() -> None:
        optimizer.zero_grad(set_to_none=True)
        module(ids).backward(grad)
        optimizer.step()

    return run


def state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of ``module``'s parameters and buffers and of ``optimizer``'s per-element state."""
    tensors = [*module.parameters(), *module.buffers()]
    tensors += [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t) and t.dim()]
    return sum(t.numel() * t.element_size() for t in tensors)


def medians_and_memory(variants: dict, device: torch.device, samples: int) -> tuple[dict, dict]:
    """``({name: ms}, {name: MiB})`` of ``variants`` ``{name: (step, module, optimizer)}``: each
    step's median over ``samples`` interleaved runs, and its module's and optimizer's state."""
    seconds = interleaved_medians({name: run for name, (run, _, _) in variants.items()}, device, samples)
    ms = {name: value * 1e3 for name, value in seconds.items()}
    mib = {name: state_bytes(module, optimizer) / 2**20 for name, (_, module, optimizer) in variants.items()}
    return ms, mib


def _variants(sparsity: float, ids: torch.Tensor) -> dict:
    sparse = snack.SparseEmbedding(VOCABULARY, WIDTH, sparsity=sparsity)
    dense, dense_sparse_grad = nn.Embedding(VOCABULARY, WIDTH), nn.Embedding(VOCABULARY, WIDTH, sparse=True)
    masked = _DenseTimesMask(sparse)
    sparse_grad = copy.deepcopy(sparse)
    sparse_grad.sparse = True
    grad = torch.randn(*ids.shape, WIDTH)
    optimizers = {
        "dense": (dense, torch.optim.Adam(dense.parameters(), lr=1e-3, fused=True)),
        "dense, sparse grad": (dense_sparse_grad, torch.optim.SparseAdam(dense_sparse_grad.parameters(), lr=1e-3)),
        "Dense+Mask": (masked, torch.optim.Adam(masked.parameters(), lr=1e-3, fused=True)),
        "snack": (sparse, torch.optim.Adam(sparse.parameters(), lr=1e-3, fused=True)),
        "snack, sparse grad": (sparse_grad, torch.optim.SparseAdam(sparse_grad.parameters(), lr=1e-3)),
    }
    return {name: (_step(module, optimizer, ids, grad), module, optimizer) for name, (module, optimizer) in
            optimizers.items()}


def main() -> None:
    out = out_argument(__doc__, OUT)
    # the dense table's 154 MB gradient would otherwise be fresh memory in most steps, faulted in a
    # page at a time (snack.bench.page_faults); the results' machine line says it is kept
    keep_freed_memory()
    torch.manual_seed(0)
    device = torch.device("cpu")
    lines = ResultLines(device)
    lines(f"Training step (lookup, backward, fused Adam; SparseAdam for sparse grad) of a {VOCABULARY:,}×{WIDTH} "
          "token embedding; medians of "
          f"{SAMPLES} interleaved samples, ms; memory: table + Adam state, MiB")
    lines("")
    names = ["dense", "dense, sparse grad", "Dense+Mask", "snack", "snack, sparse grad"]
    lines("| tokens | sparsity | " + " | ".join(f"{name} ms" for name in names)
          + " | snack vs dense | snack vs dense, sparse grad | "
          + " | ".join(f"{name} MiB" for name in names) + " |")
    lines("|---" * (4 + 2 * len(names)) + "|")
    for sequences, length in TOKENS:
        for sparsity in SPARSITIES:
            ids = torch.randint(0, VOCABULARY, (sequences, length))
            variants = _variants(sparsity, ids)
            ms, mib = medians_and_memory(variants, device, SAMPLES)
            lines(
                f"| {sequences}×{length} | {sparsity} | " + " | ".join(f"{ms[n]:.1f}" for n in names)
                + f" | {ms['dense'] / ms['snack']:.1f}× "
                + f"| {ms['dense, sparse grad'] / ms['snack']:.1f}× | "
                + " | ".join(f"{mib[n]:.1f}" for n in names) + " |"
            )
            del variants
    lines.save(out)


if __name__ == "__main__":
    main()
