"""The recurrent steps' elementwise cells on the native kernels against the torch calls they replaced.

Usage: ``.venv/bin/python benchmarks/recurrent_cells.py`` (about a minute); writes
``benchmarks/recurrent_cells.txt``, which the README quotes.

:func:`snack.nn.recurrent_cells.lstm_cell` and ``gru_cell`` (one native pass each way, one autograd
node) against ``lstm_cell_reference`` and ``gru_cell_reference`` (the torch calls, about a dozen
ops and nodes each way), float32:

1. the cells alone, chains of 16 steps (each step's state the next one's, as in a recurrent
   layer) forward and backward (``training``: one backward for the chain) and forward without
   grad, at the shapes of ``snack train --model lstm`` (batch 32, hidden 256), of
   ``benchmarks/lstm_step.py`` (20, 1500) and at batch 1;
2. whole ``SparseLSTM`` and ``SparseGRU`` modules (2 layers of 256 at 90%, 64 steps of batch 32:
   ``snack train --model lstm``'s recurrence), forward and backward, and a no-grad forward, with
   each cell path; and what autograd keeps for the backward.

Each table's variants are timed interleaved sample by sample in one process
(:func:`snack.bench.timing.interleaved_medians`), as medians.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from unittest import mock

import torch

import snack
from snack.bench.report import ResultLines, out_argument
from snack.bench.timing import interleaved_medians
from snack.nn import recurrent_cells as cells

CELL_SHAPES = ((32, 256), (20, 1500), (1, 256))  # (batch, hidden)
CHAIN = 16
MODULE_WIDTH, MODULE_LAYERS, MODULE_STEPS, MODULE_BATCH, SPARSITY = 256, 2, 64, 32, 0.9
SAMPLES = 7
OUT = Path(__file__).with_name("recurrent_cells.txt")


def _chain_inputs(name: str, n: int, h: int) -> tuple[list[tuple[torch.Tensor, ...]], torch.Tensor]:
    """The gate inputs of each step of a chain of cells (``(n, G·h)`` leaves: the LSTM's ``pre``,
    the GRU's ``gx`` and ``gh``) and the first state ``(n, h)``."""
    widths = (4 * h,) if name == "LSTM" else (3 * h, 3 * h)
    steps = [tuple(torch.randn(n, w, requires_grad=True) for w in widths) for _ in range(CHAIN)]
    return steps, torch.randn(n, h, requires_grad=True)


def _chain(name: str, cell, steps, state) -> list[torch.Tensor]:
    """``CHAIN`` cells one after the other, each step's state the next one's: every step's ``h``,
    and the LSTM's last ``c``."""
    hs = []
    if name == "LSTM":
        c = state
        for (pre,) in steps:
            h, c = cell(pre, c)
            hs.append(h)
        return [*hs, c]
    h = state
    for gx, gh in steps:
        h = cell(gx, gh, h)
        hs.append(h)
    return hs


def _training(name, cell, inputs):
    steps, state = inputs
    leaves = [state, *(t for step in steps for t in step)]

    def run():
        for leaf in leaves:
            leaf.grad = None  # each run's gradients are new tensors, as a first backward's are
        outputs = _chain(name, cell, steps, state)
        torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])

    return run


def _inference(name, cell, inputs):
    def run():
        with torch.no_grad():
            _chain(name, cell, *inputs)

    return run


def _torch_calls():
    """Inside it, the modules run their cells as the torch calls (what they ran before the kernels)."""
    return mock.patch.object(cells, "_native", lambda *tensors: False)


def _module_step(module, x, *, train: bool, cells_as_torch_calls: bool):
    def run():
        with _torch_calls() if cells_as_torch_calls else contextlib.nullcontext():
            if train:
                module(x)[0].sum().backward()
            else:
                with torch.no_grad():
                    module(x)

    return run


def _kept_for_backward_mb(module, x, cells_as_torch_calls: bool) -> float:
    """MB of the tensors autograd keeps from a training forward (each storage once; parameters,
    buffers and the input not counted)."""
    known = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers(), x)}
    saved = {}

    def keep(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in known:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with _torch_calls() if cells_as_torch_calls else contextlib.nullcontext():
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            output = module(x)[0]  # alive until the sum: no saved storage is freed and reused
        mb = sum(saved.values()) / 2**20
    del output
    return mb


def main() -> None:
    out = out_argument(__doc__, OUT)
    torch.manual_seed(0)
    device = torch.device("cpu")
    emit = ResultLines(device)
    emit(f"float32, {torch.get_num_threads()} threads; medians of {SAMPLES} interleaved samples; torch/kernel > 1: "
         "the kernels are faster")  # fmt: skip
    emit("")
    emit(f"The cells alone: chains of {CHAIN} steps, each step's state the next one's, one backward for the chain "
         "(µs per step):")  # fmt: skip
    emit("")
    emit("| cell | batch × hidden | training: kernel | torch calls | torch/kernel | inference: kernel | torch calls "
         "| torch/kernel |")  # fmt: skip
    emit("|---|---|---|---|---|---|---|---|")
    cell_paths = {"LSTM": (cells.lstm_cell, cells.lstm_cell_reference),
                  "GRU": (cells.gru_cell, cells.gru_cell_reference)}  # fmt: skip
    for name, (kernel, reference) in cell_paths.items():
        for n, h in CELL_SHAPES:
            inputs = _chain_inputs(name, n, h)
            us = {key: s / CHAIN * 1e6 for key, s in interleaved_medians({
                (task, variant): run(name, cell, inputs)
                for task, run in (("training", _training), ("inference", _inference))
                for variant, cell in (("kernel", kernel), ("torch", reference))
            }, device, SAMPLES).items()}  # fmt: skip
            row = [f"{name} | {n} × {h}"]
            for task in ("training", "inference"):
                k, t = us[(task, "kernel")], us[(task, "torch")]
                row.append(f"{k:.1f} | {t:.1f} | {t / k:.2f}")
            emit(f"| {' | '.join(row)} |")
    emit("")
    emit(f"Whole modules: {MODULE_LAYERS} layers of {MODULE_WIDTH} at sparsity {SPARSITY}, {MODULE_STEPS} steps × "
         f"batch {MODULE_BATCH} (ms per call; training = forward and backward):")  # fmt: skip
    emit("")
    emit("| module | training: kernel | torch calls | torch/kernel | inference: kernel | torch calls | torch/kernel "
         "| kept for backward MB: kernel | torch calls |")  # fmt: skip
    emit("|---|---|---|---|---|---|---|---|---|")
    x = torch.randn(MODULE_STEPS, MODULE_BATCH, MODULE_WIDTH, requires_grad=True)
    for cls in (snack.SparseLSTM, snack.SparseGRU):
        module = cls(MODULE_WIDTH, MODULE_WIDTH, MODULE_LAYERS, sparsity=SPARSITY)
        ms = {(train, torch_calls): s * 1e3 for (train, torch_calls), s in interleaved_medians({
            (train, torch_calls): _module_step(module, x, train=train, cells_as_torch_calls=torch_calls)
            for train in (True, False) for torch_calls in (False, True)
        }, device, SAMPLES).items()}  # fmt: skip
        row = [cls.__name__]
        for train in (True, False):
            k, t = ms[(train, False)], ms[(train, True)]
            row.append(f"{k:.2f} | {t:.2f} | {t / k:.2f}")
        kept = [_kept_for_backward_mb(module, x, torch_calls) for torch_calls in (False, True)]
        row.append(f"{kept[0]:.1f} | {kept[1]:.1f}")
        emit(f"| {' | '.join(row)} |")
    emit.save(out)


if __name__ == "__main__":
    main()
