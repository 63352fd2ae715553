"""Benchmark output: the terminal table, JSON and CSV files, and the speedup plot."""

from __future__ import annotations

import argparse
import csv
import json
import math
import textwrap
from dataclasses import asdict, fields
from pathlib import Path

import torch

from snack.bench.harness import MemoryRecord, TimeRecord, select
from snack.bench.provenance import machine_line, utc_stamp
from snack.bench.timing import interleaved_medians

__all__ = [
    "ResultLines", "compare_and_save", "format_comparison", "format_faults", "format_memory", "format_table",
    "out_argument", "write_csv", "write_json", "write_plot",
]


def _size_label(out_features: int, in_features: int) -> str:
    return f"{out_features}x{in_features}"


def format_table(times: list[TimeRecord]) -> str:
    """Markdown table: per point, dense time, each variant's speedup over dense, snack's
    speedup over dense+mask, its roofline bound and distance. Each median is followed by its
    interquartile range relative to the median."""
    header = (
        "| size | mode | sparsity | batch | dense ms | dense+mask × | torch.sparse × | snack × | snack vs mask × "
        "| snack ms (IQR) | bound ms | distance |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    snack_rows = select(times, variant="snack")
    for row in snack_rows:
        point = dict(out_features=row.out_features, in_features=row.in_features, sparsity=row.sparsity,
                     batch=row.batch, mode=row.mode)
        by_variant = {r.variant: r for r in select(times, **point)}
        dense = by_variant["dense"]
        spread = (row.q75_ms - row.q25_ms) / row.median_ms
        lines.append(
            f"| {_size_label(row.out_features, row.in_features)} | {row.mode} | {row.sparsity:g} | {row.batch} "
            f"| {dense.median_ms:.3f} | {by_variant['dense+mask'].speedup_vs_dense:.2f} "
            f"| {by_variant['torch.sparse'].speedup_vs_dense:.2f} | **{row.speedup_vs_dense:.1f}** "
            f"| {row.speedup_vs_mask:.1f} | {row.median_ms:.3f} (±{100 * spread / 2:.0f}%) "
            f"| {row.bound_ms:.3f} | {row.distance:.2f} |"
        )
    return "\n".join(lines)


def format_faults(times: list[TimeRecord]) -> str:
    """One line: each variant's most minor page faults per call over the points, and where (a
    fresh block of memory faults in a page at a time; see :mod:`snack.bench.page_faults`)."""
    parts = []
    for variant in dict.fromkeys(t.variant for t in times):
        counted = [t for t in select(times, variant=variant) if not math.isnan(t.faults_per_call)]
        if not counted:
            continue
        worst = max(counted, key=lambda t: t.faults_per_call)
        count = worst.faults_per_call
        where = f" ({_size_label(worst.out_features, worst.in_features)} {worst.mode}, B={worst.batch})"
        parts.append(f"{variant} {count:,.{0 if count >= 10 or count == 0 else 1}f}" + (where if count else ""))
    if not parts:
        return "Page faults per call: not counted on this platform."
    return "Most minor page faults per call (fresh memory, mapped in a page at a time): " + ", ".join(parts) + "."


def format_memory(memory: list[MemoryRecord]) -> str:
    """Markdown table of training memory (MiB) per layer and variant."""
    lines = [
        "| size | sparsity | variant | params | grads | Adam | structure | total MiB | vs dense |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    mib = 2**20
    for m in memory:
        lines.append(
            f"| {_size_label(m.out_features, m.in_features)} | {m.sparsity:g} | {m.variant} | {m.params / mib:.2f} "
            f"| {m.grads / mib:.2f} | {m.adam / mib:.2f} | {m.structure / mib:.2f} | {m.total / mib:.2f} "
            f"| {-100 * m.reduction_vs_dense:+.1f}% |"
        )
    return "\n".join(lines)


def write_json(path: Path, metadata: dict, times: list[TimeRecord], memory: list[MemoryRecord]) -> None:
    """Strict JSON: a figure that does not apply to a variant (NaN in the records) is ``null``."""
    document = {**metadata, "times": [asdict(t) for t in times], "memory": [asdict(m) for m in memory]}
    path.write_text(json.dumps(_nan_as_null(document), indent=1, allow_nan=False) + "\n")


def _nan_as_null(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {key: _nan_as_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_nan_as_null(item) for item in value]
    return value


def write_csv(path: Path, times: list[TimeRecord]) -> None:
    """One row per (point, variant); the raw samples stay in the JSON."""
    columns = [f.name for f in fields(TimeRecord) if f.name != "samples_ms"]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for t in times:
            writer.writerow({c: getattr(t, c) for c in columns})


def write_plot(path: Path, times: list[TimeRecord], title: str) -> None:
    """Speedup over dense vs sparsity: one panel per (size, mode), one line per batch size for
    snack (solid) and torch.sparse (dashed, same colour)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    sizes = sorted({(t.out_features, t.in_features) for t in times}, reverse=True)
    modes = sorted({t.mode for t in times})
    batches = sorted({t.batch for t in times})
    figure, axes = plt.subplots(
        len(modes), len(sizes), figsize=(5 * len(sizes), 3.8 * len(modes)), squeeze=False, sharex=True
    )
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, mode in enumerate(modes):
        for j, (out_features, in_features) in enumerate(sizes):
            ax = axes[i][j]
            for b, batch in enumerate(batches):
                colour = colours[b % len(colours)]
                for variant, style in (("snack", "-o"), ("torch.sparse", "--x")):
                    rows = sorted(
                        select(times, out_features=out_features, in_features=in_features, mode=mode, batch=batch,
                               variant=variant),
                        key=lambda r: r.sparsity,
                    )
                    if rows:
                        ax.plot(
                            [r.sparsity for r in rows], [r.speedup_vs_dense for r in rows], style, color=colour,
                            label=f"{variant} B={batch}",
                        )
            ax.axhline(1.0, color="grey", linewidth=0.8)
            ax.set_yscale("log")
            ax.set_title(f"{_size_label(out_features, in_features)} {mode}")
            ax.set_xlabel("sparsity")
            ax.set_ylabel("speedup over dense nn.Linear")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, ncol=2)
    figure.suptitle(textwrap.fill(title, width=55 * len(sizes)), fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def format_comparison(
    setting: str, unit: str, names: tuple[str, str], medians: dict, cases: list[str], digits: int
) -> str:
    """The text the small benchmark scripts (``benchmarks/*_overhead.py``) print and save: a
    line with the time and machine, ``setting``, and a table of each case's medians
    (``medians[(case, name)]``, in ``unit``) for the two ``names`` and the second over the first."""
    first, second = names
    lines = [
        f"{utc_stamp()} · {machine_line(torch.device('cpu'))}",
        setting,
        "",
        f"| call | {first} {unit} | {second} {unit} | {second} / {first} |",
        "|---|---|---|---|",
    ]
    for case in cases:
        a, b = medians[(case, first)], medians[(case, second)]
        lines.append(f"| {case} | {a:.{digits}f} | {b:.{digits}f} | {b / a:.2f} |")
    return "\n".join(lines) + "\n"


def compare_and_save(
    calls: dict, variants: dict, *, samples: int, setting: str, unit: str, digits: int, out: Path
) -> None:
    """Time each of ``calls`` (name → ``run(variant)``) on both ``variants`` (name → object, the
    baseline first) on the CPU, interleaved (:func:`snack.bench.timing.interleaved_medians`);
    print the :func:`format_comparison` table (medians in ``unit``, ``"ms"`` or ``"µs"``) and
    save it to ``out``: what the small benchmark scripts (``benchmarks/*_overhead.py``) do."""
    cases = {
        (call, name): (lambda run=run, variant=variant: run(variant))
        for call, run in calls.items()
        for name, variant in variants.items()
    }
    scale = {"ms": 1e3, "µs": 1e6}[unit]
    medians = {key: value * scale for key, value in interleaved_medians(cases, torch.device("cpu"), samples).items()}
    text = format_comparison(setting, unit, tuple(variants), medians, list(calls), digits)
    print(text, end="")
    out.write_text(text)


def out_argument(doc: str, default: Path) -> Path:
    """The results file of a benchmark script: its ``--out`` argument (``default`` if not given);
    ``--help`` shows the first line of the script's docstring ``doc``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", type=Path, default=default, help=f"the results file (default {default})")
    return parser.parse_args().out


class ResultLines:
    """A results file's lines, printed as they come (a long run shows its progress); call with each
    line, then :meth:`save`. The first line dates the run and names the machine ``device``."""

    def __init__(self, device: torch.device):
        self.lines: list[str] = []
        self(f"{utc_stamp()} · {machine_line(device)}")

    def __call__(self, line: str) -> None:
        self.lines.append(line)
        print(line, flush=True)

    def save(self, path: Path) -> None:
        path.write_text("\n".join(self.lines) + "\n")
