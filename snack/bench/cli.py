"""``snack bench``: the layer benchmark (dense, dense+mask, torch.sparse CSR, snack).

Writes ``<device>_layer.json``, ``<device>_layer.csv`` and ``<device>_speedup.png`` under
``--out`` and prints the tables (markdown) to the terminal.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
import tempfile
from pathlib import Path

import torch

from snack.backends import default_backend_name
from snack.bench.harness import MODES, Grid, run_grid
from snack.bench.page_faults import keep_freed_memory, keeps_freed_memory
from snack.bench.provenance import machine_line, utc_stamp
from snack.bench.report import format_faults, format_memory, format_table, write_csv, write_json, write_plot
from snack.bench.roofline import measure_machine
from snack.cli import device_argument, positive_int, sparsity_argument, unavailable_device
from snack.topology import MAX_INDEX, nnz_for_sparsity

__all__ = ["add_arguments", "run"]

FULL = dict(sizes=["4096x4096", "768x3072"], sparsity=[0.9, 0.95, 0.99], batch=[1, 8, 32, 128], repeats=7)
# What the tables say of a run whose allocator runs as shipped (the machine line names the default,
# "glibc keeps freed memory"; snack.bench.page_faults)
SHIPPED_ALLOCATOR = "; memory allocator as PyTorch ships it (glibc gives large freed blocks back to the system)"
QUICK = dict(sizes=["768x3072"], sparsity=[0.9, 0.99], batch=[1, 32], repeats=3)


def _limits(machine) -> str:
    """The measured limits in one line."""
    cache = ""
    if machine.cache_bytes:
        cache = f", {machine.cache_bandwidth / 1e9:.1f} GB/s reading a {machine.cache_bytes >> 20} MiB buffer (cache)"
    return f"copy bandwidth {machine.bandwidth / 1e9:.1f} GB/s{cache}, dense GEMM {machine.peak_flops / 1e9:.0f} GFLOP/s"


def _size(text: str) -> tuple[int, int]:
    try:
        out_features, in_features = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size must look like OUTxIN (e.g. 4096x4096), got {text!r}") from None
    if not (0 < out_features <= MAX_INDEX and 0 < in_features <= MAX_INDEX):
        raise argparse.ArgumentTypeError(f"each side must be in [1, {MAX_INDEX}], got {text!r}")
    return out_features, in_features


def _unique(values) -> tuple:
    return tuple(dict.fromkeys(values))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", nargs="+", type=_size, metavar="OUTxIN",
                        help=f"weight shapes, out_features x in_features (default: {' '.join(FULL['sizes'])})")
    parser.add_argument("--sparsity", nargs="+", type=sparsity_argument, help=f"default: {FULL['sparsity']}")
    parser.add_argument("--batch", nargs="+", type=positive_int, help=f"default: {FULL['batch']}")
    parser.add_argument("--mode", nargs="+", choices=MODES, default=list(MODES), help="default: both")
    parser.add_argument("--repeats", type=positive_int, help=f"interleaved samples per variant and point (default {FULL['repeats']})")
    parser.add_argument("--quick", action="store_true",
                        help="a small grid for a check in seconds, written to benchmarks/quick unless --out is "
                             "given (explicit options still override it)")
    parser.add_argument("--device", type=device_argument, default=torch.device("cpu"), help="cpu or cuda[:N] (default: cpu)")
    parser.add_argument("--threads", type=positive_int, help="CPU threads for every variant (default: torch's, all cores)")
    parser.add_argument("--out", type=Path, help="output folder (default: benchmarks, or benchmarks/quick with --quick)")
    parser.add_argument("--keep-freed-memory", action=argparse.BooleanOptionalAction,
                        help="tell glibc's malloc to keep freed memory for reuse (the default where the C library is "
                             "glibc), so that no variant pays page faults for fresh large tensors in every call, as "
                             "dense training otherwise may (a new 64 MiB weight gradient per step at 4096x4096); "
                             "--no-keep-freed-memory: the allocator as PyTorch ships it")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    defaults = QUICK if args.quick else FULL
    device = args.device
    if unavailable_device("bench", device):
        return 2
    # the output folder first: a bad one must not cost the whole run's results
    out = args.out or Path("benchmarks/quick" if args.quick else "benchmarks")
    stem = device.type
    outputs = [out / f"{stem}_layer.{kind}" for kind in ("json", "csv", "md")] + [out / f"{stem}_speedup.png"]
    if (problem := _unusable_output(out, outputs)) is not None:
        print(f"snack bench: --out {str(out)!r} is not a usable folder: {problem}", file=sys.stderr)
        return 2
    grid = Grid(  # each value once, in the order given
        sizes=_unique(args.sizes or [_size(s) for s in defaults["sizes"]]),
        sparsities=_unique(args.sparsity or defaults["sparsity"]),
        batches=_unique(args.batch or defaults["batch"]),
        modes=_unique(args.mode),
        repeats=args.repeats or defaults["repeats"],
    )
    if args.threads:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        if cores and args.threads > cores:
            print(f"snack bench: warning: --threads {args.threads} is more than the {cores} cores this process may "
                  "use; threads will share cores and the timings will show it", file=sys.stderr)
        torch.set_num_threads(args.threads)
    if (problem := _too_large(grid, device)) is not None:
        print(f"snack bench: {problem}", file=sys.stderr)
        return 2
    if args.keep_freed_memory is not False:
        try:
            keep_freed_memory()
        except RuntimeError as error:
            if args.keep_freed_memory:  # asked for by name
                print(f"snack bench: --keep-freed-memory: {error}", file=sys.stderr)
                return 2
            print(f"snack bench: warning: {error}; the allocator runs as PyTorch ships it", file=sys.stderr)
    allocator = "" if keeps_freed_memory() else SHIPPED_ALLOCATOR
    from tqdm import tqdm

    backend = default_backend_name(device.type)
    print(f"snack bench on {machine_line(device)}; snack backend: {backend}", file=sys.stderr)
    machine = measure_machine(device)
    print(f"measured: {_limits(machine)}", file=sys.stderr)
    with tqdm(total=grid.points(), desc="snack bench", unit="point", disable=args.no_progress, file=sys.stderr) as bar:
        def progress(description: str) -> None:
            bar.set_postfix_str(description)
            bar.update()

        times, memory = run_grid(grid, machine, device, progress)

    given = getattr(args, "_argv", ["bench"])[1:]  # set by snack.cli.main
    command = " ".join(["snack bench", *(shlex.quote(a) for a in given)])
    metadata = {
        "date": utc_stamp(),
        "machine": machine_line(device),
        "device": str(device),
        "backend": backend,
        "command": command,
        "keeps_freed_memory": keeps_freed_memory(),
        # other work on the machine shows up as noise: record how busy it was
        "load_average_1min_at_end": os.getloadavg()[0],
        "bandwidth_bytes_per_s": machine.bandwidth,
        "cache_bandwidth_bytes_per_s": machine.cache_bandwidth,
        "cache_bytes": machine.cache_bytes,
        "peak_flops_per_s": machine.peak_flops,
        "grid": {"sizes": grid.sizes, "sparsities": grid.sparsities, "batches": grid.batches, "modes": grid.modes,
                 "repeats": grid.repeats},
    }
    tables = "\n".join([
        f"\n{metadata['date']} · {metadata['machine']} · `{command}`",
        f"{_limits(machine)}; × = speedup over dense nn.Linear (ratio of medians); "
        "distance = snack time / roofline bound (below 1: the bandwidth measured first was low, a busy machine)"
        f"{allocator}\n",
        format_table(times),
        "\n" + format_faults(times),
        "\nTraining memory per layer (parameters + gradients + Adam state + index structure), MiB:\n",
        format_memory(memory),
    ])  # fmt: skip
    # the tables first: if the files cannot be written after all, the results are on the terminal
    print(tables)
    title = f"{metadata['machine']} — {metadata['date']}"
    writers = [
        lambda path: write_json(path, metadata, times, memory),
        lambda path: write_csv(path, times),
        lambda path: path.write_text(tables + "\n"),  # what the README quotes
        lambda path: write_plot(path, times, title),
    ]
    if importlib.util.find_spec("matplotlib") is None:  # an optional dependency (the [bench] extra)
        print("snack bench: matplotlib is not installed: no plot", file=sys.stderr)
        outputs, writers = outputs[:-1], writers[:-1]
    try:
        _write_together(outputs, writers)
    except OSError as error:
        print(f"snack bench: writing the results into {str(out)!r} failed: {error}", file=sys.stderr)
        return 2
    print(f"\nwrote {', '.join(map(str, outputs))}", file=sys.stderr)
    return 0


def _unusable_output(out: Path, outputs: list[Path]) -> str | None:
    """Why the results cannot be written into ``out`` (created if missing), or ``None``."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out).close()
    except OSError as error:
        return error.strerror or str(error)
    taken = [path.name for path in outputs if path.is_dir()]
    return f"{', '.join(taken)} in it are folders" if taken else None


def _write_together(paths: list[Path], writers: list) -> None:
    """Write each ``paths[i]`` with ``writers[i](path)`` through a temporary name, then move them
    all into place: an interrupted or failed run leaves the previous set whole, not a mix."""
    temporary = [path.with_name(f".{path.stem}.partial{path.suffix}") for path in paths]
    try:
        for writer, path in zip(writers, temporary):
            writer(path)
        for source, target in zip(temporary, paths):
            os.replace(source, target)
    finally:
        for path in temporary:
            path.unlink(missing_ok=True)


def _too_large(grid: Grid, device: torch.device) -> str | None:
    """Why the grid's largest point would not fit in the device's free memory (or in int32
    indices), or ``None``.

    A rough upper bound, so that a size or batch too large is refused before the run rather than
    failing with an allocation error (or swapping) after the machine measurement: Dense+Mask
    training holds about five out×in float32 tensors at once (weight, mask, their product, and
    two gradients; three without training), snack about 40 bytes per connection, and the
    activations a few B×(in+out)."""
    free = _free_bytes(device)
    batch = max(grid.batches)
    dense_tensors = 5 if "training" in grid.modes else 3
    for out_features, in_features in grid.sizes:
        try:
            densest = max(nnz_for_sparsity(out_features, in_features, s) for s in grid.sparsities)
        except ValueError as error:  # more connections than int32 indices hold
            return str(error)
        if free is None:
            continue
        activations = 8 * batch * (out_features + in_features)
        need = 4 * (dense_tensors * out_features * in_features + 10 * densest + activations)
        if need > free:
            return (f"a {out_features}x{in_features} layer at batch {batch} needs about {need / 2**30:.1f} GiB, "
                    f"more than the {free / 2**30:.1f} GiB free on {device}; choose smaller --sizes or --batch")
    return None


def _free_bytes(device: torch.device) -> int | None:
    """Memory of ``device`` available to the run in bytes, where it can be known: a CUDA
    device's free memory, or Linux's ``MemAvailable`` (free memory plus the page cache the kernel
    can drop)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
