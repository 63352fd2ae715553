"""A 2-layer LSTM sparsified by ``snack.sparsify`` (``SparseLSTM``) against PyTorch's dense ``nn.LSTM``.

Usage: ``.venv/bin/python benchmarks/lstm_step.py`` (under a minute); writes
``benchmarks/lstm_step.txt``, which the README quotes.

The recurrent network of Selfish-RNN's Penn Treebank runs (Liu et al., 2021, dynamic sparse
training of LSTMs): 2 layers, input and hidden size 1500, sequences of 35 steps, batch 20. Here
``nn.LSTM`` on random inputs ``(35, 20, 1500)``, its output averaged over the steps into a dense
10-way head (cross-entropy), float32; the dense module runs PyTorch's fused CPU LSTM. Sparsified
uniformly (``init="random"``, the head left dense) at 90%, 95% and 99%. Each variant's times
interleaved sample by sample in one process (:func:`snack.bench.timing.interleaved_medians`), as
medians: a training step (forward, backward through time, SGD with momentum) and a no-grad
forward, the weights' memory and what autograd keeps for the backward.
"""

from __future__ import annotations

from pathlib import Path

import torch
from resnet_step import memory_mb, model_variants  # (this script's folder)
from torch import nn

import snack
from snack.bench.report import ResultLines, out_argument
from snack.bench.timing import interleaved_medians

WIDTH, LAYERS, STEPS, BATCH, CLASSES = 1500, 2, 35, 20, 10
SPARSITIES = (0.9, 0.95, 0.99)
SAMPLES = 5
OUT = Path(__file__).with_name("lstm_step.txt")


class SequenceClassifier(nn.Module):
    """``(STEPS, N, WIDTH)`` → ``(N, CLASSES)`` logits: an ``nn.LSTM``, its outputs' mean over
    the steps, a linear head."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(WIDTH, WIDTH, LAYERS)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        return self.head(self.lstm(x)[0].mean(dim=0))


def main() -> None:
    out = out_argument(__doc__, OUT)
    torch.manual_seed(0)
    device = torch.device("cpu")
    emit = ResultLines(device)
    x = torch.randn(STEPS, BATCH, WIDTH)
    y = torch.randint(0, CLASSES, (BATCH,))
    emit(f"nn.LSTM: {LAYERS} layers, input and hidden {WIDTH}; {STEPS} steps × batch {BATCH}, float32, "
         f"{torch.get_num_threads()} threads; uniform sparsity, random topology, head dense; medians of {SAMPLES} "
         "interleaved samples; dense/snack > 1: snack is faster")  # fmt: skip
    emit("")
    emit("| model | training ms | dense/snack | inference ms | dense/snack | weights MB | kept for backward MB |")
    emit("|---|---|---|---|---|---|---|")
    built = {"dense": SequenceClassifier()}
    for sparsity in SPARSITIES:
        built[f"snack {sparsity}"] = snack.sparsify(SequenceClassifier(), sparsity, exclude="head", init="random")
    tasks = model_variants(built, x, y)
    ms = {task: {name: s * 1e3 for name, s in interleaved_medians(fns, device, SAMPLES).items()}
          for task, fns in tasks.items()}  # fmt: skip
    dense_train, dense_infer = ms["training"]["dense"], ms["inference"]["dense"]
    for name, model in built.items():
        train, infer = ms["training"][name], ms["inference"][name]
        weights, kept = memory_mb(model, x, y)
        emit(f"| {name} | {train:.1f} | {dense_train / train:.2f} | {infer:.1f} | {dense_infer / infer:.2f} | "
             f"{weights:.1f} | {kept:.1f} |")  # fmt: skip
    emit.save(out)


if __name__ == "__main__":
    main()
