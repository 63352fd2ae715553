"""What a topology update costs: a training step with a SET, RigL, SRigL or MEST update against one without.

Usage: ``.venv/bin/python benchmarks/dst_update.py`` (about 30 s); writes
``benchmarks/dst_update.txt``, which the README quotes. ``--device cuda --out FILE`` measures on a
GPU (``benchmarks/gpu_check.sh`` does).

Each case is one SparseLinear trained with Adam (``fused=True``, as the README advises) at batch
32: a plain training step (forward, backward, optimizer step), and the same step followed by an
update (``dst.step()`` with ``update_every=1``, replacing a constant 30% of the connections,
RigL's default fraction; MEST's with a hard bound and its drop score ``|w| + 0.1·|∂L/∂w|``). The
update's cost is the difference, also given in plain training steps: with ``update_every=N`` an
update adds that many steps' worth of time every N steps. The four variants run in one process, interleaved sample by sample, with the lead-in of
:class:`snack.bench.timing.Timer`; the figures are medians over the samples.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import snack
from snack.bench.provenance import machine_line, utc_stamp
from snack.bench.timing import interleaved_medians

CASES = [(4096, 4096, 0.9), (4096, 4096, 0.99), (768, 3072, 0.9)]  # (out, in, sparsity)
BATCH, DROP_FRACTION, SAMPLES = 32, 0.3, 7
ALGORITHMS = {
    "SET": snack.dst.SET,
    "RigL": snack.dst.RigL,
    # RigL's drop balanced per row, each row's regrowth its own pick (the layer's rows come with
    # varying counts: the first update balances them, later ones keep them)
    "SRigL": snack.dst.SRigL,
    # with its neuron ablation at the reference code's γ_sal: RigL's growth is scored first
    "SRigL γ=0.3": lambda *args, **kwargs: snack.dst.SRigL(*args, ablation=0.3, **kwargs),
    # replacing DROP_FRACTION below the target and growing nothing above it, as SET does, but
    # dropping by the score that adds the active connections' gradient
    "MEST": lambda *args, **kwargs: snack.dst.MEST(*args, extra_fraction=0.0, gradient_weight=0.1, **kwargs),
}
OUT = Path(__file__).with_name("dst_update.txt")


def _variant(out_features: int, in_features: int, sparsity: float, algorithm, device: torch.device):
    """One training step of a fresh layer (and its update by ``algorithm``, unless ``None``)."""
    layer = snack.SparseLinear(in_features, out_features, sparsity=sparsity, device=device)
    optimizer = torch.optim.Adam(layer.parameters(), lr=1e-3, fused=True)
    dst = None
    if algorithm is not None:
        dst = algorithm(
            layer, optimizer, drop_fraction=DROP_FRACTION, update_every=1, total_steps=10**9, schedule="constant"
        )
    x, dy = torch.randn(BATCH, in_features, device=device), torch.randn(BATCH, out_features, device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        layer(x).backward(dy)
        optimizer.step()
        if dst is not None:
            dst.step()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=torch.device, default=torch.device("cpu"), help="cpu (default) or cuda")
    parser.add_argument("--out", type=Path, default=OUT, help=f"the results file (default {OUT})")
    args = parser.parse_args()
    torch.manual_seed(0)
    algorithms = {"step": None, **ALGORITHMS}
    lines = [
        f"{utc_stamp()} · {machine_line(args.device)}",
        f"SparseLinear + Adam, batch {BATCH}, {DROP_FRACTION:.0%} of the connections replaced per update, "
        f"medians of {SAMPLES} interleaved samples; update = (step with update) - (step)",
        "",
        "| layer (out×in) | sparsity | training step ms | "
        + " | ".join(f"{name} update ms" for name in ALGORITHMS) + " | "
        + " | ".join(f"{name} update, in steps" for name in ALGORITHMS) + " |",
        "|---" * (3 + 2 * len(ALGORITHMS)) + "|",
    ]
    for out_features, in_features, sparsity in CASES:
        steps = {name: _variant(out_features, in_features, sparsity, a, args.device) for name, a in algorithms.items()}
        ms = {name: seconds * 1e3 for name, seconds in interleaved_medians(steps, args.device, SAMPLES).items()}
        updates = [ms[name] - ms["step"] for name in ALGORITHMS]
        lines.append(
            f"| {out_features}×{in_features} | {sparsity} | {ms['step']:.2f} | "
            + " | ".join(f"{update:.1f}" for update in updates) + " | "
            + " | ".join(f"{update / ms['step']:.0f}" for update in updates) + " |"
        )
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text, end="")
    args.out.write_text(text)


if __name__ == "__main__":
    main()
