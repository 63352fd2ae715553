"""The ``snack`` command. Each subcommand lives in its own module, which provides
``add_arguments(parser)`` and ``run(args) -> int``; modules are imported only when used."""

from __future__ import annotations

import argparse
import importlib
import sys

import torch

import snack

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": (
        "snack.train",
        "train a sparse MLP, CNN or ViT on MNIST digits, or a character-level GPT or LSTM on Shakespeare, with "
        "dynamic sparse training (RigL, SET, SRigL, GraNet, MEST)",
    ),
    "compile-check": (
        "snack.backends.triton.compile_check",
        "compile every Triton kernel ahead of time for the given GPU architectures (no GPU needed)",
    ),
    "bench": ("snack.bench.cli", "benchmark sparse layers against dense, dense+mask and torch.sparse"),
}


def device_argument(text: str) -> torch.device:
    """An argparse ``type`` for ``--device``: ``cpu`` or ``cuda[:N]``."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"device must be cpu or cuda[:N], got {text!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"device must be cpu or cuda[:N], got {text!r}")
    return device


def whole_number(low: int, high: int | None = None):
    """An argparse ``type``: a whole number in ``[low, high)`` (no upper bound for ``None``)."""
    if high is None:
        bounds = f">= {low}"
    else:  # a large power of two as one (2**63, not 9223372036854775808)
        shown = f"2**{high.bit_length() - 1}" if high > 1 << 16 and high & (high - 1) == 0 else str(high)
        bounds = f"in [{low}, {shown})"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number {bounds}, got {text!r}") from None
        if value < low or (high is not None and value >= high):
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return value

    return parse


positive_int = whole_number(1)


def sparsity_argument(text: str) -> float:
    """An argparse ``type``: a sparsity in ``[0, 1)``."""
    from snack.topology import check_sparsity

    try:
        return check_sparsity(float(text))
    except (TypeError, ValueError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def unavailable_device(command: str, device: torch.device) -> bool:
    """True, after saying so on stderr, when ``device`` is a CUDA device this machine lacks."""
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"snack {command}: --device {device} but CUDA is not available", file=sys.stderr)
        return True
    return False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="snack", description="Truly sparse neural networks for PyTorch.")
    parser.add_argument(
        "--version", action="version", version=f"snack {snack.__version__} (torch {torch.__version__})"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_path, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_path)
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(sub_parser)
        sub_parser.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args._argv = argv  # what was asked, for results that record their command line
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C: a line, not a traceback (bench leaves its previous files whole)
        print(f"\nsnack {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
