"""What an EMA of a sparse model costs: snack.AveragedModel against torch's, and the alignment after a rewire.

Usage: ``.venv/bin/python benchmarks/averaging.py`` (about a minute); writes
``benchmarks/averaging.txt``, which the README quotes.

One SparseLinear per case. ``update`` is ``update_parameters`` of an EMA
(``get_ema_multi_avg_fn(0.999)``) whose copy already has the model's topology: torch's
``AveragedModel`` (which also copies ``row``/``col`` on every call) and snack's (which notices
them unchanged). ``align`` is :func:`snack.align_topology` of a copy to a topology of which 30%
of the connections are new (RigL's default drop fraction), what ``update_parameters`` adds after
a rewire: natively on the CPU, and with the torch calls it falls back to elsewhere
(``use_backend("reference")``, a binary search per connection). The copy aligns to two such
topologies in turn, so every call changes it. All variants run in one process, interleaved
sample by sample; the figures are medians over the samples.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import snack
from snack.bench.report import ResultLines, out_argument
from snack.bench.timing import interleaved_medians

CASES = [(4096, 4096, 0.9), (4096, 4096, 0.99), (768, 3072, 0.9)]  # (out, in, sparsity)
NEW_FRACTION, SAMPLES = 0.3, 9
OUT = Path(__file__).with_name("averaging.txt")


def _rewired(layer: snack.SparseLinear, generator: torch.Generator) -> snack.SparseLinear:
    """A copy of ``layer`` with ``NEW_FRACTION`` of its connections moved to random free positions."""
    other = copy.deepcopy(layer)
    drop = torch.randperm(layer.nnz, generator=generator)[: int(layer.nnz * NEW_FRACTION)]
    size = layer.out_features * layer.in_features
    grow = torch.randint(size, (2 * drop.numel(),), generator=generator).unique()  # most of them free
    optimizer = torch.optim.SGD(other.parameters(), lr=0.0)
    held = torch.zeros(size, dtype=torch.bool)  # (a benchmark's dense mask, not the library's)
    held[layer.row.long() * layer.in_features + layer.col.long()] = True
    grow = grow[~held[grow]][: drop.numel()]
    snack.dst.rewire(other, optimizer, drop, grow, grow_values=torch.randn(grow.numel(), generator=generator))
    return other


def _variants(out_features: int, in_features: int, sparsity: float) -> tuple[dict, int]:
    """The four calls timed (name -> call) and the layer's nnz."""
    generator = torch.Generator().manual_seed(out_features + in_features)
    model = snack.SparseLinear(in_features, out_features, sparsity=sparsity)
    others = [_rewired(model, generator), _rewired(model, generator)]
    torchs = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))
    ours = snack.AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))
    aligned = copy.deepcopy(model)
    turn = [0]

    def align() -> None:
        turn[0] ^= 1
        snack.align_topology(aligned, others[turn[0]])

    def align_in_torch() -> None:
        with snack.use_backend("reference"):
            align()

    return {
        "torch update": lambda: torchs.update_parameters(model),
        "snack update": lambda: ours.update_parameters(model),
        "align": align,
        "align, torch calls": align_in_torch,
    }, model.nnz


def main() -> None:
    out = out_argument(__doc__, OUT)
    torch.manual_seed(0)
    device = torch.device("cpu")
    lines = ResultLines(device)
    lines(f"EMA update_parameters of one SparseLinear; align: to a topology {NEW_FRACTION:.0%} new; "
          f"medians of {SAMPLES} interleaved samples, ms")
    lines("")
    names = ["torch update", "snack update", "align", "align, torch calls"]
    lines("| layer (out×in) | sparsity | nnz | " + " | ".join(f"{name} ms" for name in names) + " |")
    lines("|---" * (3 + len(names)) + "|")
    for out_features, in_features, sparsity in CASES:
        variants, nnz = _variants(out_features, in_features, sparsity)
        ms = {name: seconds * 1e3 for name, seconds in interleaved_medians(variants, device, SAMPLES).items()}
        lines(f"| {out_features}×{in_features} | {sparsity} | {nnz:,} | " + " | ".join(f"{ms[n]:.2f}" for n in names)
              + " |")
    lines.save(out)


if __name__ == "__main__":
    main()
