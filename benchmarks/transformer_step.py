"""A transformer encoder sparsified by ``snack.sparsify``, attention included, against the dense one.

Usage: ``.venv/bin/python benchmarks/transformer_step.py`` (about two minutes); writes
``benchmarks/transformer_step.txt``, which the README quotes.

PyTorch's own ``nn.TransformerEncoder``: 4 layers of ``nn.TransformerEncoderLayer`` (width 512,
8 heads, feed-forward 2048, batch first, no dropout), on ``BATCH`` sequences of ``LENGTH`` tokens,
then a mean over tokens and a 10-way head; cross-entropy loss, float32. Sparsified uniformly
(``init="random"``) at 90% and 95%: whole (``SparseMultiheadAttention``'s four projections and
the feed-forward layers), and at 90% with ``exclude="*self_attn"``, the feed-forward layers alone
(what ``sparsify`` converted before it converted attention). Each variant's times interleaved
sample by sample in one process (:func:`snack.bench.timing.interleaved_medians`), as medians: a
training step (forward, backward, SGD with momentum), and a no-grad forward in eval mode with a
key padding mask (the dense model's takes PyTorch's fused nested-tensor fast path there; a
sparsified one takes the module path; with the attention dense, the fast path is turned off, as
``sparsify``'s warning says), and the weights' memory.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from resnet_step import memory_mb, model_variants  # (this script's folder)
from torch import nn

import snack
from snack.bench.report import ResultLines, out_argument
from snack.bench.timing import interleaved_medians

WIDTH, HEADS, FEED_FORWARD, LAYERS = 512, 8, 2048, 4
BATCH, LENGTH, CLASSES = 8, 32, 10
SAMPLES = 7
OUT = Path(__file__).with_name("transformer_step.txt")


class Classifier(nn.Module):
    """``(N, LENGTH, WIDTH)`` tokens → ``(N, CLASSES)`` logits through an ``nn.TransformerEncoder``."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, FEED_FORWARD, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=True)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x, padding=None):
        return self.head(self.encoder(x, src_key_padding_mask=padding).mean(dim=1))


def models() -> dict[str, nn.Module]:
    built = {"dense": Classifier()}
    for sparsity in (0.9, 0.95):
        built[f"snack {sparsity}"] = snack.sparsify(Classifier(), sparsity, exclude="head", init="random")
    with warnings.catch_warnings():  # that the fast path reads linear1.weight: variants() turns it off
        warnings.simplefilter("ignore")
        built["snack 0.9, attention dense"] = snack.sparsify(
            Classifier(), 0.9, exclude=["head", "*self_attn"], init="random"
        )
    return built


def variants(built: dict[str, nn.Module], x, padding, y) -> dict[str, dict]:
    """Per task ("training", "inference"), a callable per model: resnet_step's training steps,
    and inference with the key padding mask."""
    tasks = model_variants(built, x, y)
    for name, model in built.items():
        # the encoder layers' fused fast path reads linear1.weight: off where self_attn stays dense
        fast_path = name != "snack 0.9, attention dense"

        def infer(model=model, fast_path=fast_path):
            model.eval()
            torch.backends.mha.set_fastpath_enabled(fast_path)
            with torch.no_grad():
                model(x, padding)
            torch.backends.mha.set_fastpath_enabled(True)

        tasks["inference"][name] = infer
    return tasks


def main() -> None:
    out = out_argument(__doc__, OUT)
    warnings.filterwarnings("ignore", "The PyTorch API of nested tensors")  # the dense model's fast path
    torch.manual_seed(0)
    device = torch.device("cpu")
    emit = ResultLines(device)
    x = torch.randn(BATCH, LENGTH, WIDTH)
    padding = torch.zeros(BATCH, LENGTH, dtype=torch.bool)
    padding[BATCH // 2 :, LENGTH * 3 // 4 :] = True  # half the sequences a quarter shorter
    y = torch.randint(0, CLASSES, (BATCH,))
    emit(f"nn.TransformerEncoder: {LAYERS} layers, width {WIDTH}, {HEADS} heads, feed-forward {FEED_FORWARD}; "
         f"batch {BATCH} × {LENGTH} tokens, float32, {torch.get_num_threads()} threads; uniform sparsity, random "
         f"topology; medians of {SAMPLES} interleaved samples; dense/snack > 1: snack is faster")  # fmt: skip
    emit("")
    emit("| model | training ms | dense/snack | inference ms | dense/snack | weights MB |")
    emit("|---|---|---|---|---|---|")
    built = models()
    tasks = variants(built, x, padding, y)
    ms = {task: {name: s * 1e3 for name, s in interleaved_medians(fns, device, SAMPLES).items()}
          for task, fns in tasks.items()}  # fmt: skip
    dense_train, dense_infer = ms["training"]["dense"], ms["inference"]["dense"]
    for name, model in built.items():
        train, infer = ms["training"][name], ms["inference"][name]
        weights = memory_mb(model, x, y)[0]
        emit(f"| {name} | {train:.1f} | {dense_train / train:.2f} | {infer:.1f} | {dense_infer / infer:.2f} | "
             f"{weights:.1f} |")  # fmt: skip
    emit.save(out)


if __name__ == "__main__":
    main()
