"""Kernel-level SpMM comparison on a GPU, plus a training-step comparison of the layer.

``python -m snack.backends.triton.kernel_bench --out results.json`` times, for a 4096 × 4096
weight at 95% sparsity and batch 1, 2, 4, …, 64 (``Y = X·Wᵀ``, ``X (B, 4096)``):

* ``segment`` / ``pointer`` — the two forms of snack's Triton SpMM that layers run (see :mod:`.backend`);
* ``patches/BAND`` — the SpMM by patches of 64 rows × a band of ``BAND`` columns, prepared for
  measurement (from batch 8; checked first, and not timed if wrong);
* ``snack_op`` — ``torch.ops.snack.spmm`` as a layer calls it (heuristic form + dispatcher);
* ``dense_mask`` — Dense+Mask: ``X · (W ⊙ M)ᵀ`` with the mask applied every call, as a masked layer does;
* ``csr`` — ``torch.sparse.mm`` on a CSR weight (cuSPARSE), with ``Xᵀ`` prepared outside the timing;
* ``dense`` — ``X · Wᵀ`` with the dense weight (cuBLAS), the speed of light of not being sparse.

Each is timed twice: ``us``, eager calls as a program makes them, and ``graph_us``, replayed from
a CUDA graph (GPU time). Both go through ``triton.testing.do_bench``, which clears the L2 with a
256 MiB memset before each call and times from after it: ``us`` is cold-L2 GPU time plus only
the host work that outlasts that memset (about 80 µs on an H200), so it understates host-bound
calls; ``snack bench --device cuda`` (``layer_bench.txt``) times eager calls by the wall clock.

And, at ``--train-sparsity`` (90%) and ``--train-batch`` (1, 8, 32), one training step (forward +
backward for input, weight and bias) of ``SparseLinear`` against ``nn.Linear``, eager and replayed
from a CUDA graph, and the three products of a step (SpMM, transposed SpMM, SDDMM against the three
dense matmuls) one by one, both SDDMM forms (``sddmm[segment]``, ``sddmm[pointer]``; see
:mod:`.backend`, which runs the pointer form unless it would leave SMs idle), the transposed SpMM's
column walk (``spmm_t[pointer]``) and the step's whole backward as layers run them
(``backward[column]``), and the variants prepared against them: the backward walking the weight
by row (``backward[row]``), and the transposed SpMM and the SDDMM by patches
(``spmm_t[patches/BAND]``, ``sddmm[patches/BAND]``), with a verdict table that weighs each
against what layers run. A
profile of the eager step at the smallest batch (where host overhead decides) lists where the host
time goes, and the configs the autotuner picked are recorded. Times are medians of
``triton.testing.do_bench`` in microseconds; every snack output is checked against the dense result
first. ``bw_limit_us`` is the time to stream the weight (values + int32 indices) and the
activations once at the measured device-to-device copy bandwidth: how far a kernel is from its
limit.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
import warnings

import torch

BATCHES = [1, 2, 4, 8, 16, 32, 64]
# Band widths the patch forms (prepared for measurement, not run by layers: backend, *The patch
# forms*) are timed with: 256 is the backend's PATCH_BAND.
_PATCH_BANDS = (128, 256, 512)
_PATCH_SPMM_VARIANTS = [f"patches/{band}" for band in _PATCH_BANDS]
SPMM_VARIANTS = ["segment", "pointer", *_PATCH_SPMM_VARIANTS, "snack_op", "dense_mask", "csr", "dense"]
# The SpMM by patches is timed from this batch up: below it a row of Xᵀ is short and the pointer
# form already reads the values in order; and each batch tile autotunes (compiles) anew on the GPU.
_PATCH_SPMM_MIN_BATCH = 8
# the products of a training step: snack's three ops, then their dense counterparts; then whole steps
_STEP_OPS = ["spmm", "spmm_t", "sddmm", "dense_fwd", "dense_dx", "dense_dw"]
# Variants prepared for measurement that layers do not run yet: a training step's whole backward
# (bias gradient included) walking the weight by row (one pass, dX by atomic adds;
# backend.spmm_backward's walk); the transposed SpMM by patches of 64 columns × a band of rows, and
# the SDDMM (bias gradient included) by patches of 64 rows × a band of columns (_PATCH_BANDS). Each
# is checked against the reference first: a wrong one loses its own timings (and says so), not the
# run's.
_PREPARED = [
    "backward[row]",
    *(f"spmm_t[patches/{band}]" for band in _PATCH_BANDS),
    *(f"sddmm[patches/{band}]" for band in _PATCH_BANDS),
]
# the SDDMM's two forms (the backend's rule between them is measured here); the transposed SpMM's
# column walk and the whole backward as layers run them (spmm_t + SDDMM); then the prepared variants
_VARIANT_OPS = ["sddmm[segment]", "sddmm[pointer]", "spmm_t[pointer]", "backward[column]", *_PREPARED]
_WHOLE_STEPS = ["snack", "dense"]
TRAIN_BATCHES = [1, 8, 32]
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m snack.backends.triton.kernel_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--size", default="4096x4096", help="OUTxIN of the weight (default 4096x4096)")
    parser.add_argument("--sparsity", type=float, default=0.95, help="SpMM sparsity (default 0.95)")
    parser.add_argument("--train-sparsity", type=float, default=0.9, help="training-step sparsity (default 0.9)")
    parser.add_argument("--batch", type=int, nargs="+", default=BATCHES, help="SpMM batches")
    parser.add_argument("--train-batch", type=int, nargs="+", default=TRAIN_BATCHES, help="training-step batches")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    return parser.parse_args(argv)


def _us(fn) -> float:
    import triton.testing

    return 1000.0 * triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8])[0]


def _baseline_us(name: str, fn) -> float | None:
    """``_us(fn)``, or ``None`` when a baseline library call does not support the case (e.g.
    cuSPARSE and bfloat16): reported, not fatal."""
    try:
        return _us(fn)
    except RuntimeError as error:
        if name in ("segment", "pointer", "snack_op", *_PATCH_SPMM_VARIANTS):
            raise
        print(f"  ({name} unavailable: {error})", file=sys.stderr)
        return None


def _graph_us(fn) -> float | None:
    """Median µs per call replayed from a CUDA graph: GPU time without host launch overhead.
    ``None`` when ``fn`` cannot be captured."""
    import triton.testing

    try:
        return 1000.0 * triton.testing.do_bench_cudagraph(fn, return_mode="median")
    except Exception as error:  # a library call that refuses capture: report, don't abort the run
        print(f"  (CUDA graph capture failed: {type(error).__name__}: {error})", file=sys.stderr)
        return None


def _copy_bandwidth(device) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write of 256 MiB)."""
    src = torch.empty(64 * 2**20, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / (_us(lambda: dst.copy_(src)) * 1e-6)


def _spmm_fns(x, values, tensors, weight, mask, csr) -> dict:
    """The SpMM variants for one input ``x (B, in)`` (a function, so that each closure keeps its own
    ``x``: the CUDA-graph pass calls them after the loop over batches)."""
    from snack.backends.triton import backend as tb

    xt = x.t().contiguous()
    fns = {
        "segment": lambda: tb.spmm(x, values, tensors, form="segment"),
        "pointer": lambda: tb.spmm(x, values, tensors, form="pointer"),
        "snack_op": lambda: torch.ops.snack.spmm(x, values, *tensors),
        "dense_mask": lambda: x @ (weight * mask).t(),
        "csr": lambda: torch.sparse.mm(csr, xt),
        "dense": lambda: x @ weight.t(),
    }
    if x.shape[0] >= _PATCH_SPMM_MIN_BATCH:
        for band in _PATCH_BANDS:
            fns[f"patches/{band}"] = lambda band=band: tb._patch_spmm(
                tb._batch_contiguous(x), x.shape[0], values, tensors, transposed=False, band=band
            )
    return fns


def _step_ops(x, grad, values, tensors, weight) -> dict:
    """The three products of a training step, snack's and dense, for ``x (B, in)``, ``grad (B, out)``;
    then the variants of :data:`_VARIANT_OPS`."""
    from snack.backends.triton import backend as tb

    ops = {
        "spmm": lambda: torch.ops.snack.spmm(x, values, *tensors),
        "spmm_t": lambda: torch.ops.snack.spmm_t(grad, values, *tensors),
        "sddmm": lambda: torch.ops.snack.sddmm(grad, x, *tensors),
        "dense_fwd": lambda: x @ weight.t(),
        "dense_dx": lambda: grad @ weight,
        "dense_dw": lambda: grad.t() @ x,
    }

    def sddmm_with_bias_grad(form: str) -> torch.Tensor:
        # with the bias gradient, as a training step runs it (and as the patch variants are timed)
        layouts = tb._batch_contiguous(grad), tb._batch_contiguous(x)
        return tb._sddmm(*layouts, grad.shape[0], tensors, bias_grad=True, form=form)[0]

    for form in ("segment", "pointer"):
        ops[f"sddmm[{form}]"] = functools.partial(sddmm_with_bias_grad, form)
    ops["spmm_t[pointer]"] = lambda: tb.spmm_t(grad, values, tensors, form="pointer")
    ops["backward[column]"] = lambda: tb.spmm_backward(grad, x, values, tensors, bias_grad=True)[0]
    # the first gradient stands for each variant's (a graph pass checks one output)
    prepared = _prepared_ops(x, grad, values, tensors)
    ops.update({name: lambda fn=fn: next(iter(fn().values())) for name, fn in prepared.items()})
    assert list(ops)[len(_STEP_OPS) :] == _VARIANT_OPS
    return ops


def _prepared_ops(x, grad, values, tensors) -> dict:
    """:data:`_PREPARED` as functions returning their gradients by name (``dX``, ``dvalues``,
    ``dbias``)."""
    from snack.backends.triton import backend as tb

    def row_walk() -> dict:
        dx, dvalues, dbias = tb.spmm_backward(grad, x, values, tensors, bias_grad=True, walk="row")
        return {"dX": dx, "dvalues": dvalues, "dbias": dbias}

    def spmm_t_by_patches(band: int) -> dict:
        layout = tb._batch_contiguous(grad)
        return {"dX": tb._patch_spmm(layout, grad.shape[0], values, tensors, transposed=True, band=band)}

    def sddmm_by_patches(band: int) -> dict:
        layouts = tb._batch_contiguous(grad), tb._batch_contiguous(x)
        dvalues, dbias = tb._sddmm(*layouts, grad.shape[0], tensors, bias_grad=True, form="patches", band=band)
        return {"dvalues": dvalues, "dbias": dbias}

    ops = {"backward[row]": row_walk}
    ops.update({f"spmm_t[patches/{band}]": functools.partial(spmm_t_by_patches, band) for band in _PATCH_BANDS})
    ops.update({f"sddmm[patches/{band}]": functools.partial(sddmm_by_patches, band) for band in _PATCH_BANDS})
    assert list(ops) == _PREPARED
    return ops


def _spmm_rows(args, device, dtype, bandwidth):
    from snack.backends.triton import backend as tb
    from snack.topology import Topology, random_coo

    out_features, in_features = map(int, args.size.lower().split("x"))
    gen = torch.Generator(device=device).manual_seed(0)
    row, col = random_coo(out_features, in_features, args.sparsity, generator=gen, device=device)
    topo = Topology(row, col, (out_features, in_features), validate=False)
    tensors = topo.tensors()
    values = torch.randn(topo.nnz, device=device, dtype=dtype, generator=gen)
    weight = torch.zeros(out_features, in_features, device=device, dtype=dtype)
    weight[row.long(), col.long()] = values
    mask = (weight != 0).to(dtype)
    with warnings.catch_warnings():  # "sparse CSR support is in beta"
        warnings.simplefilter("ignore", UserWarning)
        csr = weight.to_sparse_csr()
    rows, graph_jobs = [], []
    for batch in args.batch:
        x = torch.randn(batch, in_features, device=device, dtype=dtype, generator=gen)
        fns = _spmm_fns(x, values, tensors, weight, mask, csr)
        expected = (x.double() @ weight.double().t()).to(torch.float32)
        scale = expected.abs().max().item()
        errors, prepared_errors = {}, {}
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        for name in ("segment", "pointer", "snack_op", *_PATCH_SPMM_VARIANTS):
            if name not in fns:
                continue
            prepared = name in _PATCH_SPMM_VARIANTS
            y, failure = _run_prepared(fns[name]) if prepared else (fns[name](), None)
            if y is not None:
                errors[name] = (y.float() - expected).abs().max().item() / scale
                if errors[name] <= tol:
                    continue
                failure = f"relative error {errors[name]:.2e} > {tol}"
            message = f"{name} SpMM at batch {batch}: {failure}"
            if not prepared:
                raise AssertionError(message)
            print(f"  {name} WRONG, not timed: {message}", file=sys.stderr)  # a prepared variant
            prepared_errors[name] = message
            del fns[name]
        times = {name: _baseline_us(name, fn) for name, fn in fns.items()}
        moved = topo.nnz * (values.element_size() + 8) + batch * (in_features + out_features) * x.element_size()
        entry = {
            "batch": batch,
            "heuristic_form": tb.spmm_form(batch, out_features, device),
            "us": times,
            "bw_limit_us": moved / bandwidth * 1e6,
            "rel_error": errors,
        }
        if prepared_errors:
            entry["prepared_errors"] = prepared_errors
        rows.append(entry)
        graph_jobs.append((entry, fns))
    return {"size": args.size, "nnz": topo.nnz, "sparsity": args.sparsity, "rows": rows}, graph_jobs


def _check_step(layer, x, grad, dtype) -> dict[str, str]:
    """Gradients of a Triton-backend step, and of the :data:`_PREPARED` variants, against the
    reference backend. Raises on a mismatch of the layer's step; returns the variants that
    disagree or raise, with what went wrong as text, so that a wrong prepared variant loses its
    own timings, not the run's (the row walk is skipped above its batch limit)."""
    import snack
    from snack.backends.triton import backend as tb

    results = {}
    for backend in ("triton", "reference"):
        layer.zero_grad()
        xi = x.detach().clone().requires_grad_()
        with snack.use_backend(backend):
            layer(xi).backward(grad)
        grads = {"dX": xi.grad, "dvalues": layer.values.grad, "dbias": layer.bias.grad}
        results[backend] = {name: g.float() for name, g in grads.items()}
    layer.zero_grad()
    prepared = _prepared_ops(x.detach(), grad, layer.values.detach(), layer.topology.tensors())
    if x.shape[0] > tb.MAX_BLOCK_B:
        del prepared["backward[row]"]
    failed = {}
    for name, fn in prepared.items():
        outputs, failure = _run_prepared(fn)
        if outputs is not None:
            results[name] = {gradient: g.float() for gradient, g in outputs.items()}
        failed[name] = failure and f"training step ({name}) at batch {x.shape[0]}: {failure}"
    tol = 1e-4 if dtype == torch.float32 else 2e-2

    def mismatch(variant: str) -> str | None:
        for name, got in results[variant].items():
            expected = results["reference"][name]
            error = (got - expected).abs().max().item() / max(expected.abs().max().item(), 1e-30)
            if error > tol:
                return f"training step ({variant}) {name} at batch {x.shape[0]}: relative error {error:.2e} > {tol}"
        return None

    if (message := mismatch("triton")) is not None:
        raise AssertionError(message)
    return {name: message for name in prepared if (message := failed[name] or mismatch(name)) is not None}


def _run_prepared(fn):
    """``(fn(), None)``, or ``(None, what it raised)``: a prepared variant that fails to compile or
    launch on some GPU (a Python-level error; a CUDA fault would end the run anyway) is reported
    and skipped, as a wrong one is."""
    try:
        return fn(), None
    except Exception as error:  # noqa: BLE001 - reported in the results, and the variant skipped
        return None, f"raised {type(error).__name__}: {error}"


def _train_rows(args, device, dtype):
    import snack

    out_features, in_features = map(int, args.size.lower().split("x"))
    torch.manual_seed(0)
    sparse = snack.SparseLinear(in_features, out_features, sparsity=args.train_sparsity, device=device, dtype=dtype)
    dense = torch.nn.Linear(in_features, out_features, device=device, dtype=dtype)
    values, tensors = sparse.values.detach(), sparse.topology.tensors()
    weight = dense.weight.detach()
    rows, graph_jobs = [], []
    for batch in args.train_batch:
        x = torch.randn(batch, in_features, device=device, dtype=dtype, requires_grad=True)
        grad = torch.randn(batch, out_features, device=device, dtype=dtype)
        wrong = _check_step(sparse, x, grad, dtype)
        steps = {"snack": _step(sparse, x, grad), "dense": _step(dense, x, grad)}
        times = {name: _us(fn) for name, fn in steps.items()}
        # PyTorch runs a CUDA backward on a worker thread; there the Python of snack's backward ran
        # 2x slower on the H200 machine (cold core), so the step is also timed without it
        with torch.autograd.set_multithreading_enabled(False):
            times.update({f"{name}_calling_thread": _us(fn) for name, fn in steps.items()})
        entry = {"batch": batch, "us": times, "speedup_vs_dense": times["dense"] / times["snack"]}
        ops = _step_ops(x.detach(), grad, values, tensors, weight)
        for name, message in wrong.items():
            print(f"  {name} WRONG, not timed: {message}", file=sys.stderr)
            del ops[name]
        if wrong:
            entry["prepared_errors"] = wrong
        rows.append(entry)
        graph_jobs.append((entry, {**ops, **steps}))
    smallest = min(args.train_batch)
    x = torch.randn(smallest, in_features, device=device, dtype=dtype, requires_grad=True)
    step = _step(sparse, x, torch.randn(smallest, out_features, device=device, dtype=dtype))
    profile = f"{_PROFILED_STEPS} eager steps at batch {smallest}\n" + _host_profile(step, device)
    return {"size": args.size, "sparsity": args.train_sparsity, "rows": rows, "host_profile": profile}, graph_jobs


def _step(layer, x, grad):
    """One training step of ``layer``: forward, then the gradients of ``x`` and every parameter,
    fresh (as after ``optimizer.zero_grad()``, PyTorch's default ``set_to_none``: nothing is
    accumulated into an existing ``.grad``, which would cost the dense layer a 64 MiB
    read-modify-write). A function returning the output, so a CUDA-graph pass can check it."""
    inputs = [x, *layer.parameters()]

    def run():
        y = layer(x)
        torch.autograd.grad(y, inputs, grad)
        return y

    return run


_PROFILED_STEPS = 200


def _host_profile(step, device, lines: int = 25) -> str:
    """The top ``lines`` functions by cumulative host time over ``_PROFILED_STEPS`` eager calls of
    ``step`` (cProfile), as text."""
    import cProfile
    import io
    import pstats

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    step()
    synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(_PROFILED_STEPS):
        step()
    synchronize()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(lines)
    return text.getvalue()


def benchmark(args: argparse.Namespace, device: torch.device, *, graphs: bool | None = None) -> dict:
    """All measurements as one dict (see module docstring), also written to ``args.out`` as JSON:
    once before the CUDA-graph timings (``graphs``, default on CUDA), which come last because a
    library call that breaks capture could leave the device unusable."""
    import triton

    from snack.backends import default_backend_name

    dtype = _DTYPES[args.dtype]
    bandwidth = _copy_bandwidth(device)
    spmm, graph_jobs = _spmm_rows(args, device, dtype, bandwidth)
    train, train_graph_jobs = _train_rows(args, device, dtype)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "dtype": args.dtype,
        "copy_bandwidth_GBps": bandwidth / 1e9,
        # what the layers and snack_op ran on (a Triton that fails to load falls back, with a warning)
        "default_backend": default_backend_name(device.type),
        "spmm": spmm,
        "train": train,
        "autotuned": _autotuned_configs(),
    }
    _write_json(args.out, result)
    if device.type == "cuda" if graphs is None else graphs:
        for entry, fns in graph_jobs + train_graph_jobs:
            entry["graph_us"] = {name: _graph_us(fn) for name, fn in fns.items()}
        _write_json(args.out, result)
    return result


def _autotuned_configs() -> dict[str, dict[str, str]]:
    """kernel → {autotune key: the config it picked}; empty without autotuning."""
    from snack.backends.triton import tuning

    return {
        name: {str(key): str(config) for key, config in tuned.cache.items()}
        for name, tuned in tuning.TUNED.items()
        if tuned is not None
    }


def _write_json(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


def print_tables(result: dict) -> None:
    spmm = result["spmm"]
    print(f"device {result['device']}, layers on backend {result['default_backend']!r}")
    print(
        f"\nSpMM {spmm['size']} at sparsity {spmm['sparsity']} ({result['dtype']}), median µs; "
        "ratios = baseline / best of segment, pointer"
    )
    head = f"{'B':>3} {'form':>8} " + " ".join(f"{v:>10}" for v in SPMM_VARIANTS)
    print(head + f" {'limit':>7} {'mask/sn':>8} {'csr/sn':>7} {'dense/sn':>8}")
    for row in spmm["rows"]:
        t = row["us"]
        best = min(t["segment"], t["pointer"])
        cells = " ".join(_cell(t.get(v), 10) for v in SPMM_VARIANTS)
        ratios = " ".join(
            f"{t[v] / best:{w}.2f}" if t[v] is not None else f"{'-':>{w}}"
            for v, w in (("dense_mask", 8), ("csr", 7), ("dense", 8))
        )
        print(f"{row['batch']:>3} {row['heuristic_form']:>8} {cells} {row['bw_limit_us']:7.1f} {ratios}")
    print("\nSame, replayed from a CUDA graph (GPU time, no launch overhead; '-' = not capturable)")
    print(f"{'B':>3} {'':>8} " + " ".join(f"{v:>10}" for v in SPMM_VARIANTS) + f" {'mask/sn':>8} {'csr/sn':>7}")
    for row in spmm["rows"]:
        g = row.get("graph_us", {})
        cells = " ".join(f"{g[v]:10.1f}" if g.get(v) is not None else f"{'-':>10}" for v in SPMM_VARIANTS)
        snack_times = [g[v] for v in ("segment", "pointer") if g.get(v) is not None]
        ratios = [
            f"{g[v] / min(snack_times):{w}.2f}" if snack_times and g.get(v) is not None else f"{'-':>{w}}"
            for v, w in (("dense_mask", 8), ("csr", 7))
        ]
        print(f"{row['batch']:>3} {'':>8} {cells} {' '.join(ratios)}")
    train = result["train"]
    print(f"\nTraining step (fwd + bwd) {train['size']} at sparsity {train['sparsity']}, median µs:")
    print(
        "eager step of the layer (backward on autograd's worker thread, then on the calling thread: *_1t);\n"
        "the step replayed from a CUDA graph (*_g); its three products one by one from CUDA graphs"
    )
    head = (
        f"{'B':>3} {'snack':>9} {'nn.Linear':>9} {'speedup':>8} {'snack_1t':>9} {'linear_1t':>9} {'speedup':>8} "
        f"{'snack_g':>9} {'linear_g':>9} {'speedup':>8} "
    )
    print(head + " ".join(f"{op:>9}" for op in _STEP_OPS) + " speedup")
    for row in train["rows"]:
        g = row.get("graph_us", {})
        products = [g.get(op) for op in _STEP_OPS]
        ops_speedup = "-" if None in products else f"{sum(products[3:]) / sum(products[:3]):.2f}"
        steps = [g.get(name) for name in _WHOLE_STEPS]
        step_speedup = "-" if None in steps else f"{steps[1] / steps[0]:.2f}"
        us = row["us"]
        print(
            f"{row['batch']:>3} {us['snack']:9.1f} {us['dense']:9.1f} {row['speedup_vs_dense']:8.2f} "
            f"{us['snack_calling_thread']:9.1f} {us['dense_calling_thread']:9.1f} "
            f"{us['dense_calling_thread'] / us['snack_calling_thread']:8.2f} "
            f"{' '.join(_cell(v, 9) for v in steps)} {step_speedup:>8} "
            f"{' '.join(_cell(g.get(op), 9) for op in _STEP_OPS)} {ops_speedup:>7}"
        )
    print(
        "\nThe SDDMM's two forms; the transposed SpMM's column walk and the backward as layers run them; then\n"
        "the prepared variants: the backward's row walk, the transposed SpMM and the SDDMM by patches of 64\n"
        "segments × a band of BAND inputs (backward and patch SDDMM: bias gradient included), from CUDA graphs (µs):"
    )
    print(f"{'':>19} " + " ".join(f"{'B=' + str(row['batch']):>8}" for row in train["rows"]))
    for op in _VARIANT_OPS:
        print(f"{op:>19} " + " ".join(_cell(row.get("graph_us", {}).get(op), 8) for row in train["rows"]))
    _print_prepared_verdicts(spmm["rows"], train["rows"])
    print(f"\nHost profile of the eager snack step ({train['host_profile'].splitlines()[0]}):")
    print("\n".join(train["host_profile"].splitlines()[1:]))
    if result.get("autotuned"):
        print("Autotuned configs:")
        for name, picks in result["autotuned"].items():
            for key, config in picks.items():
                print(f"  {name} {key}: {config}")


def _print_prepared_verdicts(spmm_rows: list[dict], train_rows: list[dict]) -> None:
    """Each prepared variant against what layers run, from the CUDA-graph times: the ratio
    current / prepared (above 1: the prepared variant is faster), and the training step as it
    would be with the row walk, or the fastest patches, in place of what they replace (an
    estimate: the step's time plus the difference of the kernels' times)."""
    print("\nPrepared variants against what layers run, from CUDA graphs: current µs / prepared µs (> 1: faster)")
    for row in spmm_rows:
        g = row.get("graph_us", {})
        cells = [f"{v} {_ratio(g.get('pointer'), g.get(v))}" for v in _PATCH_SPMM_VARIANTS if v in row["us"]]
        if cells:
            print(f"  SpMM       B={row['batch']:<3} pointer / " + ", ".join(cells))
    for row in train_rows:
        g = row.get("graph_us", {})
        print(
            f"  training   B={row['batch']:<3} backward[column] / backward[row] "
            f"{_ratio(g.get('backward[column]'), g.get('backward[row]'))}"
        )
        fastest = {}  # op -> (what layers run, its time, the fastest patches' time)
        for op, current in (("spmm_t", "spmm_t[pointer]"), ("sddmm", "sddmm[pointer]")):
            patches = {v: g[v] for v in _PREPARED if v.startswith(f"{op}[patches/") and g.get(v) is not None}
            cells = ", ".join(f"{v[len(op) + 1 : -1]} {_ratio(g.get(current), t)}" for v, t in patches.items())
            print(f"{'':18}{current} / {cells or '-'}")
            if patches and g.get(current) is not None:
                fastest[op] = g[current], min(patches.values())
        estimates = {"the row walk": [(g.get("backward[column]"), g.get("backward[row]"))]}
        estimates.update({f"the fastest {op} patches": [pair] for op, pair in fastest.items()})
        if len(fastest) == 2:
            estimates["both"] = list(fastest.values())
        step, linear = g.get("snack"), g.get("dense")
        for name, swaps in estimates.items():
            if step is not None and linear is not None and None not in (t for pair in swaps for t in pair):
                estimate = step + sum(prepared - current for current, prepared in swaps)
                print(f"{'':18}step with {name} ≈ {estimate:.1f} µs: {linear / estimate:.2f}× nn.Linear")


def _ratio(current: float | None, prepared: float | None) -> str:
    return f"{current / prepared:.2f}" if current is not None and prepared else "-"


def _cell(value: float | None, width: int) -> str:
    return f"{value:{width}.1f}" if value is not None else f"{'-':>{width}}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    result = benchmark(args, torch.device("cuda"))
    print_tables(result)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
