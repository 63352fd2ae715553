"""A training step of GPT-2's tied token embedding and output layer: snack.SparseEmbedding with
snack.SparseTiedHead against nn.Embedding with an nn.Linear sharing its weight.

Usage: ``.venv/bin/python benchmarks/tied_head_step.py`` (about two minutes); writes
``benchmarks/tied_head_step.txt``, which the README quotes.

The table is GPT-2's (50,257 tokens × 768, drawn as GPT-2 draws it: std 0.02, a sparse table's
values scaled to the same root mean square as ``sparsify(init="random")`` does), used twice per
step as in GPT-2: a sequence of token ids is looked up, and its rows, layer-normalised as GPT-2's
final ``ln_f`` leaves the transformer's output (the blocks between cost the same in every
variant), are turned into logits by the same table, ``h · tableᵀ``; then cross-entropy against
the next tokens, backward, and a fused Adam step. The logits and their gradient, ``(tokens,
50,257)``, exist in every variant; their standard deviation is about 0.55, as a fresh GPT-2's
(at ``nn.Embedding``'s default scale, std 1, without the normalisation, it was about 28).

- ``dense``: ``nn.Embedding`` and ``nn.Linear`` with ``lm_head.weight = wte.weight``.
- ``Dense+Mask``: the dense table times a fixed 0/1 mask, for both uses.
- ``snack``: ``snack.SparseEmbedding`` at the same sparsity and ``snack.SparseTiedHead`` of it.

All variants run in one process, interleaved sample by sample; the figures are medians. The
memory column is the table (values and indices for snack, the mask for Dense+Mask) plus Adam's
two moments, as allocated after the timed steps.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from embedding_step import medians_and_memory  # (this script's folder)
from torch import nn

import snack
from snack.bench.page_faults import keep_freed_memory
from snack.bench.report import ResultLines, out_argument

VOCABULARY, WIDTH = 50_257, 768
TOKENS = [128, 512]  # one sequence of this length
SPARSITIES = [0.9, 0.99]
SAMPLES = 5
GPT2_STD = 0.02  # GPT-2's token table is drawn N(0, 0.02²)
OUT = Path(__file__).with_name("tied_head_step.txt")


class _Tied(nn.Module):
    """``ids (T,)`` → logits ``(T, vocabulary)`` through ``embedding`` and ``head`` (tied)."""

    def __init__(self, embedding: nn.Module, head: nn.Module):
        super().__init__()
        self.embedding, self.head = embedding, head

    def forward(self, ids):
        return self.head(F.layer_norm(self.embedding(ids), (WIDTH,)))


class _DenseTimesMask(nn.Module):
    """A dense table times a fixed 0/1 mask of the sparse layer's connections, for both uses."""

    def __init__(self, sparse: snack.SparseEmbedding):
        super().__init__()
        self.weight = nn.Parameter(sparse.to_dense().detach().clone())
        self.register_buffer("mask", self.weight.detach() != 0)

    def forward(self, ids):
        table = self.weight * self.mask
        return F.linear(F.layer_norm(F.embedding(ids, table), (WIDTH,)), table)


def _dense_tied() -> nn.Module:
    embedding, head = nn.Embedding(VOCABULARY, WIDTH), nn.Linear(WIDTH, VOCABULARY, bias=False)
    nn.init.normal_(embedding.weight, std=GPT2_STD)
    head.weight = embedding.weight
    return _Tied(embedding, head)


def _step(module: nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor, targets: torch.Tensor):
    def run() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(module(ids), targets).backward()
        optimizer.step()

    return run


def _variants(sparsity: float, tokens: int) -> dict:
    sparse_embedding = snack.SparseEmbedding(VOCABULARY, WIDTH, sparsity=sparsity)
    with torch.no_grad():
        sparse_embedding.values.mul_(GPT2_STD)  # (its own init has nn.Embedding's root mean square, 1)
    modules = {
        "dense": _dense_tied(),
        "Dense+Mask": _DenseTimesMask(sparse_embedding),
        "snack": _Tied(sparse_embedding, snack.SparseTiedHead(sparse_embedding)),
    }
    ids = torch.randint(0, VOCABULARY, (tokens + 1,))
    inputs, targets = ids[:-1], ids[1:]
    variants = {}
    for name, module in modules.items():
        optimizer = torch.optim.Adam(module.parameters(), lr=1e-3, fused=True)
        variants[name] = (_step(module, optimizer, inputs, targets), module, optimizer)
    return variants


def main() -> None:
    out = out_argument(__doc__, OUT)
    # the dense table's 154 MB gradient would otherwise be fresh memory in most steps, faulted in a
    # page at a time (snack.bench.page_faults); the results' machine line says it is kept
    keep_freed_memory()
    torch.manual_seed(0)
    device = torch.device("cpu")
    lines = ResultLines(device)
    lines(f"Training step (lookup, tied head, cross-entropy, backward, fused Adam) of a {VOCABULARY:,}×{WIDTH} "
          f"table used as GPT-2's token embedding and output layer; medians of {SAMPLES} interleaved samples, ms; "
          "memory: table + Adam state, MiB")
    lines("")
    names = ["dense", "Dense+Mask", "snack"]
    lines("| tokens | sparsity | " + " | ".join(f"{name} ms" for name in names)
          + " | snack vs dense | vs Dense+Mask | " + " | ".join(f"{name} MiB" for name in names) + " |")
    lines("|---" * (4 + 2 * len(names)) + "|")
    for tokens in TOKENS:
        for sparsity in SPARSITIES:
            variants = _variants(sparsity, tokens)
            ms, mib = medians_and_memory(variants, device, SAMPLES)
            lines(
                f"| {tokens} | {sparsity} | " + " | ".join(f"{ms[n]:.1f}" for n in names)
                + f" | {ms['dense'] / ms['snack']:.1f}× | {ms['Dense+Mask'] / ms['snack']:.1f}× | "
                + " | ".join(f"{mib[n]:.1f}" for n in names) + " |"
            )
            del variants
    lines.save(out)


if __name__ == "__main__":
    main()
