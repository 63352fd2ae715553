"""``snack bench`` on a tiny grid: the outputs exist and are well formed (no timing assertions)."""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from snack.bench import Machine, cli
from snack.bench import page_faults
from snack.bench.harness import TimeRecord
from snack.bench.report import compare_and_save, format_comparison, format_faults
from snack.bench.roofline import sparse_bound
from snack.bench.timing import Timer, interleaved_samples
from snack.bench.variants import TorchSparseCSR, build_variants
from snack.nn import SparseLinear
from snack import cli as snack_cli

VARIANT_NAMES = {"dense", "dense+mask", "torch.sparse", "snack"}


@pytest.fixture(scope="module", autouse=True)
def _keep_this_process_allocator():
    """In-process runs leave this process's malloc as it is (glibc's setting would last for the
    tests after them): ``keep_freed_memory`` is a no-op here; the subprocess tests run the real one."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli, "keep_freed_memory", lambda: None)
        yield


@pytest.fixture(scope="module")
def bench_output(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = ["bench", "--sizes", "64x96", "--sparsity", "0.9", "--batch", "1", "4", "1", "--repeats", "2",
            "--out", str(out), "--no-progress"]
    assert snack_cli.main(argv) == 0
    return out


def _strict_json(text: str):
    """``json.loads`` that refuses NaN and Infinity, which are not JSON (JavaScript rejects them)."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_json_is_complete(bench_output):
    document = _strict_json((bench_output / "cpu_layer.json").read_text())
    for key in ("date", "machine", "command", "backend", "bandwidth_bytes_per_s", "peak_flops_per_s", "grid", "times",
                "memory"):
        assert key in document
    assert document["backend"] == "cpu"
    # the command that ran, as given to snack.cli.main (not this process's sys.argv)
    assert document["command"].startswith("snack bench --sizes 64x96 --sparsity 0.9 --batch 1 4 1 --repeats 2 --out ")
    assert document["bandwidth_bytes_per_s"] > 0 and document["peak_flops_per_s"] > 0
    times = document["times"]
    # 1 size × 1 sparsity × 2 batches (1 was asked twice) × 2 modes, 4 variants each
    assert len(times) == 2 * 2 * 4
    # the real sparsity, not the requested 0.9: 614 of 6144 connections
    assert {t["sparsity"] for t in times} == {m["sparsity"] for m in document["memory"]} == {0.900065}
    assert {t["variant"] for t in times} == VARIANT_NAMES
    for t in times:
        assert t["q25_ms"] <= t["median_ms"] <= t["q75_ms"]
        assert len(t["samples_ms"]) == 2
        assert t["speedup_vs_dense"] > 0
        if t["variant"] == "snack":
            assert t["bound_ms"] > 0 and t["distance"] > 0
        else:
            assert t["bound_ms"] is None and t["distance"] is None  # not applicable: null
    assert {m["variant"] for m in document["memory"]} == VARIANT_NAMES
    assert document["keeps_freed_memory"] is False  # (this process's keep_freed_memory is a no-op)
    if sys.platform.startswith("linux"):  # (where resource counts them)
        assert all(t["faults_per_call"] >= 0 for t in times)


@pytest.mark.parametrize("path", ["cpu_layer.json", "one_thread/cpu_layer.json", "gpu/cuda_layer.json"])
def test_the_committed_results_are_strict_json(path):
    _strict_json((Path(__file__).parents[1] / "benchmarks" / path).read_text())


def test_csv_has_a_row_per_point_and_variant(bench_output):
    with (bench_output / "cpu_layer.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 16
    assert {(r["batch"], r["mode"]) for r in rows} == {("1", "inference"), ("1", "training"), ("4", "inference"),
                                                       ("4", "training")}
    assert all(float(r["median_ms"]) > 0 for r in rows)


def test_the_printed_tables_are_saved_as_markdown(bench_output):
    text = (bench_output / "cpu_layer.md").read_text()
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC · .* · `snack bench ", text)
    assert "| size | mode | sparsity | batch |" in text and "Training memory per layer" in text
    assert "Most minor page faults per call" in text or "Page faults per call: not counted" in text


def test_plot_is_a_png(bench_output):
    assert (bench_output / "cpu_speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_memory_counts_parameters_gradients_adam_and_indices():
    variants = {v.name: v for v in build_variants(40, 50, 0.9, torch.device("cpu"))}
    dense = variants["dense"].state_bytes()
    weights = (40 * 50 + 40) * 4
    assert (dense.params, dense.grads, dense.adam, dense.structure) == (weights, weights, 2 * weights, 0)
    sparse = variants["snack"]
    nnz = sparse.layer.nnz
    assert sparse.state_bytes().params == (nnz + 40) * 4
    # what the layer holds: first row and col; after a training step also the two pointers (all
    # int32; no column order on the CPU, whose kernels do not read it); after a batch-1 forward
    # also the CPU backend's 16-bit copy of col
    assert sparse.state_bytes().structure == 2 * nnz * 4
    sparse.train_step(torch.randn(4, 50, requires_grad=True), torch.randn(4, 40))
    assert sparse.state_bytes().structure == (2 * nnz + 41 + 51) * 4
    sparse.infer(torch.randn(1, 50))
    assert sparse.state_bytes().structure == (2 * nnz + 41 + 51) * 4 + 2 * nnz
    assert variants["dense+mask"].state_bytes().structure == 40 * 50 * 4


def test_the_torch_sparse_baseline_transposes_exactly_past_two_to_the_24_nonzeros():
    """Its transposed CSR's value permutation was built in float32, which rounds positions above
    2**24: the IndexError came after every earlier point had been measured, losing the run."""
    layer = SparseLinear((1 << 24) + 8, 1, sparsity=0.0)  # one row: the transpose keeps the order
    assert torch.equal(TorchSparseCSR(layer).perm_t, torch.arange(layer.nnz))


def test_variants_compute_the_same_layer():
    variants = build_variants(30, 20, 0.8, torch.device("cpu"))
    x = torch.randn(5, 20)
    expected = variants[0].infer(x)
    for variant in variants[1:]:
        torch.testing.assert_close(variant.infer(x), expected, rtol=1e-5, atol=1e-5)


def test_timer_samples_after_an_untimed_lead_in():
    calls = []
    timer = Timer(lambda: calls.append(time.perf_counter()), torch.device("cpu"))
    timer.warm_up()
    assert timer.lead_in >= timer.calls >= 1  # 30 ms of lead-in, 20 ms samples (or both capped)
    calls.clear()
    assert timer.sample() >= 0
    assert len(calls) == timer.lead_in + timer.calls


def test_interleaved_samples_rotate_which_function_runs_first():
    ran = []
    functions = {key: (lambda key=key: ran.append(key)) for key in "abc"}
    samples = interleaved_samples(functions, torch.device("cpu"), samples=3)
    assert {key: len(taken) for key, taken in samples.items()} == {"a": 3, "b": 3, "c": 3}
    runs = [key for i, key in enumerate(ran) if i == 0 or ran[i - 1] != key]  # one entry per stretch
    assert runs == list("abc" + "abc" + "bca" + "cab")  # warm-ups, then three rounds


def test_format_comparison_dates_the_table_and_divides_the_second_by_the_first():
    medians = {("forward", "a"): 10.0, ("forward", "b"): 25.0, ("step", "a"): 4.0, ("step", "b"): 3.0}
    lines = format_comparison("64x64, batch 32", "µs", ("a", "b"), medians, ["forward", "step"], 1).splitlines()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC · .*torch threads.*; torch .*; Python .*", lines[0])
    assert lines[1] == "64x64, batch 32"
    assert lines[3:] == [
        "| call | a µs | b µs | b / a |", "|---|---|---|---|", "| forward | 10.0 | 25.0 | 2.50 |", "| step | 4.0 | 3.0 | 0.75 |"
    ]


def test_compare_and_save_times_every_call_on_both_variants_and_saves_the_table(tmp_path, capsys):
    ran = []
    out = tmp_path / "comparison.txt"
    compare_and_save(
        {"call": lambda variant: ran.append(variant)}, {"base": "b", "new": "n"},
        samples=2, setting="tiny", unit="µs", digits=1, out=out,
    )  # fmt: skip
    assert set(ran) == {"b", "n"}
    text = out.read_text()
    assert text == capsys.readouterr().out
    assert "| call | base µs | new µs | new / base |" in text
    assert re.search(r"\n\| call \| \d+\.\d \| \d+\.\d \| \d+\.\d\d \|\n", text)  # the one case's medians


def test_roofline_bound():
    machine = Machine(bandwidth=1e9, peak_flops=1e9)
    weight = 50 * 8 + 11 * 4  # values + int32 columns, row pointer
    activations = 2 * (20 + 10) * 4
    bound, flops, moved = sparse_bound(machine, 10, 20, nnz=50, batch=2, training=False)
    assert (flops, moved) == (2 * 2 * 50, weight + activations)
    assert bound == max(moved, flops) / 1e9
    _, train_flops, train_moved = sparse_bound(machine, 10, 20, nnz=50, batch=2, training=True)
    # the weight twice, dvalues, and X, Y (forward), dY, X, dX (backward)
    assert (train_flops, train_moved) == (3 * flops, 2 * weight + 50 * 4 + 2 * activations + 2 * 20 * 4)
    # a working set that fits the measured cache buffer streams at the cache's rate
    # a forward reading 16-bit columns moves 2 bytes less per non-zero
    assert sparse_bound(machine, 10, 20, nnz=50, batch=2, training=False, forward_column_bytes=2)[2] == moved - 100
    cached = Machine(bandwidth=1e9, peak_flops=1e12, cache_bandwidth=4e9, cache_bytes=weight + activations)
    assert sparse_bound(cached, 10, 20, nnz=50, batch=2, training=False)[0] == moved / 4e9
    assert sparse_bound(cached, 10, 20, nnz=50, batch=3, training=False)[0] == (moved + 30 * 4) / 1e9


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sizes", "4096"], "size must look like OUTxIN"),
        (["--sizes", "0x5"], r"each side must be in \[1, 2147483647\], got '0x5'"),
        (["--sizes", "99999999999x4"], "each side must be in"),
        (["--sparsity", "1.0"], r"sparsity must be in \[0, 1\)"),
        (["--batch", "0"], "must be >= 1, got 0"),
        (["--batch", "abc"], "must be a whole number >= 1, got 'abc'"),
        (["--device", "tpu"], "device must be cpu or cuda"),
    ],
)
def test_bad_arguments_are_rejected(argv, message, capsys):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(argv)
    assert re.search(message, capsys.readouterr().err)


class _Stop(Exception):
    """Raised in place of the measurements: these tests stop a run before it benchmarks."""


def _stop(*args, **kwargs):
    raise _Stop


def test_an_unusable_output_folder_is_refused_before_benchmarking(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "measure_machine", _stop)
    afile = tmp_path / "afile"
    afile.touch()
    assert snack_cli.main(["bench", "--quick", "--no-progress", "--out", str(afile)]) == 2
    assert f"snack bench: --out {str(afile)!r} is not a usable folder" in capsys.readouterr().err


def test_quick_runs_default_to_their_own_folder(tmp_path, monkeypatch):
    """``./dev bench --quick`` must not overwrite the committed full-grid results."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "measure_machine", _stop)
    with pytest.raises(_Stop):
        snack_cli.main(["bench", "--quick", "--no-progress"])
    assert (tmp_path / "benchmarks" / "quick").is_dir() and not list((tmp_path / "benchmarks").glob("*.json"))


def test_more_threads_than_cores_get_a_warning(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "measure_machine", _stop)
    monkeypatch.setattr(torch, "set_num_threads", lambda threads: None)  # keep this process's setting
    monkeypatch.setattr(cli.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    with pytest.raises(_Stop):
        snack_cli.main(["bench", "--quick", "--no-progress", "--threads", "3"])
    assert "--threads 3 is more than the 2 cores this process may use" in capsys.readouterr().err


def test_a_folder_in_place_of_an_output_file_is_refused_before_benchmarking(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "measure_machine", _stop)
    (tmp_path / "cpu_layer.json").mkdir()
    assert snack_cli.main(["bench", "--quick", "--no-progress", "--out", str(tmp_path)]) == 2
    assert "cpu_layer.json in it are folders" in capsys.readouterr().err


def test_a_layer_too_large_for_memory_is_refused_before_benchmarking(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "measure_machine", _stop)
    argv = ["bench", "--sizes", "100000x100000", "--no-progress", "--out", str(tmp_path)]
    assert snack_cli.main(argv) == 2
    assert "a 100000x100000 layer at batch 128 needs about" in capsys.readouterr().err
    argv = ["bench", "--sizes", "1000000x1000000", "--no-progress", "--out", str(tmp_path)]
    assert snack_cli.main(argv) == 2  # (a clear error, not a traceback)
    assert "int32 indices hold at most 2147483647: raise the sparsity" in capsys.readouterr().err


TINY = ["bench", "--sizes", "4x4", "--batch", "1", "--mode", "inference", "--repeats", "1", "--no-progress"]


def test_sparsities_that_give_the_same_layer_are_measured_once(tmp_path):
    # 0.9 and 0.88 both leave 2 of 16 connections: two rows with one key mixed their figures
    with pytest.warns(UserWarning, match="sparsity 0.88 is recorded as 0.875, as 0.9 is; measured once"):
        assert snack_cli.main([*TINY, "--sparsity", "0.9", "0.88", "--out", str(tmp_path)]) == 0
    times = json.loads((tmp_path / "cpu_layer.json").read_text())["times"]
    assert sorted(t["variant"] for t in times) == sorted(VARIANT_NAMES)
    assert {t["sparsity"] for t in times} == {0.875}


def test_a_nearly_empty_layer_does_not_read_as_sparsity_1(tmp_path):
    assert snack_cli.main([*TINY[:2], "2048x2048", *TINY[3:], "--sparsity", "0.9999999", "--out", str(tmp_path)]) == 0
    (sparsity,) = {t["sparsity"] for t in json.loads((tmp_path / "cpu_layer.json").read_text())["times"]}
    assert sparsity == 1 - 1 / 2048**2


def test_an_interrupted_run_leaves_the_previous_results_whole(tmp_path, capsys, monkeypatch):
    assert snack_cli.main([*TINY, "--sparsity", "0.5", "--out", str(tmp_path)]) == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "write_plot", interrupted)  # after the JSON and CSV are written
    assert snack_cli.main([*TINY, "--sparsity", "0.75", "--out", str(tmp_path)]) == 130
    assert "snack bench: interrupted" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no mix, no partial files


def test_without_matplotlib_the_results_are_written_without_the_plot(tmp_path, capsys, monkeypatch):
    find_spec = cli.importlib.util.find_spec
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None if name == "matplotlib" else find_spec(name))
    assert snack_cli.main([*TINY, "--sparsity", "0.5", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu_layer.csv", "cpu_layer.json", "cpu_layer.md"]
    assert "matplotlib is not installed: no plot" in capsys.readouterr().err


def test_the_machine_line_names_the_batch_one_gather_mode(monkeypatch):
    from snack import backends
    from snack.backends.cpu import native
    from snack.bench.provenance import machine_line

    isa = torch.backends.cpu.get_cpu_capability()
    mode = native.gather_mode()
    line = machine_line(torch.device("cpu"))
    if mode is None:
        assert f"threads, {isa};" in line, line
    else:
        assert f"threads, {isa} (batch-1 gathers: {mode});" in line, line
        other = "scalar" if mode == "vector" else "vector"
        native.set_gather_mode(other)
        try:
            assert f"(batch-1 gathers: {other})" in machine_line(torch.device("cpu"))
        finally:
            native.set_gather_mode(mode)

    def unavailable(name):
        raise backends.BackendUnavailableError("no native kernels")

    monkeypatch.setattr(backends, "get_backend", unavailable)
    assert f"threads, {isa};" in machine_line(torch.device("cpu"))


def _record(variant: str, faults: float, batch: int = 1) -> TimeRecord:
    return TimeRecord(out_features=8, in_features=4, sparsity=0.5, batch=batch, mode="training", variant=variant,
                      median_ms=1.0, q25_ms=1.0, q75_ms=1.0, faults_per_call=faults)


def test_the_faults_line_names_each_variants_worst_point():
    records = [_record("dense", 3.0), _record("dense", 16385.0, batch=32), _record("snack", 0.0),
               _record("torch.sparse", 1 / 3, batch=8)]
    assert format_faults(records) == (
        "Most minor page faults per call (fresh memory, mapped in a page at a time): "
        "dense 16,385 (8x4 training, B=32), snack 0, torch.sparse 0.3 (8x4 training, B=8)."
    )
    assert format_faults([_record("dense", float("nan"))]) == "Page faults per call: not counted on this platform."


def _glibc_malloc_environment() -> dict[str, str]:
    """This process's environment without the preloads of ``./dev sanitize`` (ASan's runtime replaces
    malloc) and the ASan build of the kernels that needs them: a subprocess with glibc's malloc."""
    return {key: value for key, value in os.environ.items() if key not in ("LD_PRELOAD", "SNACK_CPU_SANITIZE")}


def _asan_runtime() -> str | None:
    """gcc's AddressSanitizer runtime (a malloc that is not glibc's), or ``None`` where there is none."""
    if shutil.which("gcc") is None:
        return None
    path = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and Linux's fault counts")
def test_keeping_freed_memory_stops_a_fresh_tensor_faulting_in_its_pages():
    # in a process of its own: the setting lasts for the rest of the process
    code = """
import torch
from snack.bench.page_faults import keep_freed_memory, minor_faults

def faults_of_a_64_mib_tensor_allocated_again():
    torch.empty(2**24).fill_(1.0)  # written, then freed
    before = minor_faults()
    torch.empty(2**24).fill_(1.0)
    return minor_faults() - before

print(faults_of_a_64_mib_tensor_allocated_again())
keep_freed_memory()
faults_of_a_64_mib_tensor_allocated_again()  # (the heap grows to hold it once)
print(faults_of_a_64_mib_tensor_allocated_again())
"""
    fresh, kept = map(int, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                          env=_glibc_malloc_environment(), check=True).stdout.split())
    assert fresh > 0 and kept <= fresh // 10, (fresh, kept)


@pytest.mark.skipif(_asan_runtime() is None, reason="needs gcc's AddressSanitizer runtime (a malloc not glibc's)")
def test_where_another_library_replaces_malloc_keeping_freed_memory_is_a_clear_error():
    # ASan's malloc ignores glibc's mallopt: a success here would label results falsely (CI's
    # ./dev sanitize once measured 20,504 faults before and 20,482 after)
    code = """
from snack.bench import page_faults
try:
    page_faults.keep_freed_memory()
except RuntimeError as error:
    print(error, page_faults.keeps_freed_memory())
"""
    environment = {**_glibc_malloc_environment(), "LD_PRELOAD": _asan_runtime(), "ASAN_OPTIONS": "detect_leaks=0"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, check=True)
    assert result.stdout.startswith("cannot keep freed memory: this process's malloc comes from "), result.stdout
    assert "libasan" in result.stdout and "not from glibc" in result.stdout
    assert result.stdout.strip().endswith("False")  # nothing was kept


def test_without_mallopt_keeping_freed_memory_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(page_faults.ctypes, "CDLL", lambda name: object())  # a C library without mallopt
    with pytest.raises(RuntimeError, match="has no mallopt; this needs glibc"):
        page_faults.keep_freed_memory()


def test_a_refused_keep_freed_memory_stops_the_run_before_benchmarking(tmp_path, capsys, monkeypatch):
    def refused():
        raise RuntimeError("glibc's mallopt refused M_MMAP_THRESHOLD = 2147483647")

    monkeypatch.setattr(cli, "keep_freed_memory", refused)
    monkeypatch.setattr(cli, "measure_machine", _stop)
    assert snack_cli.main([*TINY, "--sparsity", "0.5", "--keep-freed-memory", "--out", str(tmp_path)]) == 2
    assert "snack bench: --keep-freed-memory: glibc's mallopt refused" in capsys.readouterr().err


def test_where_keeping_freed_memory_fails_by_default_the_run_goes_on_with_a_warning(tmp_path, capsys, monkeypatch):
    def refused():
        raise RuntimeError("cannot keep freed memory: the C library (libc.so) has no mallopt")

    monkeypatch.setattr(cli, "keep_freed_memory", refused)
    assert snack_cli.main([*TINY, "--sparsity", "0.5", "--out", str(tmp_path)]) == 0
    assert "warning: cannot keep freed memory" in capsys.readouterr().err
    assert json.loads((tmp_path / "cpu_layer.json").read_text())["keeps_freed_memory"] is False
    assert "memory allocator as PyTorch ships it" in (tmp_path / "cpu_layer.md").read_text()


def test_no_keep_freed_memory_leaves_the_allocator_as_shipped(tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "keep_freed_memory", _stop)
    assert snack_cli.main([*TINY, "--sparsity", "0.5", "--no-keep-freed-memory", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "cpu_layer.json").read_text())["keeps_freed_memory"] is False
    assert "memory allocator as PyTorch ships it" in (tmp_path / "cpu_layer.md").read_text()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_run_keeps_freed_memory_by_default_and_says_so(tmp_path):
    argv = [sys.executable, "-m", "snack", *TINY, "--sparsity", "0.5", "--out", str(tmp_path)]
    subprocess.run(argv, capture_output=True, env=_glibc_malloc_environment(), check=True)
    assert json.loads((tmp_path / "cpu_layer.json").read_text())["keeps_freed_memory"] is True
    text = (tmp_path / "cpu_layer.md").read_text()
    assert "Python 3" in text and "; glibc keeps freed memory · `snack bench" in text
    assert "memory allocator as PyTorch ships it" not in text


def test_the_machine_line_says_when_glibc_keeps_freed_memory(monkeypatch):
    from snack.bench.provenance import machine_line

    assert "glibc keeps freed memory" not in machine_line(torch.device("cpu"))
    monkeypatch.setattr(page_faults, "_kept", True)
    assert machine_line(torch.device("cpu")).endswith("; glibc keeps freed memory")
