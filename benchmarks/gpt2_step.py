"""GPT-2 small (``transformers``' ``GPT2LMHeadModel``, 124 M parameters) sparsified whole by
``snack.sparsify(..., embeddings=True)`` against the dense model: a training step, and greedy
decoding.

Usage: ``.venv/bin/python benchmarks/gpt2_step.py`` (about two minutes); writes
``benchmarks/gpt2_step.txt``, which the README quotes.

The model is GPT-2 small's configuration (12 blocks, width 768, 12 heads, 50,257 tokens, the
token embedding tied to the output layer), randomly initialised, dropout off. A step: one
sequence of ``LENGTH`` random tokens, the language-model loss (``labels=`` the tokens), backward,
and a fused AdamW step. Decoding: ``generate`` (greedy, with its key-value cache, no grad) of
``NEW_TOKENS`` tokens after a prompt of ``PROMPT``, one sequence: single-stream inference, where
each new token runs every layer at batch 1. Variants, sparsified uniformly with a random topology
(``init="random"``):

- ``dense``: the model as built.
- ``snack 0.9``, ``snack 0.95``: every weight matrix sparse: the attention and MLP projections
  (``Conv1D``), the position embedding, and the token embedding with the output layer tied to it
  (one ``SparseEmbedding`` and a ``SparseTiedHead``).
- ``snack 0.9, embeddings dense``: ``sparsify``'s default (``embeddings=False``): the blocks sparse,
  the 38.6 M-entry table and the head tied to it dense.

All variants run in one process, interleaved sample by sample; the figures are medians. Memory:
the parameters and buffers (snack's indices included) and AdamW's two moments, after the steps.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import transformers
from embedding_step import state_bytes  # (this script's folder)
from torch import nn

import snack
from snack.bench.page_faults import keep_freed_memory
from snack.bench.report import ResultLines, out_argument
from snack.bench.timing import interleaved_medians

LENGTH = 256
PROMPT, NEW_TOKENS = 32, 64
SAMPLES = 5
OUT = Path(__file__).with_name("gpt2_step.txt")


def gpt2_small() -> nn.Module:
    config = transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def models() -> dict[str, nn.Module]:
    built = {"dense": gpt2_small()}
    for sparsity in (0.9, 0.95):
        built[f"snack {sparsity}"] = snack.sparsify(gpt2_small(), sparsity, init="random", embeddings=True)
    with warnings.catch_warnings():  # that the tied lm_head stays dense: what this variant shows
        warnings.simplefilter("ignore")
        built["snack 0.9, embeddings dense"] = snack.sparsify(gpt2_small(), 0.9, init="random")
    return built


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor):
    def run() -> None:
        model.train()
        optimizer.zero_grad(set_to_none=True)
        model(tokens, labels=tokens).loss.backward()
        optimizer.step()

    return run


def _decode(model: nn.Module, prompt: torch.Tensor):
    def run() -> None:
        model.eval()
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                           pad_token_id=0)  # fmt: skip

    return run


def main() -> None:
    out = out_argument(__doc__, OUT)
    # the dense table's 154 MB gradient would otherwise be fresh memory in most steps, faulted in a
    # page at a time (snack.bench.page_faults); the results' machine line says it is kept
    keep_freed_memory()
    transformers.logging.set_verbosity_error()  # (the config's loss type notice)
    torch.manual_seed(0)
    device = torch.device("cpu")
    lines = ResultLines(device)
    built = models()
    tokens = torch.randint(0, 50_257, (1, LENGTH))
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True) for name, model in built.items()}
    steps = {name: _step(model, optimizers[name], tokens) for name, model in built.items()}
    ms = {name: s * 1e3 for name, s in interleaved_medians(steps, device, SAMPLES).items()}
    prompt = tokens[:, :PROMPT]
    decodes = {name: _decode(model, prompt) for name, model in built.items()}
    rate = {name: NEW_TOKENS / s for name, s in interleaved_medians(decodes, device, SAMPLES).items()}
    lines(f"GPT-2 small (transformers GPT2LMHeadModel, 12 × 768, 50,257 tokens, tied head), a training step "
          f"(1 × {LENGTH} tokens, LM loss, backward, fused AdamW) and greedy decoding ({NEW_TOKENS} tokens after "
          f"{PROMPT}, key-value cache), float32, {torch.get_num_threads()} threads; uniform sparsity, random "
          f"topology; medians of {SAMPLES} interleaved samples")  # fmt: skip
    lines("")
    lines("| model | training ms | dense/snack | decoding tokens/s | snack/dense | weights + AdamW MB |")
    lines("|---|---|---|---|---|---|")
    for name in built:
        mb = state_bytes(built[name], optimizers[name]) / 2**20
        lines(f"| {name} | {ms[name]:.0f} | {ms['dense'] / ms[name]:.2f} | {rate[name]:.1f} | "
              f"{rate[name] / rate['dense']:.2f} | {mb:.0f} |")  # fmt: skip
    lines.save(out)


if __name__ == "__main__":
    main()
