"""The native CPU backend against the reference backend (the oracle).

Every kernel is compared over random shapes, sparsities, batches (single row, several batch
tiles), dtypes and thread counts, plus the edge cases: no non-zeros, empty rows and columns,
non-contiguous and 3-D inputs through ``SparseLinear``, and a 100,000 × 100,000 layer.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import Tensor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import snack
from snack import backends
from snack.backends import cpu, reference
from snack.backends.cpu import native  # importing it builds the kernels; a failed build fails here
from snack.topology import Topology, TopologyTensors, random_coo

OPS = ("spmm", "spmm_t", "sddmm", "spmm_backward")
# (rtol, atol) per dtype; half and bfloat16 round each output to an 11- and 8-bit mantissa
TOLERANCE = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 1e-2),
    torch.bfloat16: (2e-2, 5e-2),
}


# The batch-1 kernels' ways of reaching the entries their columns pick, on this build (AVX-512
# builds have two, which must agree bit for bit; others one, None).
GATHER_MODES_HERE = list(native.GATHER_MODES) if native.gather_mode() else [None]


@pytest.fixture(params=GATHER_MODES_HERE, ids=str)
def gather_mode(request):
    before = native.gather_mode()
    if request.param:
        native.set_gather_mode(request.param)
    yield request.param
    if before:
        native.set_gather_mode(before)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def operands(op: str, topo: Topology, batch: int, dtype: torch.dtype, generator: torch.Generator):
    """The two dense/value inputs of ``op``: ``(x, values)``, ``(dy, values)`` or ``(dy, x)``."""
    out_features, in_features = topo.shape

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)

    values = randn(topo.nnz)
    x, dy = randn(batch, in_features), randn(batch, out_features)
    return {"spmm": (x, values), "spmm_t": (dy, values), "sddmm": (dy, x), "spmm_backward": (dy, x, values)}[op]


def reference_op(op: str, *args):
    """The reference result(s) of ``op`` as a tuple; the fused backward is spmm_t and sddmm, and
    with the bias gradient (``bias_grad=True``) also Σ_b dy."""
    if op == "spmm_backward":
        dy, x, values, topo = args
        return reference.spmm_t(dy, values, topo), reference.sddmm(dy, x, topo), dy.sum(0)
    return (getattr(reference, op)(*args),)


def native_op(op: str, *args):
    """``cpu.<op>(*args)`` as a tuple, the fused backward with its bias gradient (as ``reference_op``)."""
    if op == "spmm_backward":
        return native.spmm_backward(*args, bias_grad=True)
    return (getattr(native, op)(*args),)


def assert_matches_reference(op: str, topo: Topology, batch: int, dtype: torch.dtype, seed: int = 0) -> None:
    inputs = operands(op, topo, batch, dtype, torch.Generator().manual_seed(seed))
    tensors = topo.tensors()
    # the oracle runs in float64 from the same (rounded) inputs
    expected = reference_op(op, *(t.double() for t in inputs), tensors)
    if op == "spmm_backward":  # with and without the bias gradient (summed while packing dy's tiles)
        with_bias = native.spmm_backward(*inputs, tensors, bias_grad=True)
        runs = [(with_bias, expected), (native.spmm_backward(*inputs, tensors), expected[:2])]
    else:
        runs = [(native_op(op, *inputs, tensors), expected)]
    rtol, atol = TOLERANCE[dtype]
    for got, wanted in runs:
        for g, e in zip(got, wanted, strict=True):
            assert g.dtype == dtype
            assert g.shape == e.shape
            torch.testing.assert_close(g.double(), e, rtol=rtol, atol=atol)


def random_topology(out_features: int, in_features: int, sparsity: float, seed: int = 0) -> Topology:
    row, col = random_coo(out_features, in_features, sparsity, generator=torch.Generator().manual_seed(seed))
    return Topology(row, col, (out_features, in_features))


def test_native_backend_is_the_cpu_default():
    # a broken build would make the registry warn and fall back to the reference: fail instead
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert backends.default_backend_name("cpu") == "cpu"
    assert backends.resolve(torch.device("cpu")) is native


def test_ops_dispatch_to_native_kernels(monkeypatch):
    calls = []
    for name in OPS:
        original = getattr(native, name)
        monkeypatch.setattr(
            native, name, lambda *args, name=name, original=original, **kw: calls.append(name) or original(*args, **kw)
        )
    layer = snack.SparseLinear(16, 8, sparsity=0.5)
    x = torch.randn(3, 16, requires_grad=True)
    layer(x).sum().backward()
    # a training step: forward, then the fused backward (dX, dvalues and dbias in one pass)
    assert calls == ["spmm", "spmm_backward"]
    torch.testing.assert_close(layer.bias.grad, torch.full((8,), 3.0))
    calls.clear()
    layer(torch.randn(3, 16)).sum().backward()  # only dvalues wanted
    assert calls == ["spmm", "sddmm"]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
# 16, 32 and 64 fill whole 512-bit vectors, 8 and 24 whole 256-bit ones; 3, 70 and 130 leave
# partial tiles
@pytest.mark.parametrize("batch", [1, 3, 8, 16, 24, 32, 64, 70, 130])
def test_kernels_match_reference(op, dtype, batch, threads):
    # 400 × 200 at 50%: enough work that two threads really split it, also at batch 1 (the
    # kernels run serially below 2^15 multiply-adds); 130 spans several tiles
    topo = random_topology(400, 200, 0.5)
    assert topo.nnz >= 1 << 15
    assert_matches_reference(op, topo, batch, dtype)


@pytest.mark.parametrize("op", ["spmm_t", "spmm_backward"])
def test_many_tiles_beyond_the_accumulator_budget_run_a_region_per_tile(op, threads):
    # the scatter kernels run every batch tile in one parallel region while the threads'
    # accumulators for all tiles fit 8 MiB; here (in = 4096, batch 600: about 20 MiB on two
    # threads) they fall back to one region per tile
    assert_matches_reference(op, random_topology(64, 4096, 0.99), 600, torch.float32)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    "shape, sparsity",
    [((1, 1), 0.0), ((1, 97), 0.3), ((97, 1), 0.3), ((5, 3), 0.0), ((33, 65), 0.99), ((257, 129), 0.9)],
)
def test_odd_shapes(op, shape, sparsity, threads):
    for batch in (1, 5, 17):
        assert_matches_reference(op, random_topology(*shape, sparsity), batch, torch.float64)


@pytest.mark.parametrize("op", ["spmm", "spmm_t", "spmm_backward"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_batch_one_kernels_cover_every_row_length(op, dtype, threads, gather_mode):
    # the batch-1 kernels handle a row sixteen non-zeros at a time with a masked remainder
    assert_matches_reference(op, every_row_length_topology(), 1, dtype)


def every_row_length_topology() -> Topology:
    """Row r holds r non-zeros (0 to 40: empty, partial, whole and several 16-lane vectors), at
    columns spread over the row so that consecutive rows scatter into overlapping columns."""
    row = torch.cat([torch.full((r,), r, dtype=torch.int32) for r in range(41)])
    col = torch.cat([(torch.arange(r) * 7 + r) % 48 for r in range(41)]).int()
    order = torch.argsort(row.long() * 48 + col.long())
    return Topology(row[order], col[order], (41, 48))


def batch_one_kernels(topo: Topology, dtype: torch.dtype, seed: int = 0) -> dict[str, tuple[Tensor, ...]]:
    """Every batch-1 kernel's outputs on random inputs: the forward with 32-bit columns and (up to
    65536 inputs) 16-bit ones, spmm_t, and the fused backward with the bias gradient."""
    generator = torch.Generator().manual_seed(seed)
    out_features, in_features = topo.shape
    x, dy = (torch.randn(1, n, generator=generator).to(dtype) for n in (in_features, out_features))
    values = torch.randn(topo.nnz, generator=generator).to(dtype)
    t, ops = topo.tensors(), torch.ops.snack_cpu
    outputs = {
        "spmm": (ops.spmm(x, values, t.rowptr, t.col),),
        "spmm_t": (ops.spmm_t(dy, values, t.rowptr, t.col, in_features),),
        "spmm_backward": ops.spmm_backward(dy, x, values, t.rowptr, t.col, True, True),
    }
    if in_features <= 1 << 16:
        outputs["spmv_u16"] = (ops.spmv_u16(x, values, t.rowptr, native.narrow_columns(t.col)),)
    return outputs


@pytest.mark.skipif(native.gather_mode() is None, reason="a build without AVX-512 has one gather mode")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape, sparsity", [((41, 48), None), ((300, 70_000), 0.999), ((257, 1000), 0.9)])
def test_gather_modes_give_bit_identical_results(dtype, shape, sparsity, threads):
    # the scalar loads and stores add the same products in the same lanes as the instructions
    topo = every_row_length_topology() if sparsity is None else random_topology(*shape, sparsity)
    before, outputs = native.gather_mode(), {}
    try:
        for mode in native.GATHER_MODES:
            native.set_gather_mode(mode)
            outputs[mode] = batch_one_kernels(topo, dtype)
    finally:
        native.set_gather_mode(before)
    for kernel, vector in outputs["vector"].items():
        assert all(torch.equal(a, b) for a, b in zip(vector, outputs["scalar"][kernel], strict=True)), kernel


@pytest.mark.parametrize("op", OPS)
def test_no_nonzeros(op, threads):
    empty = torch.empty(0, dtype=torch.int32)
    topo = Topology(empty, empty, (6, 4))
    for batch in (1, 9):
        inputs = operands(op, topo, batch, torch.float32, torch.Generator().manual_seed(0))
        got = getattr(native, op)(*inputs, topo.tensors())
        got = got if isinstance(got, tuple) else (got,)
        expected_shapes = {"spmm": [(batch, 6)], "spmm_t": [(batch, 4)], "sddmm": [(0,)],
                           "spmm_backward": [(batch, 4), (0,)]}[op]
        assert [tuple(g.shape) for g in got] == expected_shapes
        assert not any(g.any() for g in got)


@pytest.mark.parametrize("op", OPS)
def test_empty_rows_and_columns(op, threads):
    # rows 0, 2, 5 and columns 1, 3, 4 hold nothing; row 4 is dense over the used columns
    row = torch.tensor([1, 1, 3, 4, 4, 4, 6], dtype=torch.int32)
    col = torch.tensor([0, 5, 2, 0, 2, 5, 6], dtype=torch.int32)
    topo = Topology(row, col, (7, 8))
    for batch in (1, 4, 12):
        assert_matches_reference(op, topo, batch, torch.float64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", ["spmm", "spmm_t", "sddmm"])
def test_the_reference_sums_half_precision_in_float32(op, dtype):
    """Sums of 4,096 terms: in bfloat16 the reference's spmm was 7e-2 off (relative), against
    3e-3 for the native kernels and ``F.linear``, which round only the output."""
    topo = random_topology(8192, 16, 0.5) if op == "spmm_t" else random_topology(16, 8192, 0.5)  # long sums
    inputs = operands(op, topo, 64 if op == "sddmm" else 4, torch.float64, torch.Generator().manual_seed(0))
    exact = reference_op(op, *inputs, topo.tensors())[0]
    rounded = [t.to(dtype) for t in inputs]
    for backend in (reference, native):
        got = getattr(backend, op)(*rounded, topo.tensors())
        assert got.dtype == dtype
        # the inputs' own rounding allows ~1e-2 for bfloat16; summing in it was several times that
        assert float((got.double() - exact).norm() / exact.norm()) < (1e-2 if dtype == torch.bfloat16 else 2e-3)


@pytest.mark.parametrize("op", OPS)
def test_a_weight_without_rows_or_columns(op, threads):
    """``out_features == 0`` or ``in_features == 0``: hand-built topology tensors reach the kernels
    through the custom ops (a 0-row weight used to divide by zero in the transposed SpMM)."""
    empty = torch.empty(0, dtype=torch.int32)
    for out_features, in_features in ((0, 5), (5, 0)):
        topo = TopologyTensors(
            empty, empty, torch.zeros(out_features + 1, dtype=torch.int32),
            torch.zeros(in_features + 1, dtype=torch.int32), empty,
        )
        generator = torch.Generator().manual_seed(0)
        dense = {"x": torch.randn(3, in_features, generator=generator),
                 "dy": torch.randn(3, out_features, generator=generator), "values": torch.empty(0)}
        inputs = {"spmm": ("x", "values"), "spmm_t": ("dy", "values"), "sddmm": ("dy", "x"),
                  "spmm_backward": ("dy", "x", "values")}[op]
        args = [dense[name] for name in inputs]
        for g, e in zip(native_op(op, *args, topo), reference_op(op, *args, topo), strict=True):
            assert g.shape == e.shape
            torch.testing.assert_close(g, e)  # zeros, but the bias gradient Σ_b dy when there are rows


def test_non_contiguous_coordinates_work_at_every_batch():
    """Coordinates taken as the columns of an ``(nnz, 2)`` tensor: the topology stores them
    contiguous, so the kernels (which need that) take them at every batch."""
    coordinates = torch.tensor([[0, 1], [1, 0], [1, 2], [2, 2]], dtype=torch.int32)
    topo = Topology(coordinates[:, 0], coordinates[:, 1], (3, 3))
    for batch in (1, 2, 17):
        assert_matches_reference("spmm", topo, batch, torch.float64)
        assert_matches_reference("spmm_backward", topo, batch, torch.float64)


_AFTER_FAILED_ALLOCATION = """
import resource, torch
from snack.backends.cpu import native
from snack.topology import Topology
torch.set_num_threads(1)
row, col = torch.zeros(4, dtype=torch.int32), torch.arange(4, dtype=torch.int32)
small, big = Topology(row, col, (1, 8)).tensors(), Topology(row, col, (1, 200_000)).tensors()
values, x_small, x_big = torch.randn(4), torch.randn(64, 8), torch.randn(64, 200_000)
expected = native.spmm(x_small, values, small)
vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, (vm + (16 << 20), hard))  # too little for the big pack's 51 MB
try:
    native.spmm(x_big, values, big)
    raise SystemExit("the big call did not fail")
except RuntimeError as error:
    assert "out of memory allocating" in str(error), error
finally:
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
assert torch.equal(native.spmm(x_small, values, small), expected)  # same thread, same scratch pool
print("ok")
"""


@pytest.mark.skipif(bool(os.environ.get("SNACK_CPU_SANITIZE")), reason="ASan reserves more address space than this")
def test_a_failed_scratch_allocation_leaves_the_kernels_usable():
    script = [sys.executable, "-c", _AFTER_FAILED_ALLOCATION]
    result = subprocess.run(script, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", (result.returncode, result.stderr[-3000:])


@pytest.mark.parametrize("op", OPS)
def test_empty_batch(op):
    topo = random_topology(5, 7, 0.5)
    inputs = operands(op, topo, 0, torch.float32, torch.Generator().manual_seed(0))
    for g, e in zip(native_op(op, *inputs, topo.tensors()), reference_op(op, *inputs, topo.tensors()), strict=True):
        assert g.shape == e.shape
        torch.testing.assert_close(g, e)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    out_features=st.integers(1, 70),
    in_features=st.integers(1, 70),
    sparsity=st.sampled_from([0.0, 0.5, 0.9, 0.99]),
    batch=st.integers(1, 80),
    op=st.sampled_from(OPS),
    seed=st.integers(0, 2**16),
)
def test_random_shapes(out_features, in_features, sparsity, batch, op, seed, threads):
    topo = random_topology(out_features, in_features, sparsity, seed)
    assert_matches_reference(op, topo, batch, torch.float64, seed)


def layer_pair(in_features, out_features, sparsity, dtype):
    """A SparseLinear and an identical copy, for running the same layer on two backends."""
    torch.manual_seed(0)
    layer = snack.SparseLinear(in_features, out_features, sparsity=sparsity, dtype=dtype)
    twin = snack.SparseLinear.from_coo(layer.row, layer.col, layer.values.detach(), (out_features, in_features),
                                       bias=layer.bias.detach())
    return layer, twin


def run_layer(layer, x):
    """Forward and backward of ``layer`` on ``x``; returns ``(y, dx, dvalues, dbias)``."""
    x = x.detach().requires_grad_()
    y = layer(x)
    y.backward(torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape))
    return y.detach(), x.grad, layer.values.grad, layer.bias.grad


@pytest.mark.parametrize(
    "make_input",
    [
        pytest.param(lambda: torch.randn(5, 40, dtype=torch.float64)[:, ::2], id="non-contiguous"),
        pytest.param(lambda: torch.randn(20, 6, dtype=torch.float64).t(), id="transposed"),
        pytest.param(lambda: torch.randn(2, 3, 20, dtype=torch.float64), id="3-D"),
        pytest.param(lambda: torch.randn(20, dtype=torch.float64), id="1-D"),
    ],
)
def test_sparse_linear_inputs_match_reference(make_input, threads):
    native, oracle = layer_pair(20, 30, 0.7, torch.float64)
    x = make_input()
    got = run_layer(native, x)
    with snack.use_backend("reference"):
        expected = run_layer(oracle, x)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def test_gradcheck_through_sparse_linear(threads):
    layer = snack.SparseLinear(9, 7, sparsity=0.6, dtype=torch.float64)
    x = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    values = layer.values.detach().clone().requires_grad_()
    topology = layer.topology

    def f(x, values):
        return snack.ops.sparse_linear(x, values, topology, layer.bias)

    assert torch.autograd.gradcheck(f, (x, values))
    assert torch.autograd.gradgradcheck(f, (x, values))


def test_float32_training_step_matches_reference(threads):
    native, oracle = layer_pair(256, 128, 0.9, torch.float32)
    x = torch.randn(32, 256)
    got = run_layer(native, x)
    with snack.use_backend("reference"):
        expected = run_layer(oracle, x)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


def test_large_layer():
    # 100,000 × 100,000 at 99.99%: a million non-zeros; the dense weight would be 40 GB
    topo = random_topology(100_000, 100_000, 0.9999)
    assert topo.nnz == 1_000_000
    for op in OPS:
        assert_matches_reference(op, topo, 3, torch.float32)


@pytest.mark.parametrize("batch", [1, 2, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_spmm_adds_the_bias_in_the_kernel(batch, dtype, threads):
    topo = random_topology(37, 50, 0.7)
    generator = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, 50, generator=generator, dtype=torch.float64).to(dtype)
    values = torch.randn(topo.nnz, generator=generator, dtype=torch.float64).to(dtype)
    bias = torch.randn(37, generator=generator, dtype=torch.float64).to(dtype)
    got = native.spmm(x, values, topo.tensors(), bias)
    expected = reference.spmm(x.double(), values.double(), topo.tensors(), bias.double())
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_backward_runs_in_two_passes_where_fusing_saves_none(dtype, threads):
    # fused, dX and dvalues keep two (in, W) tiles in L2; where that forces tiles half as wide as
    # spmm_t and sddmm use alone (as many passes over the weight), spmm_backward runs those two
    # instead (the L2 size sets where)
    fuses = torch.ops.snack_cpu.fuses_backward
    assert fuses(1, 200, dtype) and fuses(32, 200, dtype)
    batch = 32
    in_features = next((2**k for k in range(8, 22) if not fuses(batch, 2**k, dtype)), None)
    assert in_features is not None, "no width up to 2^21 inputs makes the fused backward halve its tile"
    topo = random_topology(40, in_features, 1 - 2000 / (40 * in_features))
    for n in (200, in_features):  # the default is the kernel fuses_backward names, bit for bit
        t = topo.tensors() if n == in_features else random_topology(40, n, 0.5).tensors()
        dy, x = torch.randn(batch, 40, dtype=dtype), torch.randn(batch, n, dtype=dtype)
        values = torch.randn(t.col.numel(), dtype=dtype)
        default = native.spmm_backward(dy, x, values, t)
        chosen = native.spmm_backward(dy, x, values, t, fuse=fuses(batch, n, dtype))
        assert all(torch.equal(a, b) for a, b in zip(default, chosen))
    assert_matches_reference("spmm_backward", topo, batch, dtype)


@pytest.mark.parametrize("fuse", [True, False], ids=["one-pass", "two-passes"])
@pytest.mark.parametrize("batch", [1, 7, 24, 40, 70, 130])  # 70 and 130 span several batch tiles
def test_backward_in_one_pass_or_two_also_returns_the_bias_gradient(batch, fuse, threads):
    topo = random_topology(21, 30, 0.6)
    dy, x = torch.randn(batch, 21, dtype=torch.float64), torch.randn(batch, 30, dtype=torch.float64)
    values = torch.randn(topo.nnz, dtype=torch.float64)
    dx, dvalues, dbias = native.spmm_backward(dy, x, values, topo.tensors(), bias_grad=True, fuse=fuse)
    torch.testing.assert_close(dbias, dy.sum(0))
    torch.testing.assert_close(dx, reference.spmm_t(dy, values, topo.tensors()))
    torch.testing.assert_close(dvalues, reference.sddmm(dy, x, topo.tensors()))
    assert len(native.spmm_backward(dy, x, values, topo.tensors(), fuse=fuse)) == 2


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_batch_one_reads_16_bit_columns_up_to_65536(dtype, gather_mode):
    # columns >= 32768 are stored as negative int16 bit patterns and must read back unsigned
    topo = random_topology(5, 65_536, 0.99)
    assert int(topo.col.max()) >= 1 << 15
    narrow = native.narrow_columns(topo.col)
    assert narrow.dtype == torch.int16 and narrow.numel() == topo.nnz
    assert torch.equal(narrow.long() % (1 << 16), topo.col.long())
    rtol, atol = TOLERANCE[dtype]
    # wider layers take the 32-bit kernel
    for topo in (topo, random_topology(3, 70_000, 0.999)):
        x, values = torch.randn(1, topo.shape[1], dtype=dtype), torch.randn(topo.nnz, dtype=dtype)
        expected = reference.spmm(x.double(), values.double(), topo.tensors())
        torch.testing.assert_close(native.spmm(x, values, topo.tensors()).double(), expected, rtol=rtol, atol=atol)


def test_layers_built_under_inference_mode(monkeypatch):
    # inference tensors have no version counter: batch 1 takes the 32-bit kernel instead of the cache
    narrowed = []
    original = native.narrow_columns
    monkeypatch.setattr(native, "narrow_columns", lambda col: narrowed.append(col) or original(col))
    with torch.inference_mode():
        layer = snack.SparseLinear(40, 30, sparsity=0.6)
        for batch in (1, 3):
            x = torch.randn(batch, 40)
            expected = reference.spmm(x, layer.values, layer.topology.tensors(), layer.bias)
            torch.testing.assert_close(layer(x), expected)
    assert not narrowed
    with torch.no_grad():  # a normal layer's batch 1 does read the 16-bit copy
        snack.SparseLinear(40, 30, sparsity=0.6)(torch.randn(1, 40))
    assert len(narrowed) == 1


def test_16_bit_columns_follow_in_place_changes():
    # load_state_dict copies into the col buffer in place: the cached copy must not go stale
    topo = random_topology(4, 6, 0.5)
    before = native.narrow_columns(topo.col)
    assert native.narrow_columns(topo.col) is before  # cached
    topo.col.copy_(topo.col.flip(0))
    after = native.narrow_columns(topo.col)
    assert torch.equal(after.long(), topo.col.long())


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda t: torch.ops.snack_cpu.spmm(torch.randn(2, 4), torch.randn(3, dtype=torch.float64), t.rowptr, t.col),
         "dtype"),
        (lambda t: torch.ops.snack_cpu.spmm(torch.randn(2, 4), torch.randn(3), t.rowptr.long(), t.col), "int32"),
        (lambda t: torch.ops.snack_cpu.spmm(torch.randn(2, 4), torch.randn(2), t.rowptr, t.col), "same length"),
        (lambda t: torch.ops.snack_cpu.spmm_t(torch.randn(2, 5), torch.randn(3), t.rowptr, t.col, 4), "shape"),
        (lambda t: torch.ops.snack_cpu.sddmm(torch.randn(2, 3), torch.randn(5, 4), t.rowptr, t.col), "batch"),
        (lambda t: torch.ops.snack_cpu.sddmm(torch.randn(2, 5), torch.randn(2, 4), t.rowptr, t.col),
         "dy must have shape \\(B, 3\\)"),
        (lambda t: torch.ops.snack_cpu.spmm_backward(torch.randn(2, 3), torch.randn(5, 4), torch.randn(3), t.rowptr,
                                                     t.col), "x \\(B, in\\)"),
        (lambda t: torch.ops.snack_cpu.spmm(torch.randn(2, 4), torch.randn(3), t.rowptr, t.col, torch.randn(4)),
         "bias must be a contiguous \\(3,\\)"),
        (lambda t: torch.ops.snack_cpu.spmv_u16(torch.randn(1, 4), torch.randn(3), t.rowptr, t.col.short(),
                                                torch.randn(3, dtype=torch.float64)), "dtype"),
        (lambda t: torch.ops.snack_cpu.spmv_u16(torch.randn(2, 4), torch.randn(3), t.rowptr, t.col.short()), "\\(1, in\\)"),
        (lambda t: torch.ops.snack_cpu.spmv_u16(torch.randn(1, 4), torch.randn(3), t.rowptr, t.col), "int16"),
        (lambda t: torch.ops.snack_cpu.fuses_backward(-1, 4, torch.float32), "batch and in_features must be >= 0"),
    ],
    ids=["dtype", "index-dtype", "length", "dy-shape", "batch", "sddmm-dy-shape", "fused-batch", "bias-shape", "u16-bias-dtype",
         "u16-batch", "u16-index-dtype", "fuses-negative-batch"],
)
def test_native_ops_reject_bad_input(call, message):
    topo = Topology(torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([1, 0, 3], dtype=torch.int32), (3, 4))
    with pytest.raises(RuntimeError, match=message):
        call(topo.tensors())


def _gather_mode_in_a_new_process(setting: str | None) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "SNACK_CPU_GATHER"}
    if setting is not None:
        env["SNACK_CPU_GATHER"] = setting
    script = "from snack.backends.cpu import native; print(native.gather_mode())"
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)


def _cpu_vendor() -> str | None:
    """The CPU's vendor string (``"AuthenticAMD"``, ``"GenuineIntel"``), where Linux says it."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("vendor_id")), None)


@pytest.mark.skipif(native.gather_mode() is None, reason="a build without AVX-512 has one gather mode")
def test_the_gather_mode_defaults_by_cpu_vendor_and_follows_the_environment():
    vendor = _cpu_vendor()
    if vendor is None:
        pytest.skip("no /proc/cpuinfo to read the CPU vendor from")
    default = _gather_mode_in_a_new_process(None)
    assert default.stdout.split() == ["scalar" if vendor == "AuthenticAMD" else "vector"], default.stderr[-2000:]
    for mode in native.GATHER_MODES:
        chosen = _gather_mode_in_a_new_process(mode)
        assert chosen.stdout.split() == [mode], chosen.stderr[-2000:]


def test_a_bad_gather_mode_is_refused():
    before = native.gather_mode()
    with pytest.raises(ValueError, match=r"gather mode must be one of \('vector', 'scalar'\), got 'fast'"):
        native.set_gather_mode("fast")
    assert native.gather_mode() == before
    with pytest.raises(RuntimeError, match="mode must be 'vector' or 'scalar', got 'fast'|no AVX-512 gathers"):
        torch.ops.snack_cpu.set_gather_mode("fast")
    assert native.gather_mode() == before


_BAD_GATHER_ENVIRONMENT = """
import warnings, torch, snack
from snack import backends
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    layer = snack.SparseLinear(8, 6)  # construction's index helpers reach the backend first
    layer(torch.randn(1, 8))
assert backends.default_backend_name("cpu") == "reference"
print([str(w.message) for w in caught if w.category is RuntimeWarning])
"""


def test_a_bad_gather_environment_makes_the_backend_unavailable_with_a_warning():
    env = {**os.environ, "SNACK_CPU_GATHER": "fast"}
    result = subprocess.run([sys.executable, "-c", _BAD_GATHER_ENVIRONMENT], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "snack backend 'cpu' is unavailable: ValueError: SNACK_CPU_GATHER must be one of ('vector', 'scalar') " \
        "or unset, got 'fast'; falling back" in result.stdout, result.stdout


# Run in a fresh process: the vector ISA is chosen when torch is imported.
_OTHER_ISA_CHECK = """
import torch
import snack
from snack.backends import cpu, reference
from snack.backends.cpu import native
from snack.dst import prune_grow
from snack.ranking import ordering_keys
from snack.topology import Topology, TopologyTensors, random_coo
assert torch.backends.cpu.get_cpu_capability() == "{isa}", torch.backends.cpu.get_cpu_capability()
assert "_{isa_lower}_" in str(cpu.build())
# one way to gather: no mode to set, and SNACK_CPU_GATHER (set by the test) warns
assert native.gather_mode() is None
try:
    native.set_gather_mode("scalar")
    raise AssertionError("set_gather_mode did not refuse")
except RuntimeError as error:
    assert "without AVX-512 gathers" in str(error), error
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    native._gather_mode_from_environment()
assert any("SNACK_CPU_GATHER=vector has no effect" in str(w.message) for w in caught), caught
for threads in (1, 2):
    torch.set_num_threads(threads)
    for out_features, in_features, sparsity in ((37, 50, 0.6), (300, 200, 0.9)):
        topo = Topology(*random_coo(out_features, in_features, sparsity), (out_features, in_features))
        t = topo.tensors()
        for batch in (1, 5, 32):
            for dtype in (torch.float32, torch.float64):
                x = torch.randn(batch, in_features, dtype=dtype)
                dy = torch.randn(batch, out_features, dtype=dtype)
                values = torch.randn(topo.nnz, dtype=dtype)
                bias = torch.randn(out_features, dtype=dtype)
                close = lambda a, b: torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
                close(native.spmm(x, values, t, bias), reference.spmm(x, values, t, bias))
                close(native.spmm_t(dy, values, t), reference.spmm_t(dy, values, t))
                close(native.sddmm(dy, x, t), reference.sddmm(dy, x, t))
                dx, dvalues, dbias = native.spmm_backward(dy, x, values, t, bias_grad=True)
                close(dx, reference.spmm_t(dy, values, t))
                close(dvalues, reference.sddmm(dy, x, t))
                close(dbias, dy.sum(0))
                # RigL's gradient scores (grow_scores.cpp), exact on integer records
                xi, dyi = x.round(), dy.round()
                scores = prune_grow._GradientScores(xi, dyi, topo)
                assert scores.native
                for bar in (0, int(torch.median(ordering_keys((dyi.t() @ xi).abs())))):
                    scores.native = True
                    got = scores.above(1, out_features, bar, False)
                    scores.native = False
                    assert all(torch.equal(a, b) for a, b in zip(got, scores.above(1, out_features, bar, False)))
                # SRigL's pick per row, collect_row's compares under a sampled bar (exact likewise)
                quotas = (in_features - topo.rowptr.diff().long()) // 3
                got = prune_grow.gradient_grow_rows(xi, dyi, topo, quotas)
                with snack.use_backend("reference"):
                    assert torch.equal(got, prune_grow.gradient_grow_rows(xi, dyi, topo, quotas))
# take_or_fill's vector gathers (4- and 8-byte elements) and the scalar loop after them
for dtype in (torch.float32, torch.int64, torch.bfloat16):
    for n in (0, 7, 1 << 17):
        values = (torch.randn(n + 3) * 10).to(dtype)
        src = torch.randint(-1, n + 3, (n,))
        expected = torch.where(src >= 0, values[src.clamp(min=0)], torch.ones((), dtype=dtype))
        assert torch.equal(torch.ops.snack_cpu.take_or_fill(values, src, 1), expected)
src = torch.zeros(1 << 17, dtype=torch.int64)
src[[70001, 70003]] = -5
try:
    torch.ops.snack_cpu.take_or_fill(torch.zeros(7), src, 0.0)
    raise AssertionError("src out of range was not refused")
except IndexError as error:
    assert "src[70001] = -5" in str(error), error
# the recurrent cells' kernels (8-wide vectors or scalar code, SLEEF's tanh of that width): widths
# that are not a multiple of the vector, against the torch calls
from snack.nn import recurrent_cells as cells
for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
    pre, c, dh, dc = (torch.randn(5, w, dtype=dtype) * 3 for w in (4 * 19, 19, 19, 19))
    h_new, c_new = torch.ops.snack_cpu.lstm_cell(pre, c)
    want = cells.lstm_cell_reference(pre, c)
    got = (h_new, c_new, *torch.ops.snack_cpu.lstm_cell_backward(dh, dc, pre, c, c_new))
    want = (*want, *cells.lstm_cell_grads(dh, dc, pre, c, want[1]))
    gx, gh, h = (torch.randn(5, w, dtype=dtype) * 3 for w in (3 * 19, 3 * 19, 19))
    got += (torch.ops.snack_cpu.gru_cell(gx, gh, h), *torch.ops.snack_cpu.gru_cell_backward(dh, gx, gh, h))
    want += (cells.gru_cell_reference(gx, gh, h), *cells.gru_cell_grads(dh, gx, gh, h))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
print("ok")
"""


@pytest.mark.parametrize("isa", ["AVX2", "DEFAULT"])
def test_kernels_built_for_narrower_vector_isas(isa):
    # the build ships for the ISA torch uses on the machine: AVX2 machines (and ones without AVX)
    # compile other code paths (8-wide vectors, 8-way rather than 16-way reductions, scalar gathers)
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT" and isa == "AVX2":
        pytest.skip("this CPU has no AVX2")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": isa.lower(), "SNACK_CPU_GATHER": "vector"}
    script = _OTHER_ISA_CHECK.format(isa=isa, isa_lower=isa.lower())
    # (the first run after a kernel source changed compiles that ISA's build: under ./dev sanitize on
    # two busy cores the AddressSanitizer build alone took over 10 minutes, 2026-12-07)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_failed_build_raises_a_clear_error(tmp_path, monkeypatch):
    broken = tmp_path / "kernels.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(cpu, "_SOURCES", (broken,))
    monkeypatch.setenv("SNACK_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(cpu.BuildError, match="building snack's native CPU kernels failed"):
        cpu.build()


def test_an_unloadable_cached_library_is_rebuilt(tmp_path, monkeypatch, capsys):
    """A build killed while linking leaves a truncated library; it used to be loaded (and fail)
    on every start, each process falling back to the reference backend."""
    source = tmp_path / "kernels.cpp"
    source.write_text("extern \"C\" int snack_test_symbol() { return 1; }\n")  # builds in seconds
    monkeypatch.setattr(cpu, "_SOURCES", (source,))
    monkeypatch.setenv("SNACK_CACHE_DIR", str(tmp_path / "cache"))
    name, _, _, build_dir = cpu._build_spec()
    build_dir.mkdir(parents=True)
    (build_dir / f"{name}.so").write_bytes(b"\x7fELF truncated")
    library = cpu.build()
    assert "the cached native kernels cannot be loaded" in capsys.readouterr().err
    assert library.stat().st_size > 1000  # a real library now, and it loaded


# Builds a one-function library into an empty cache once both processes have imported torch.
_RACING_BUILD = """
import sys, time
from pathlib import Path
from snack.backends import cpu
here = Path(sys.argv[1])
cpu._SOURCES = (here / "kernels.cpp",)
(here / sys.argv[2]).touch()
while not all((here / rank).exists() for rank in ("0", "1")):
    time.sleep(0.01)
print(cpu.build())
"""


def test_processes_building_at_once_take_turns(tmp_path):
    """Two processes (DDP ranks, test workers) starting on an empty cache: one compiles, the other
    waits and loads that build. Unlocked, both compiled, and one could load the other's library
    half linked, take it for broken and delete the build under it."""
    (tmp_path / "kernels.cpp").write_text("extern \"C\" int snack_test_symbol() { return 1; }\n")
    env = {**os.environ, "SNACK_CACHE_DIR": str(tmp_path / "cache")}
    ranks = [
        subprocess.Popen([sys.executable, "-c", _RACING_BUILD, str(tmp_path), rank], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        for rank in ("0", "1")
    ]
    results = [rank.communicate(timeout=300) + (rank.returncode,) for rank in ranks]
    assert [code for _, _, code in results] == [0, 0], [err[-2000:] for _, err, _ in results]
    assert results[0][0] == results[1][0], "both loaded the same library"
    assert sum("compiling native CPU kernels" in err for _, err, _ in results) == 1, [err for _, err, _ in results]


def test_a_build_killed_mid_compile_does_not_block_the_next(tmp_path):
    """cpp_extension's own lock file ("baton"), left in the build directory by a build killed while
    compiling, made every later build wait on it forever, silently."""
    (tmp_path / "kernels.cpp").write_text("extern \"C\" int snack_after_a_killed_build() { return 1; }\n")
    script = (
        "import sys; from pathlib import Path; from snack.backends import cpu\n"
        f"cpu._SOURCES = (Path({str(tmp_path / 'kernels.cpp')!r}),)\n"
        "name, _, _, build_dir = cpu._build_spec()\n"
        "build_dir.mkdir(parents=True)\n"
        "(build_dir / 'lock').touch()  # what the killed build left\n"
        "print(cpu.build())\n"
    )
    env = {**os.environ, "SNACK_CACHE_DIR": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert Path(result.stdout.strip()).stat().st_size > 1000


def test_a_cache_where_no_lock_can_be_made_still_loads_its_build(tmp_path, monkeypatch):
    """A read-only cache (shared, prebuilt) holding the build: nothing to build, so no lock needed.
    (Tested through a lock that cannot be made: root, who runs CI, writes to read-only folders.)"""
    # (a source of its own: cpp_extension names a second build of one name in a process
    # <name>_v1.so, and test_an_unloadable_cached_library_is_rebuilt builds the one-line source
    # of the test above in this process)
    (tmp_path / "kernels.cpp").write_text("extern \"C\" int snack_read_only_cache() { return 1; }\n")
    monkeypatch.setattr(cpu, "_SOURCES", (tmp_path / "kernels.cpp",))
    monkeypatch.setenv("SNACK_CACHE_DIR", str(tmp_path / "cache"))
    library = cpu.build()
    assert library.exists()

    class ReadOnly:
        def __init__(self, path):
            pass

        def acquire(self):
            raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cpu, "FileLock", ReadOnly)
    assert cpu.build() == library
    library.unlink()  # and without the build, the same cache is a clear error
    with pytest.raises(cpu.BuildError, match="PermissionError.*the build directory is"):
        cpu.build()


def test_an_unusable_cache_directory_is_a_build_error(tmp_path, monkeypatch):
    afile = tmp_path / "afile"
    afile.touch()
    monkeypatch.setattr(cpu, "_SOURCES", (afile,))
    monkeypatch.setenv("SNACK_CACHE_DIR", str(afile))
    with pytest.raises(cpu.BuildError, match="the build directory is"):
        cpu.build()


def test_sanitized_builds_are_cached_apart_and_need_the_runtime_preloaded(monkeypatch):
    monkeypatch.delenv("SNACK_CPU_SANITIZE", raising=False)
    plain_name, plain_flags, plain_ldflags, _ = cpu._build_spec()
    assert "-fsanitize=address" not in plain_flags + plain_ldflags

    monkeypatch.setenv("SNACK_CPU_SANITIZE", "address")
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libjemalloc.so")
    with pytest.raises(cpu.BuildError, match="SNACK_CPU_SANITIZE=address needs the ASan runtime preloaded"):
        cpu._build_spec()
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/gcc/x86_64-linux-gnu/12/libasan.so")
    name, flags, ldflags, build_dir = cpu._build_spec()
    assert "_address_" in name and name != plain_name and build_dir.name == name
    assert flags[: len(plain_flags)] == plain_flags
    assert "-fsanitize=address" in flags and "-fsanitize=address" in ldflags

    monkeypatch.setenv("SNACK_CPU_SANITIZE", "thread")
    with pytest.raises(cpu.BuildError, match=r"SNACK_CPU_SANITIZE must be one of \['address'\] or unset, got 'thread'"):
        cpu._build_spec()


def test_prune_deletes_only_builds_this_source_would_never_load(tmp_path, monkeypatch):
    monkeypatch.setenv("SNACK_CACHE_DIR", str(tmp_path))
    current = [cpu._library(isa, sanitizer)[0] for isa in ("AVX512", "DEFAULT") for sanitizer in (None, "address")]
    stale = ["snack_cpu_avx512_000000000000", "snack_cpu_avx2_address_111111111111"]
    for name in current + stale + ["unrelated"]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "lib.so").write_bytes(b"x")
        (tmp_path / f"{name}.lock").touch()  # build()'s lock beside each build
    assert sorted(path.name for path in cpu.prune()) == sorted(stale)
    kept = [*current, "unrelated"]
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(kept + [f"{name}.lock" for name in kept])
    # what this process loads is among the kept names
    assert cpu._build_spec()[0] == cpu._library(torch.backends.cpu.get_cpu_capability(), cpu._sanitizer())[0]


@pytest.mark.parametrize("arguments", [["--help"], ["--prune"]])
def test_the_build_command_acts_before_building(tmp_path, arguments):
    """`python -m snack.backends.cpu` imports the package first: that import built the kernels
    (about 30 s, or a BuildError without a compiler) before --help, --prune or --verbose acted."""
    env = {**os.environ, "SNACK_CACHE_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "snack.backends.cpu", *arguments], capture_output=True, text=True,
                         env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "compiling" not in run.stderr and not list(tmp_path.iterdir())  # nothing built
    assert ("usage: python -m snack.backends.cpu" in run.stdout) if arguments == ["--help"] else (
        "removed 0 stale build(s)" in run.stderr
    )


@pytest.mark.parametrize("arguments, verbose", [(["--build"], None), (["--build", "--verbose"], True)])
def test_the_build_command_hands_verbose_to_the_build(monkeypatch, capsys, arguments, verbose):
    # --verbose once only set an environment variable that the import-time build had already read
    asked = []
    monkeypatch.setattr(cpu, "build", lambda *, verbose=None: asked.append(verbose) or "built.so")
    monkeypatch.setattr(sys, "argv", ["python -m snack.backends.cpu", *arguments])
    runpy.run_module("snack.backends.cpu", run_name="__main__")
    assert asked == [verbose]
    assert "native CPU kernels ready at built.so" in capsys.readouterr().err
