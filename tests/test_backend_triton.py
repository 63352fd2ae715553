"""The Triton backend against the reference backend.

The tests run on one device, ``SNACK_TEST_DEVICE`` (default: ``cuda`` when available, else
``cpu``). On ``cpu`` the kernels run in Triton's interpreter: this module sets
``TRITON_INTERPRET=1`` before the kernels are imported (Triton reads it when a kernel is
decorated), which is why shapes stay small. On ``cuda`` the compiled kernels run; set
``SNACK_TRITON_AUTOTUNE=0`` there to test the fixed configs (including the shrunken ones below)
rather than the autotuned ones.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

DEVICE = os.environ.get("SNACK_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE == "cpu":
    # Left set for the rest of the session: interpreted kernels read it again at launch.
    os.environ["TRITON_INTERPRET"] = "1"

import snack  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from snack import backends  # noqa: E402
from snack.backends import derived, reference  # noqa: E402
from snack.backends import triton as triton_package  # noqa: E402
from snack.backends.triton import backend as tb  # noqa: E402
from snack.backends.triton import tuning  # noqa: E402
from snack.topology import Topology, nnz_for_sparsity, random_coo  # noqa: E402

if DEVICE == "cpu" and not tuning.INTERPRETED:
    raise RuntimeError("snack's Triton kernels were imported before TRITON_INTERPRET=1 was set; run this module first")
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("SNACK_TEST_DEVICE=cuda but no CUDA device is available", allow_module_level=True)

TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    # one rounding of an fp32-accumulated result, plus the inputs' own rounding in the reference
    torch.float16: dict(rtol=5e-3, atol=5e-3),
    torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
}


def _custom_topology() -> Topology:
    """40 × 50: empty rows 0 and 4, a long row 2 (48 columns), a long column 7 (every non-empty row),
    empty columns 9 and 10, and a few short rows."""
    coords = {(2, c) for c in range(50) if c not in (9, 10)}
    coords |= {(r, 7) for r in range(40) if r not in (0, 4)}
    coords |= {(1, 3), (1, 49), (3, 0), (5, 1), (5, 2), (5, 48)}
    row, col = torch.tensor(sorted(coords), dtype=torch.int32).unbind(1)
    return Topology(row.contiguous(), col.contiguous(), (40, 50))


def _topology(case: str) -> Topology:
    if case == "long_and_empty":
        return _custom_topology()
    if case == "nnz0":
        empty = torch.empty(0, dtype=torch.int32)
        return Topology(empty, empty, (4, 5))
    out_features, in_features, sparsity = {
        "5x7": (5, 7, 0.5),
        "33x17": (33, 17, 0.7),
        "64x40": (64, 40, 0.9),
    }[case]
    generator = torch.Generator().manual_seed(out_features * 1000 + in_features)
    row, col = random_coo(out_features, in_features, sparsity, generator=generator)
    return Topology(row, col, (out_features, in_features))


# (topology, batch): sizes that are not multiples of any block, batch 1, a batch over several
# tiles, long and empty rows and columns, no non-zeros, an empty batch
CASES = [("5x7", 1), ("33x17", 3), ("64x40", 17), ("long_and_empty", 2), ("nnz0", 3), ("33x17", 0)]


@pytest.fixture(autouse=True)
def bounds_checked():
    """On the interpreter, every kernel access must stay inside its tensor arguments (see
    ``interpreter_bounds``); on a GPU, run the tests under compute-sanitizer for the same."""
    if DEVICE != "cpu":
        yield
        return
    from interpreter_bounds import checked_accesses

    with checked_accesses():
        yield


@pytest.fixture(params=["fixed", "small"])
def blocks(request, monkeypatch):
    """``fixed``: the shipped configs. ``small``: tiny blocks and batch tiles, so small shapes span
    several non-zero blocks, loop iterations, batch tiles and patches, and the batch loops of the
    segment kernel and the patch walk take more than one step (their grids capped at 2)."""
    if request.param == "small":
        monkeypatch.setitem(tuning.FIXED_CONFIGS, "segment_spmm", {"BLOCK_NNZ": 16, "ROWS_PER_PROGRAM": 2, "num_warps": 4})
        monkeypatch.setitem(tuning.FIXED_CONFIGS, "pointer_spmm", {"BLOCK_K": 8, "num_warps": 4})
        monkeypatch.setitem(tuning.FIXED_CONFIGS, "segment_sddmm", {"BLOCK_K": 16, "num_warps": 4})
        monkeypatch.setitem(tuning.FIXED_CONFIGS, "pointer_sddmm", {"BLOCK_K": 4, "num_warps": 4})
        monkeypatch.setitem(tuning.FIXED_CONFIGS, "rowwise_backward", {"BLOCK_K": 4, "num_warps": 4})
        monkeypatch.setitem(tuning.FIXED_CONFIGS, "patch_spmm", {"BLOCK_K": 2, "NUM_STAGES": 1, "num_warps": 4})
        monkeypatch.setitem(tuning.FIXED_CONFIGS, "patch_sddmm", {"BLOCK_K": 2, "NUM_STAGES": 1, "num_warps": 4})
        monkeypatch.setattr(tb, "PATCH_SEGMENTS", 4)
        # still 2-4 bands and 3-5 batch tiles on the larger shapes, the last of each partial
        monkeypatch.setattr(tb, "PATCH_BAND", 16)
        monkeypatch.setattr(tb, "PATCH_MAX_BLOCK_B", 4)
        monkeypatch.setattr(tb, "MAX_BLOCK_B", 4)
        monkeypatch.setattr(tb, "_BATCH_GRID_LIMIT", 2)
    return request.param


@pytest.fixture
def launches(monkeypatch) -> list[str]:
    """The names of the kernels launched while the test runs, in order (they still run)."""
    names = []
    real_launch = tuning.launch
    monkeypatch.setattr(tuning, "launch", lambda name, *a, **k: names.append(name) or real_launch(name, *a, **k))
    return names


# NaN elements on each side of every dense input. On a GPU, an out-of-bounds read that reaches a
# result (0 × NaN is NaN too) then fails the comparison rather than read whatever lies next to
# the tensor. (The interpreter's bounds check is stricter: it fails any stray access.) 64 keeps
# 16-byte alignment.
FENCE = 64


def _fenced(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s copy, contiguous, inside a buffer with ``FENCE`` NaNs before and after it."""
    buffer = torch.full((tensor.numel() + 2 * FENCE,), float("nan"), dtype=tensor.dtype, device=tensor.device)
    inside = buffer[FENCE : FENCE + tensor.numel()].view(tensor.shape)
    inside.copy_(tensor)
    return inside


def _inputs(case: str, batch: int, dtype=torch.float32):
    """The case's topology tensors and NaN-fenced ``x (batch, in)``, ``dy (batch, out)`` and
    ``values (nnz,)``."""
    topo = _topology(case).to(DEVICE)
    out_features, in_features = topo.shape
    generator = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, in_features, generator=generator)
    dy = torch.randn(batch, out_features, generator=generator)
    values = torch.randn(topo.nnz, generator=generator)
    return topo.tensors(), *(_fenced(t.to(DEVICE, dtype)) for t in (x, dy, values))


@triton.jit
def _shifted_copy_kernel(src_ptr, dst_ptr, n, SHIFT: tl.constexpr, WRITE: tl.constexpr, BLOCK: tl.constexpr):
    # dst[i] = src[i + SHIFT] for i < n, or dst[i + SHIFT] = src[i] when WRITE is "shifted store"
    # or "shifted atomic": one access per lane, SHIFT elements off.
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    read_shift = 0 if WRITE != "plain" else SHIFT
    value = tl.load(src_ptr + offs + read_shift, mask=mask)
    if WRITE == "shifted atomic":
        tl.atomic_add(dst_ptr + offs + SHIFT, value, mask=mask)
    else:
        tl.store(dst_ptr + offs + (SHIFT - read_shift), value, mask=mask)


@pytest.mark.skipif(DEVICE != "cpu", reason="checks the interpreter's bounds checker")
@pytest.mark.parametrize(
    ("shift", "write", "error"),
    [
        (0, "plain", None),
        (1, "plain", "load of 4 bytes at byte 20 of 'src_ptr', which has 20 bytes [(]1 stray lanes"),
        (-1, "plain", "load of 4 bytes at 4 bytes before 'src_ptr'"),
        (2, "shifted store", "store of 4 bytes at byte 20 of 'dst_ptr', which has 20 bytes [(]2 stray lanes"),
        (1, "shifted atomic", "atomic of 4 bytes at byte 20 of 'dst_ptr'"),
    ],
)
def test_the_interpreter_fails_a_kernel_that_strays_outside_its_tensors(shift, write, error):
    """The bounds check the other tests run under: masked-off lanes may point anywhere; a live
    lane outside its tensor fails, even inside the same buffer (the NaN fences here)."""
    src, dst = _fenced(torch.arange(5.0)), _fenced(torch.zeros(5))
    launch = lambda: _shifted_copy_kernel[(1,)](src, dst, 5, SHIFT=shift, WRITE=write, BLOCK=8)  # noqa: E731
    if error is None:
        launch()
        assert torch.equal(dst, src)
        return
    with pytest.raises(pytest.fail.Exception, match=f"_shifted_copy_kernel: {error}"):
        launch()


@pytest.mark.parametrize("form", tb.FORMS)
@pytest.mark.parametrize("op", ["spmm", "spmm_t"])
@pytest.mark.parametrize(("case", "batch"), CASES)
def test_spmm_forms_match_reference(op, form, case, batch, blocks):
    topo, x, dy, values = _inputs(case, batch)
    dense = x if op == "spmm" else dy
    got = getattr(tb, op)(dense, values, topo, form=form)
    expected = getattr(reference, op)(dense, values, topo)
    assert got.dtype == dense.dtype and got.is_contiguous()
    torch.testing.assert_close(got, expected, **TOL[torch.float32])


@pytest.mark.parametrize("form", tb.FORMS)
@pytest.mark.parametrize(("case", "batch"), CASES)
def test_sddmm_matches_reference(form, case, batch, blocks):
    topo, x, dy, _ = _inputs(case, batch)
    got = tb.sddmm(dy, x, topo, form=form)
    assert got.shape == (topo.row.numel(),) and got.dtype == x.dtype
    torch.testing.assert_close(got, reference.sddmm(dy, x, topo), **TOL[torch.float32])


def _band_pointers(topo, transposed: bool, band: int):
    """The patch forms' band pointers; the segment pointer and each non-zero's input index, in
    the segment order they point into (rows: row order; columns: column order)."""
    if transposed:
        perm = tb._csc_perm(topo).long()
        ptr, segment, gather, n_in = topo.colptr, topo.col[perm], topo.row[perm], topo.rowptr.numel() - 1
    else:
        ptr, segment, gather, n_in = topo.rowptr, topo.row, topo.col, topo.colptr.numel() - 1
    name = "test_column_bands" if transposed else "test_row_bands"
    pointers = tb._band_pointers(name, (topo.row, topo.col), segment, gather, ptr.numel() - 1, n_in, band)
    return pointers, ptr, gather, n_in


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("band", [1, 3, 8, 40, 64])
def test_band_pointers_bound_each_segments_inputs_in_each_band(band, transposed):
    """Segment ``s``'s non-zeros of band ``t`` are exactly the positions between ``[t, s]`` and
    ``[t + 1, s]``; bands past the last input are clipped to it."""
    topo = _topology("long_and_empty").to(DEVICE).tensors()
    pointers, ptr, gather, n_in = _band_pointers(topo, transposed, band)
    n_out, bands = ptr.numel() - 1, -(-n_in // band)
    assert pointers.shape == (bands + 1, n_out) and pointers.dtype == torch.int32
    assert torch.equal(pointers[0], ptr[:-1]) and torch.equal(pointers[-1], ptr[1:])
    assert (pointers[1:] >= pointers[:-1]).all()  # so the bands split each segment's range
    pointers, gather = pointers.cpu(), gather.cpu()
    for s in range(n_out):
        for t in range(bands):
            in_band = gather[pointers[t, s] : pointers[t + 1, s]]
            assert ((in_band >= t * band) & (in_band < (t + 1) * band)).all()
    assert _band_pointers(topo, transposed, band)[0] is _band_pointers(topo, transposed, band)[0]  # cached


@pytest.mark.parametrize(("op", "height"), [("spmm", 8), ("spmm_t", 13)])
def test_patch_forms_take_wider_bands_than_a_grid_axis_holds(monkeypatch, op, height):
    """64 × 40: 40 columns (SpMM) or 64 rows (transposed) in at most 5 bands, not PATCH_BAND wide."""
    topo, x, dy, values = _inputs("64x40", 3)
    dense = x if op == "spmm" else dy
    monkeypatch.setattr(tb, "_MAX_GRID_1", 5)
    monkeypatch.setattr(tb, "PATCH_BAND", 4)
    widths = []
    real = tb._band_pointers
    monkeypatch.setattr(tb, "_band_pointers", lambda *args: widths.append(args[-1]) or real(*args))
    got = getattr(tb, op)(dense, values, topo, form="patches")
    torch.testing.assert_close(got, getattr(reference, op)(dense, values, topo))
    assert widths == [height]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("case", "batch"), [("33x17", 3), ("64x40", 17)])
def test_half_precision_accumulates_in_fp32(dtype, case, batch):
    """Half inputs, compared with the fp32 reference on the same (already rounded) inputs."""
    topo, x, dy, values = _inputs(case, batch, dtype)
    x32, dy32, values32 = x.float(), dy.float(), values.float()
    for form in tb.FORMS:
        got = tb.spmm(x, values, topo, form=form)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), reference.spmm(x32, values32, topo), **TOL[dtype])
        got = tb.spmm_t(dy, values, topo, form=form)
        torch.testing.assert_close(got.float(), reference.spmm_t(dy32, values32, topo), **TOL[dtype])
    for form in tb.FORMS:
        got = tb.sddmm(dy, x, topo, form=form)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), reference.sddmm(dy32, x32, topo), **TOL[dtype])
        dvalues, dbias = tb._sddmm(tb._batch_contiguous(dy), tb._batch_contiguous(x), batch, topo, True, form)
        assert dvalues.dtype == dbias.dtype == dtype
        torch.testing.assert_close(dvalues.float(), reference.sddmm(dy32, x32, topo), **TOL[dtype])
        torch.testing.assert_close(dbias.float(), dy32.sum(0), **TOL[dtype])
    dx, dvalues, dbias = tb.spmm_backward(dy, x, values, topo, bias_grad=True, walk="row")
    assert dx.dtype == dvalues.dtype == dbias.dtype == dtype
    torch.testing.assert_close(dx.float(), reference.spmm_t(dy32, values32, topo), **TOL[dtype])
    torch.testing.assert_close(dvalues.float(), reference.sddmm(dy32, x32, topo), **TOL[dtype])
    torch.testing.assert_close(dbias.float(), dy32.sum(0), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_long_sums_accumulate_in_fp32(dtype, monkeypatch):
    """SpMM and transposed SpMM: sums of 64 products walked in order, the first 32 about +320 and
    the last 32 about -320, so that partial sums climb to about 12,000 and end a few hundred
    from 0; a half accumulator would round them in steps of 8 (float16) or 64 (bfloat16). SDDMM:
    sums of 1,024 random products over the batch. fp32 accumulation leaves only the output's
    rounding. Small blocks make the pointer and segment forms sum across steps, as the patch
    form (one non-zero per segment and step) does. (Checked: rounding the pointer or patch
    accumulator, or the segment form's scratch, to the half type after each step fails this
    test, off by 4 to 1,200.)"""
    monkeypatch.setitem(tuning.FIXED_CONFIGS, "segment_spmm", {"BLOCK_NNZ": 16, "ROWS_PER_PROGRAM": 1, "num_warps": 4})
    monkeypatch.setitem(tuning.FIXED_CONFIGS, "pointer_spmm", {"BLOCK_K": 8, "num_warps": 4})
    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    def positive(*shape):  # in [1, 1.5]
        return (1 + randn(*shape).abs().clamp(max=2) / 4).to(dtype)

    walked = 64
    climb_then_fall = torch.where(torch.arange(walked) < walked // 2, 1.0, -1.0)
    tolerance = {"rtol": 2 * torch.finfo(dtype).eps, "atol": 0.05 if dtype == torch.float16 else 0.3}
    for shape, op, batch in (((4, walked), "spmm", 2), ((walked, 4), "spmm_t", 2), ((4, 4), "sddmm", 1024)):
        row, col = random_coo(*shape, 0.0, generator=generator)
        topo = Topology(row, col, shape)  # every position, in row order
        if op == "sddmm":
            a, b = randn(batch, shape[0]).to(dtype), randn(batch, shape[1]).to(dtype)
        else:
            a = positive(batch, shape[1] if op == "spmm" else shape[0])
            signs = climb_then_fall[None, :] if op == "spmm" else climb_then_fall[:, None]
            b = ((320 + 8 * randn(*shape)) * signs).to(dtype).flatten()
        expected = getattr(reference, op)(a.float(), b.float(), topo)
        for form in tb.FORMS:
            got = getattr(tb, op)(a, b, topo, form=form)
            assert got.dtype == dtype
            torch.testing.assert_close(got.float(), expected, **tolerance)


def test_form_heuristic():
    # many output rows fill the GPU with pointer programs; a narrow layer needs the segment form
    for batch in (1, 16, 64, 1000):
        assert tb.spmm_form(batch, 4096, "cpu") == "pointer"
        assert tb.spmm_form(batch, 10, "cpu") == "segment"
    enough = tb.MIN_POINTER_PROGRAMS_PER_SM * tb._DEFAULT_SM_COUNT
    assert tb.spmm_form(1, enough, "cpu") == "pointer"
    assert tb.spmm_form(1, enough - 1, "cpu") == "segment"


def test_rejects_unsupported_dtype_and_form():
    topo, x, _, values = _inputs("5x7", 2)
    with pytest.raises(TypeError, match="float32, float16 and bfloat16"):
        tb.spmm(x.double(), values.double(), topo)
    with pytest.raises(ValueError, match="form must be"):
        tb.spmm(x, values, topo, form="dense")
    with pytest.raises(ValueError, match=r"form must be one of \('segment', 'pointer', 'patches'\), got 'dense'"):
        tb.spmm_t(torch.zeros(2, 5, device=DEVICE), values, topo, form="dense")
    with pytest.raises(ValueError, match="form must be"):
        tb.sddmm(torch.zeros(2, 5, device=DEVICE), x, topo, form="dense")


def test_supports_this_device():
    assert tb.supports(torch.device(DEVICE))
    assert backends.get_backend("triton").supports(torch.device(DEVICE))


def test_use_backend_routes_the_custom_ops_to_triton(monkeypatch):
    calls = []
    real_spmm = tb.spmm
    # the registered backend is the package, which binds the backend module's functions
    monkeypatch.setattr(triton_package, "spmm", lambda *args, **kwargs: calls.append(1) or real_spmm(*args, **kwargs))
    topo, x, _, values = _inputs("33x17", 3)
    with snack.use_backend("triton"):
        y = torch.ops.snack.spmm(x, values, *topo)
    assert calls == [1]
    torch.testing.assert_close(y, reference.spmm(x, values, topo))


def test_the_backend_offers_the_whole_protocol():
    """The optional parts too: without them a training step would silently fall back to separate
    kernels (spmm_backward), and the benchmark would leave cached tensors out of the memory."""
    backend = backends.get_backend("triton")
    for name in ("spmm", "spmm_t", "sddmm", "spmm_backward"):
        assert getattr(backend, name) is getattr(tb, name)


def test_ops_run_with_their_tensors_cuda_device_current(monkeypatch):
    """Triton launches on the current CUDA device: every op makes its tensors' device current
    (a layer on cuda:1 while cuda:0 is current), and leaves a matching or CPU device alone."""
    entered = []

    class DeviceContext:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            entered.append("exit")

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", DeviceContext)
    fake = type("FakeTensor", (), {})()
    op = tb._on_the_tensors_device(lambda a, *rest: entered.append("op") or "result")
    for device in ("cuda:1", "cuda:0", "cpu"):
        fake.device = torch.device(device)
        assert op(fake, 2) == "result"
    assert entered == [torch.device("cuda:1"), "op", "exit", "op", "op"]
    for name in ("spmm", "spmm_t", "sddmm", "spmm_backward"):
        assert getattr(tb, name).__wrapped__.__name__ == name


def test_a_training_step_runs_the_fused_backward(monkeypatch):
    calls = []
    real = tb.spmm_backward
    monkeypatch.setattr(triton_package, "spmm_backward", lambda *a, **k: calls.append(k) or real(*a, **k))
    layer = snack.SparseLinear(17, 33, sparsity=0.7).to(DEVICE)
    x = torch.randn(4, 17, device=DEVICE, requires_grad=True)
    with snack.use_backend("triton"):
        layer(x).sum().backward()
    assert calls == [{"bias_grad": True}]


@pytest.mark.parametrize("channels, groups", [((3, 5), 1), ((4, 6), 2), ((4, 4), 4)],
                         ids=["ungrouped", "grouped", "depthwise"])  # fmt: skip
def test_a_convolution_runs_im2col_through_the_triton_kernels(channels, groups):
    # SparseConv2d's native kernels are the CPU's: on the Triton backend (a GPU, or the interpreter
    # here) its im2col rows go through SparseLinear's ops (a grouped layer's with its columns moved
    # to their groups' blocks); checked against nn.Conv2d
    layer = snack.SparseConv2d(*channels, 3, stride=2, padding=1, groups=groups, sparsity=0.6).to(DEVICE)
    _triton_step_matches_dense(layer, torch.randn(2, channels[0], 9, 8, device=DEVICE))


def _triton_step_matches_dense(layer, x):
    """A training step of the sparse convolution ``layer`` on the Triton backend: its output, input
    gradient and values gradient against those of its dense twin (``nn.Conv2d`` or
    ``nn.ConvTranspose2d``)."""
    dense = layer._dense_class(**layer._dense_arguments()).to(DEVICE)
    with torch.no_grad():
        dense.weight.copy_(layer.to_dense())
        dense.bias.copy_(layer.bias)
    x = x.requires_grad_()
    x_dense = x.detach().clone().requires_grad_()
    with snack.use_backend("triton"):
        y = layer(x)
        y.square().sum().backward()
    dense(x_dense).square().sum().backward()
    torch.testing.assert_close(y, dense(x_dense), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(x.grad, x_dense.grad, atol=1e-5, rtol=1e-4)
    flat = dense.weight.grad.reshape(layer.out_features, -1)[layer.row.long(), layer.col.long()]
    torch.testing.assert_close(layer.values.grad, flat, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("groups", [1, 2])
def test_a_transposed_convolution_runs_through_the_triton_kernels(groups):
    # its rows times the transposed weight (snack.ops.spmm_t), folded back; checked against
    # nn.ConvTranspose2d
    layer = snack.SparseConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=groups,
                                        sparsity=0.6).to(DEVICE)  # fmt: skip
    _triton_step_matches_dense(layer, torch.randn(2, 4, 5, 4, device=DEVICE))


@pytest.mark.parametrize("batch", [1, 8])
def test_a_training_step_is_three_launches_and_no_other_compute(monkeypatch, batch, launches):
    """Every CUDA op costs 15-20 µs of host time on the H200 machine, more than the kernels at
    batch 1: the step runs the forward SpMM, the transposed SpMM (reading the values through
    csc_perm, no gather) and the SDDMM, which also sums the bias gradient; besides the kernels,
    only allocations and (from batch 4) transposed copies of the dense operands."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(tb, "spmm_form", lambda *args: "pointer")  # as for a large layer on a GPU
    layer = snack.SparseLinear(17, 33, sparsity=0.7).to(DEVICE)
    x = torch.randn(batch, 17, device=DEVICE, requires_grad=True)

    def step():
        y = layer(x)
        torch.autograd.grad(y, [x, *layer.parameters()], torch.ones_like(y))

    with snack.use_backend("triton"):
        step()  # builds the topology's cached index data (pointers, column order)
        launches.clear()
        with Ops() as ops:
            step()
    assert launches == ["pointer_spmm", "pointer_spmm", "pointer_sddmm"]
    # the interpreter's own bookkeeping is new_empty/set_/copy_/empty; t and clone lay out the operands
    assert ops.seen <= {"empty", "new_empty", "set_", "copy_", "t", "clone", "ones_like", "zeros"}, ops.seen


def test_torch_compile_runs_the_triton_kernels(launches):
    """Under ``torch.compile(fullgraph=True)`` the layer is the custom ops, whose kernels call the
    Triton backend at run time: forward and gradients match the eager layer."""
    torch.manual_seed(0)
    layer = snack.SparseLinear(17, 33, sparsity=0.7).to(DEVICE)
    x = torch.randn(5, 17, device=DEVICE)
    with snack.use_backend("triton"):
        y = layer(x)
        (grad,) = torch.autograd.grad(y.square().sum(), layer.values)
        launches.clear()
        y_compiled = torch.compile(layer, fullgraph=True)(x)
        (grad_compiled,) = torch.autograd.grad(y_compiled.square().sum(), layer.values)
    assert {"segment_spmm", "segment_sddmm"} <= set(launches)
    torch.testing.assert_close(y_compiled, y, **TOL[torch.float32])
    torch.testing.assert_close(grad_compiled, grad, **TOL[torch.float32])


def test_a_sparse_attention_runs_through_the_triton_kernels():
    # its four projections on the Triton kernels, the attention in scaled_dot_product_attention;
    # checked against the nn.MultiheadAttention holding its weights
    torch.manual_seed(0)
    sparse = snack.SparseMultiheadAttention(8, 2, batch_first=True, sparsity=0.5).to(DEVICE)
    dense = sparse.to_dense_module()
    x = torch.randn(2, 3, 8, device=DEVICE, requires_grad=True)
    x_dense = x.detach().clone().requires_grad_()
    padding = torch.tensor([[False, False, True], [False, False, False]], device=DEVICE)
    with snack.use_backend("triton"):
        y = sparse(x, x, x, key_padding_mask=padding, need_weights=False)[0]
        y.square().sum().backward()
    y_dense = dense(x_dense, x_dense, x_dense, key_padding_mask=padding, need_weights=False)[0]
    y_dense.square().sum().backward()
    torch.testing.assert_close(y, y_dense, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(x.grad, x_dense.grad, atol=1e-5, rtol=1e-4)
    q_weight = dense.in_proj_weight.grad[:8][sparse.q_proj.row.long(), sparse.q_proj.col.long()]
    torch.testing.assert_close(sparse.q_proj.values.grad, q_weight, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("algorithm", ["SET", "RigL"])
def test_dynamic_sparse_training_runs_on_this_device(algorithm):
    """SET and RigL rewire a sparsified MLP on this device (a GPU in benchmarks/gpu_check.sh): the
    update's own ops (sampling, RigL's gradient scoring, optimizer-state remapping) run there, and
    the kernels keep training on the new topologies."""
    from torch import nn

    from conftest import check_topology_invariants

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3)).to(DEVICE)
    model = snack.sparsify(net, 0.7)
    layers = [m for m in model.modules() if isinstance(m, snack.SparseLinear)]
    nnz = [layer.nnz for layer in layers]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dst = getattr(snack.dst, algorithm)(
        model, opt, drop_fraction=0.3, update_every=2, total_steps=6, stop_fraction=1.0, schedule="constant"
    )
    before = [layer.indices().clone() for layer in layers]
    x = torch.randn(8, 12, device=DEVICE)
    target = torch.randint(0, 3, (8,), device=DEVICE)
    changed = 0
    with snack.use_backend("triton"):
        for _ in range(6):
            loss = nn.functional.cross_entropy(model(x), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            changed += dst.step()
    assert changed == 3 and torch.isfinite(loss)
    for layer, n, old in zip(layers, nnz, before):
        assert layer.values.device.type == torch.device(DEVICE).type
        check_topology_invariants(layer, n)
        assert opt.state[layer.values]["exp_avg"].shape == (n,)
        assert not torch.equal(layer.indices(), old), "rewired"


def test_autocast_runs_the_kernels_in_half_precision():
    """Mixed-precision training as on a GPU: inside ``torch.autocast`` the Triton kernels run in
    bfloat16, and the float32 parameters get the reference backend's gradients."""
    torch.manual_seed(0)
    layer = snack.SparseLinear(17, 33, sparsity=0.7).to(DEVICE)
    x = torch.randn(6, 17, device=DEVICE)
    results = {}
    for backend in ("triton", "reference"):
        layer.zero_grad()
        with snack.use_backend(backend), torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
            y = layer(x)
            y.float().square().sum().backward()
        results[backend] = (y, layer.values.grad, layer.bias.grad)
    assert results["triton"][0].dtype == torch.bfloat16 and results["triton"][1].dtype == torch.float32
    for got, expected in zip(results["triton"], results["reference"]):
        torch.testing.assert_close(got.float(), expected.float(), **TOL[torch.bfloat16])


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU (benchmarks/gpu_check.sh runs this on one)")
def test_a_graphed_layer_trains_like_the_eager_one():
    """``torch.cuda.make_graphed_callables`` captures the layer's forward and backward (after its
    warm-up calls, which autotune); replays with new inputs give the eager
    layer's output and gradients."""
    torch.manual_seed(0)
    layer = snack.SparseLinear(300, 280, sparsity=0.9).to(DEVICE)
    graphed = torch.cuda.make_graphed_callables(layer, (torch.randn(8, 300, device=DEVICE, requires_grad=True),))
    for _ in range(3):
        x = torch.randn(8, 300, device=DEVICE, requires_grad=True)
        grad_out = torch.randn(8, 280, device=DEVICE)
        results = []
        for module in (graphed, layer):
            y = module(x)
            results.append((y.detach(), *torch.autograd.grad(y, [x, layer.values, layer.bias], grad_out)))
        for got, expected in zip(*results):
            torch.testing.assert_close(got, expected, **TOL[torch.float32])


@pytest.mark.parametrize("input_shape", [(5, 17), (2, 3, 17), (1, 17)])
def test_sparse_linear_forward_backward_matches_reference(input_shape):
    torch.manual_seed(0)
    layer = snack.SparseLinear(17, 33, sparsity=0.7).to(DEVICE)
    x = torch.randn(*input_shape, device=DEVICE)
    grad_out = torch.randn(*input_shape[:-1], 33, device=DEVICE)

    def run(backend):
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        with snack.use_backend(backend):
            y = layer(xi)
            y.backward(grad_out)
        return y.detach(), xi.grad, layer.values.grad.clone(), layer.bias.grad.clone()

    for got, expected in zip(run("triton"), run("reference")):
        torch.testing.assert_close(got, expected, **TOL[torch.float32])


def test_kernel_bench_runs_and_checks_its_results(monkeypatch, tmp_path, capsys):
    """The GPU benchmark's logic on a tiny layer, with timing replaced by one call per variant."""
    from snack.backends.triton import kernel_bench

    def call_once(fn):
        fn()
        return 1.0

    graph_shapes = []

    def graph_call_once(fn):
        graph_shapes.append(tuple(fn().shape))
        return 2.0

    monkeypatch.setattr(kernel_bench, "_us", call_once)
    monkeypatch.setattr(kernel_bench, "_graph_us", graph_call_once)
    monkeypatch.setattr(kernel_bench, "_PROFILED_STEPS", 2)
    args = kernel_bench.parse_args(
        ["--out", str(tmp_path / "r.json"), "--size", "9x20", "--batch", "1", "8", "--train-batch", "1", "5"]
    )
    result = kernel_bench.benchmark(args, torch.device(DEVICE), graphs=True)
    assert [row["batch"] for row in result["spmm"]["rows"]] == [1, 8]
    # the SpMM by patches from batch 8 (_PATCH_SPMM_MIN_BATCH) only
    patches = set(kernel_bench._PATCH_SPMM_VARIANTS)
    assert set(result["spmm"]["rows"][0]["us"]) == set(kernel_bench.SPMM_VARIANTS) - patches
    assert set(result["spmm"]["rows"][1]["us"]) == set(kernel_bench.SPMM_VARIANTS)
    assert all(err < 1e-4 for row in result["spmm"]["rows"] for err in row["rel_error"].values())
    # every prepared variant agreed with the reference, so all were timed
    assert not any("prepared_errors" in row for row in result["spmm"]["rows"] + result["train"]["rows"])
    # each batch's graph timings ran that batch's inputs (cuSPARSE's output is transposed)
    n_spmm = len(kernel_bench.SPMM_VARIANTS)
    n_step = len(kernel_bench._STEP_OPS) + len(kernel_bench._VARIANT_OPS) + len(kernel_bench._WHOLE_STEPS)
    n_spmm_calls = 2 * n_spmm - len(patches)
    assert len(graph_shapes) == n_spmm_calls + 2 * n_step
    assert all(shape in ((1, 9), (9, 1)) for shape in graph_shapes[: n_spmm - len(patches)])
    assert all(shape in ((8, 9), (9, 8)) for shape in graph_shapes[n_spmm - len(patches) : n_spmm_calls])
    # training step at batch 1: spmm, spmm_t, ..., then the whole steps (their outputs)
    assert graph_shapes[n_spmm_calls : n_spmm_calls + 2] == [(1, 9), (1, 20)]
    nnz = nnz_for_sparsity(9, 20, 0.9)  # the training layer's
    # sddmm[segment], sddmm[pointer], spmm_t[pointer], backward[column], backward[row],
    # spmm_t[patches/...] × 3, sddmm[patches/...] × 3
    variants = [(nnz,), (nnz,)] + [(1, 20)] * 6 + [(nnz,)] * 3
    assert graph_shapes[n_spmm_calls + n_step - 13 : n_spmm_calls + n_step] == [*variants, (1, 9), (1, 9)]
    assert "eager steps at batch 1" in result["train"]["host_profile"]
    assert "function calls" in result["train"]["host_profile"]  # cProfile's header
    kernel_bench.print_tables(result)
    assert "Training step" in capsys.readouterr().out
    assert json.loads((tmp_path / "r.json").read_text())["train"]["rows"][1]["graph_us"]["sddmm"] == 2.0


@pytest.mark.parametrize("form", tb.FORMS)
@pytest.mark.parametrize(("case", "batch"), CASES)
def test_spmm_adds_the_bias(form, case, batch, blocks):
    topo, x, _, values = _inputs(case, batch)
    bias = torch.randn(topo.rowptr.numel() - 1, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    got = tb.spmm(x, values, topo, bias, form=form)
    torch.testing.assert_close(got, reference.spmm(x, values, topo) + bias, **TOL[torch.float32])


@pytest.mark.parametrize("form", tb.FORMS)
@pytest.mark.parametrize("bias_grad", [False, True])
@pytest.mark.parametrize(("case", "batch"), CASES)
def test_spmm_backward_matches_the_separate_ops(case, batch, bias_grad, form, blocks, monkeypatch):
    monkeypatch.setattr(tb, "spmm_form", lambda *args: form)  # the transposed SpMM's and the SDDMM's
    topo, x, dy, values = _inputs(case, batch)
    got = tb.spmm_backward(dy, x, values, topo, bias_grad=bias_grad)
    expected = (reference.spmm_t(dy, values, topo), reference.sddmm(dy, x, topo))
    expected += (dy.sum(0),) if bias_grad else ()
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, **TOL[torch.float32])


def test_rows_in_column_order_are_cached_and_follow_in_place_changes():
    topo = _topology("33x17").to(DEVICE)
    tensors = topo.tensors()
    rows = tb._rows_in_column_order(tensors)
    assert torch.equal(rows, tensors.row[topo.csc_perm.long()])
    assert tb._rows_in_column_order(tensors) is rows  # cached
    assert any(held is rows for held in derived.held(*tensors))  # and counted in the layer's memory
    with torch.no_grad():  # what load_state_dict does to a layer's row
        tensors.row.copy_(tensors.row.flip(0))
    assert torch.equal(tb._rows_in_column_order(tensors), tensors.row[topo.csc_perm.long()])
    _, _, dy, values = _inputs("33x17", 2)
    torch.testing.assert_close(tb.spmm_t(dy, values, tensors), reference.spmm_t(dy, values, tensors))


def test_column_order_missing_from_a_cpu_topology_is_derived_cached_and_follows_col():
    """A CPU topology hands the ops no csc_perm (no CPU kernel reads it); the Triton backend
    (here, its interpreter) derives it from col once, and again when col changes in place."""
    tensors = _topology("33x17").tensors()
    assert tensors.csc_perm.numel() == 0 < tensors.col.numel()
    perm = tb._csc_perm(tensors)
    assert torch.equal(perm, torch.sort(tensors.col, stable=True).indices.int())
    assert tb._csc_perm(tensors) is perm
    with torch.no_grad():  # what load_state_dict does to a layer's col
        tensors.col.copy_(tensors.col.flip(0))
    assert torch.equal(tb._csc_perm(tensors), torch.sort(tensors.col, stable=True).indices.int())
    built = _topology("33x17")
    perm = built.csc_perm  # built first: the ops get it, and the backend takes it as it is
    assert tb._csc_perm(built.tensors()) is perm


@pytest.mark.parametrize("block_b", [1, 2, 4, 8, 16, 32, 64])
def test_tile_configs_keep_every_lane_busy_without_spilling(block_b):
    kept = tuning.tile_configs_for(tuning.TILE_CONFIGS, {}, BLOCK_B=block_b)
    low, high = tuning.TILE_ELEMENTS_PER_THREAD
    assert 1 <= len(kept) <= 16  # a first call per batch tile compiles each: seconds, not minutes
    assert all(low <= block_b * c.kwargs["BLOCK_K"] / (32 * c.num_warps) <= high for c in kept)


@pytest.mark.parametrize("block_b", [1, 8, 32])
def test_patch_configs_are_pruned_by_the_whole_tile(block_b):
    """A patch's tile is ``BLOCK_S × BLOCK_K × BLOCK_B``: as wide as a pointer tile of
    ``BLOCK_S · BLOCK_B`` batch rows."""
    kept = tuning.tile_configs_for(tuning.PATCH_CONFIGS, {}, BLOCK_S=tb.PATCH_SEGMENTS, BLOCK_B=block_b)
    rows = tb.PATCH_SEGMENTS * block_b
    assert kept == tuning.tile_configs_for(tuning.PATCH_CONFIGS, {}, BLOCK_B=rows)
    assert 1 <= len(kept) <= 32  # 16 tiles at most, each pipelined or not
    assert {c.kwargs["NUM_STAGES"] for c in kept} == {1, 3}
    assert all(rows * c.kwargs["BLOCK_K"] <= tuning.MAX_TILE_ELEMENTS for c in kept)


def _every_config_kwargs() -> list[tuple[str, dict]]:
    """``(kernel name, config kwargs)`` for each distinct config a GPU's autotuner may pick (the
    interpreter runs no warps and takes the while loops, so configs differing only in
    ``num_warps`` or ``NUM_STAGES`` are one)."""
    pairs = []
    for name, configs in tuning.CONFIGS.items():
        distinct: dict[tuple, dict] = {}
        for c in configs:
            distinct.setdefault(tuple(sorted((k, v) for k, v in c.kwargs.items() if k != "NUM_STAGES")), c.kwargs)
        pairs += [(name, kwargs) for kwargs in distinct.values()]
    return pairs


def _calls_launching(name: str, topo, x, dy, values, bias) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(got, expected)`` pairs from the backend calls that launch kernel ``name``."""
    spmm = (reference.spmm(x, values, topo) + bias, reference.spmm_t(dy, values, topo))
    sddmm = reference.sddmm(dy, x, topo)
    form = {"segment_spmm": "segment", "pointer_spmm": "pointer", "patch_spmm": "patches"}.get(name)
    if form is not None:
        return list(zip((tb.spmm(x, values, topo, bias, form=form), tb.spmm_t(dy, values, topo, form=form)), spmm))
    if name == "rowwise_backward":
        got = tb.spmm_backward(dy, x, values, topo, bias_grad=True, walk="row")
        return list(zip(got, (spmm[1], sddmm, dy.sum(0))))
    form = {"segment_sddmm": "segment", "pointer_sddmm": "pointer", "patch_sddmm": "patches"}[name]
    return [(tb.sddmm(dy, x, topo, form=form), sddmm)]


# On a GPU each config would compile (about a minute for all, which gpu_check.sh's 5 minutes
# cannot spare); there kernel_bench checks the configs the autotuner picks against dense math.
@pytest.mark.skipif(DEVICE != "cpu", reason="interpreter only: on a GPU every config compiles (about a minute)")
@pytest.mark.parametrize(("case", "batch"), [("long_and_empty", 3), ("64x40", 17)])
@pytest.mark.parametrize(
    ("name", "config"), _every_config_kwargs(),
    ids=lambda v: ",".join(f"{k}={n}" for k, n in v.items()) if isinstance(v, dict) else v,
)  # fmt: skip
def test_every_config_the_autotuner_may_pick_computes_the_same(name, config, case, batch, monkeypatch, launches):
    """The tests above run the fixed configs; on a GPU the autotuner picks among all of these.
    (The interpreter takes the kernels' while loops, so ``NUM_STAGES`` changes nothing here;
    compile-check builds the pipelined loops.)"""
    monkeypatch.setitem(tuning.FIXED_CONFIGS, name, {**config, "num_warps": 4})
    topo, x, dy, values = _inputs(case, batch)
    bias = torch.randn(topo.rowptr.numel() - 1, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    pairs = _calls_launching(name, topo, x, dy, values, bias)
    assert name in launches
    for got, expected in pairs:
        torch.testing.assert_close(got, expected, **TOL[torch.float32])


@pytest.mark.parametrize("compiled_launch", [False, True])
def test_launch_autotunes_once_per_key_then_calls_the_kernel_directly(monkeypatch, compiled_launch):
    """On a GPU, only a key's first launch goes through the autotuner (its per-call key building
    costs as much host time as the launch); later ones reuse the config it picked, through
    ``kernel[grid]`` or (Triton 3.6) the compiled kernel's launcher."""
    calls = []

    class FakeAutotuner:
        best_config = None

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                calls.append(("autotuner", kwargs["BLOCK_B"]))
                FakeAutotuner.best_config = type("Config", (), {"all_kwargs": lambda self: {"BLOCK_K": 32, "num_warps": 2}})()

            return run

    def record(kwargs):
        calls.append(("kernel", kwargs["BLOCK_B"], kwargs["BLOCK_K"], kwargs["num_warps"]))

    class FakeKernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: record(kwargs)

    monkeypatch.setitem(tuning.TUNED, "pointer_spmm", FakeAutotuner())
    monkeypatch.setitem(tuning.kernels.KERNELS, "pointer_spmm", FakeKernel())
    monkeypatch.setattr(tuning, "PICKED", {})
    monkeypatch.setattr(tuning, "COMPILED_LAUNCH", compiled_launch)
    monkeypatch.setattr(tuning, "_launch_compiled", lambda name, kernel, grid, args, kwargs: record(kwargs))
    x = torch.zeros(2, 3)
    flags = dict(HAS_BIAS=False, INDIRECT_VALUES=False, WHILE_LOOP=False)
    for block_b in (1, 1, 2, 1):
        tuning.launch("pointer_spmm", (1, 1), x, **flags, BLOCK_B=block_b)
    tuning.launch("pointer_spmm", (1, 1), x.double(), **flags, BLOCK_B=1)  # new dtype: new key
    tuning.launch("pointer_spmm", (1, 1), x, **{**flags, "INDIRECT_VALUES": True}, BLOCK_B=1)  # another kernel variant
    assert calls == [
        ("autotuner", 1), ("kernel", 1, 32, 2), ("autotuner", 2), ("kernel", 1, 32, 2), ("autotuner", 1), ("autotuner", 1)
    ]  # fmt: skip


def test_compiled_launch_compiles_once_per_specialization_then_calls_the_launcher(monkeypatch):
    """A launch goes through ``kernel[grid]`` (which compiles) once per specialization Triton's
    binder computes and per launch options; later ones call the compiled kernel's launcher with
    the grid evaluated on the bound arguments, the current device's stream, and every bound
    argument in order. While a launch hook is set (a profiler), every launch goes through
    ``kernel[grid]``."""
    calls = []

    class FakeCompiled:  # what kernel[grid](...) returns: Triton's CompiledKernel
        function, packed_metadata = "function", "metadata"

        def run(self, *args):
            calls.append(("launcher", *args))

    def bind(a, n, BLOCK, **options):  # as Triton's binder: bound arguments, specialization, options
        return {"a": a, "n": n, "BLOCK": BLOCK}, [("*fp32", "D"), ("i32", "D" if n % 16 == 0 else None)], options

    class FakeKernel:
        device_caches = {3: ({}, {}, "target", "backend", bind)}

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                calls.append(("kernel[grid]", args[1], kwargs["num_warps"]))
                return FakeCompiled()

            return run

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1000 + device, raising=False)
    monkeypatch.setattr(tuning, "_COMPILED", {})
    kernel, a = FakeKernel(), object()
    grid = lambda meta: (meta["n"] // meta["BLOCK"], 2)  # noqa: E731
    for n, warps in ((32, 2), (64, 2), (33, 2), (64, 4), (48, 2)):
        tuning._launch_compiled("k", kernel, grid, (a, n), {"BLOCK": 8, "num_warps": warps})
    assert calls == [
        ("kernel[grid]", 32, 2),  # first of its specialization: compiles
        ("launcher", 8, 2, 1, 1003, "function", "metadata", None, None, None, a, 64, 8),  # n % 16 == 0 again
        ("kernel[grid]", 33, 2),  # another specialization
        ("kernel[grid]", 64, 4),  # other launch options
        ("launcher", 6, 2, 1, 1003, "function", "metadata", None, None, None, a, 48, 8),
    ]  # fmt: skip
    monkeypatch.setattr(tuning, "_launch_hooks_set", lambda: True)
    tuning._launch_compiled("k", kernel, grid, (a, 64), {"BLOCK": 8, "num_warps": 2})
    assert calls[-1] == ("kernel[grid]", 64, 2)


def test_launch_hooks_are_seen_in_any_form(monkeypatch):
    runtime = triton.knobs.runtime
    assert not tuning._launch_hooks_set()  # Triton 3.6: empty hook chains
    monkeypatch.setattr(runtime, "launch_enter_hook", lambda *args: None)
    assert tuning._launch_hooks_set()
    monkeypatch.setattr(runtime, "launch_enter_hook", None)
    assert not tuning._launch_hooks_set()
    chain = triton.knobs.HookChain()
    chain.add(lambda *args: None)
    monkeypatch.setattr(runtime, "launch_exit_hook", chain)
    assert tuning._launch_hooks_set()


def test_sddmm_form_is_segment_for_few_rows_else_pointer(monkeypatch, launches):
    topo, x, dy, _ = _inputs("33x17", 3)
    expected = reference.sddmm(dy, x, topo)
    torch.testing.assert_close(tb.sddmm(dy, x, topo), expected)  # 33 rows on 132 SMs: segment
    assert launches == ["segment_sddmm"]
    monkeypatch.setattr(tb, "spmm_form", lambda *args: "pointer")  # as if 33 rows filled the GPU
    launches.clear()
    torch.testing.assert_close(tb.sddmm(dy, x, topo), expected)
    assert launches == ["pointer_sddmm"]

@pytest.mark.parametrize("bias_grad", [False, True])
@pytest.mark.parametrize(("case", "batch"), CASES)
def test_spmm_backward_walking_by_row_matches_the_reference(case, batch, bias_grad, blocks):
    """One pass by row, ``dx`` by atomic adds: the same gradients as the column walk, for a batch
    of at most one tile; a larger batch is refused."""
    topo, x, dy, values = _inputs(case, batch)
    if batch > tb.MAX_BLOCK_B:
        with pytest.raises(ValueError, match=f"walk='row' takes a batch of at most {tb.MAX_BLOCK_B}, got {batch}"):
            tb.spmm_backward(dy, x, values, topo, bias_grad=bias_grad, walk="row")
        return
    got = tb.spmm_backward(dy, x, values, topo, bias_grad=bias_grad, walk="row")
    expected = (reference.spmm_t(dy, values, topo), reference.sddmm(dy, x, topo))
    expected += (dy.sum(0),) if bias_grad else ()
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype
        torch.testing.assert_close(g, e, **TOL[torch.float32])


def test_spmm_backward_rejects_an_unknown_walk():
    topo, x, dy, values = _inputs("5x7", 2)
    with pytest.raises(ValueError, match=r"walk must be one of \('column', 'row'\), got 'diagonal'"):
        tb.spmm_backward(dy, x, values, topo, walk="diagonal")


@pytest.fixture
def deterministic():
    """Sets ``torch.use_deterministic_algorithms(*args, **kwargs)`` when called; the test's end
    restores the mode it found."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield torch.use_deterministic_algorithms
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_deterministic_algorithms_get_the_pointer_forms_and_refuse_atomics(deterministic, launches):
    """Under ``torch.use_deterministic_algorithms(True)``, as for PyTorch's own ops: the heuristic
    picks the atomic-free forms; an atomic one asked for raises (or warns with ``warn_only``)."""
    topo, x, dy, values = _inputs("33x17", 3)  # 33 rows: the segment forms otherwise
    # the references first: on CUDA they may use ops that deterministic mode refuses
    expected_y, expected_dx = reference.spmm(x, values, topo), reference.spmm_t(dy, values, topo)
    expected_dvalues = reference.sddmm(dy, x, topo)
    assert tb.spmm_form(3, 33, DEVICE) == "segment"
    deterministic(True)
    assert tb.spmm_form(3, 33, DEVICE) == "pointer"
    torch.testing.assert_close(tb.spmm(x, values, topo), expected_y)
    dx, dvalues = tb.spmm_backward(dy, x, values, topo)
    torch.testing.assert_close(dx, expected_dx)
    assert launches and "segment_spmm" not in launches and "segment_sddmm" not in launches
    with pytest.raises(RuntimeError, match=r"form='segment'.*use_deterministic_algorithms\(True\)"):
        tb.spmm(x, values, topo, form="segment")
    with pytest.raises(RuntimeError, match=r"walk='row'.*use_deterministic_algorithms\(True\)"):
        tb.spmm_backward(dy, x, values, topo, walk="row")
    for op, dense in (("spmm", x), ("spmm_t", dy)):
        with pytest.raises(RuntimeError, match=rf"{op}\(form='patches'\).*use_deterministic_algorithms\(True\)"):
            getattr(tb, op)(dense, values, topo, form="patches")
    torch.testing.assert_close(tb.sddmm(dy, x, topo, form="patches"), expected_dvalues)  # no atomics: allowed
    deterministic(True, warn_only=True)
    with pytest.warns(UserWarning, match=r"walk='row'"):
        dx, _ = tb.spmm_backward(dy, x, values, topo, walk="row")
    torch.testing.assert_close(dx, expected_dx)


def test_kernel_bench_weighs_each_prepared_variant_against_what_layers_run(capsys):
    from snack.backends.triton import kernel_bench

    spmm_rows = [
        {"batch": 1, "us": {"pointer": 1.0}, "graph_us": {"pointer": 4.0}},  # not timed below batch 8
        {"batch": 8, "us": {"patches/256": 1.0}, "graph_us": {"pointer": 10.0, "patches/256": 4.0}},
    ]
    times = {"snack": 30.0, "dense": 90.0, "backward[column]": 20.0, "backward[row]": 8.0}
    times.update({"spmm_t[pointer]": 15.0, "spmm_t[patches/128]": 6.0, "spmm_t[patches/256]": 5.0})  # /512 wrong
    times.update({"sddmm[pointer]": 5.0, "sddmm[patches/512]": 4.0})
    kernel_bench._print_prepared_verdicts(spmm_rows, [{"batch": 1, "graph_us": times}])
    lines = [line.strip() for line in capsys.readouterr().out.strip().splitlines()]
    assert lines[1] == "SpMM       B=8   pointer / patches/256 2.50"  # the widths timed (and right)
    assert lines[2] == "training   B=1   backward[column] / backward[row] 2.50"
    assert lines[3] == "spmm_t[pointer] / patches/128 2.50, patches/256 3.00"
    assert lines[4] == "sddmm[pointer] / patches/512 1.25"
    assert lines[5:] == [
        "step with the row walk ≈ 18.0 µs: 5.00× nn.Linear",  # 30 - 20 + 8
        "step with the fastest spmm_t patches ≈ 20.0 µs: 4.50× nn.Linear",  # 30 - 15 + 5
        "step with the fastest sddmm patches ≈ 29.0 µs: 3.10× nn.Linear",  # 30 - 5 + 4
        "step with both ≈ 19.0 µs: 4.74× nn.Linear",
    ]


def test_kernel_bench_reports_wrong_prepared_variants_and_goes_on(monkeypatch, tmp_path, capsys):
    """A prepared variant that computes wrong gradients on some GPU loses its own timings (and
    says so), not the whole run's."""
    from snack.backends.triton import kernel_bench

    real_backward, real_patches = tb.spmm_backward, tb._patch_spmm

    def wrong_row_walk(*args, walk="column", **kwargs):
        grads = real_backward(*args, walk=walk, **kwargs)
        return (grads[0] + 1, *grads[1:]) if walk == "row" else grads

    def wrong_patches(*args, transposed, band=None):  # the widest bands' are wrong, the narrowest raise
        if band == 128:
            raise RuntimeError("out of resources")
        y = real_patches(*args, transposed=transposed, band=band)
        return y + 1 if band == 512 else y

    monkeypatch.setattr(tb, "spmm_backward", wrong_row_walk)
    monkeypatch.setattr(tb, "_patch_spmm", wrong_patches)
    monkeypatch.setattr(kernel_bench, "_us", lambda fn: 1.0 if fn() is not None else None)
    monkeypatch.setattr(kernel_bench, "_graph_us", lambda fn: 2.0 if fn() is not None else None)
    monkeypatch.setattr(kernel_bench, "_PROFILED_STEPS", 2)
    args = kernel_bench.parse_args(
        ["--out", str(tmp_path / "r.json"), "--size", "9x20", "--batch", "8", "--train-batch", "1"]
    )
    result = kernel_bench.benchmark(args, torch.device(DEVICE), graphs=True)
    err = capsys.readouterr().err
    spmm = result["spmm"]["rows"][0]
    assert "patches/512 WRONG, not timed: patches/512 SpMM at batch 8: relative error" in err
    assert "patches/128 WRONG, not timed: patches/128 SpMM at batch 8: raised RuntimeError: out of resources" in err
    assert set(spmm["prepared_errors"]) == {"patches/128", "patches/512"}
    assert "patches/128" not in spmm["graph_us"] and "patches/512" not in spmm["graph_us"]
    assert spmm["graph_us"]["pointer"] == spmm["graph_us"]["patches/256"] == 2.0
    row = result["train"]["rows"][0]
    assert "backward[row] WRONG, not timed: training step (backward[row]) dX at batch 1" in err
    assert "spmm_t[patches/512] WRONG, not timed: training step (spmm_t[patches/512]) dX at batch 1" in err
    assert "training step (spmm_t[patches/128]) at batch 1: raised RuntimeError: out of resources" in err
    assert set(row["prepared_errors"]) == {"backward[row]", "spmm_t[patches/128]", "spmm_t[patches/512]"}
    assert row["prepared_errors"]["backward[row]"].startswith("training step (backward[row]) dX at batch 1: relative")
    timed = row["graph_us"]
    assert "backward[row]" not in timed and "spmm_t[patches/512]" not in timed
    assert timed["backward[column]"] == timed["spmm_t[patches/256]"] == 2.0


@pytest.mark.parametrize("form", tb.FORMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_bias_is_added_before_half_precision_rounding(form, dtype):
    """x·Wᵀ = 257 and bias = -256: rounded to bfloat16 first, 257 becomes 256 and the result 0; the
    pointer form, the reference and nn.Linear give 1."""
    topo = Topology(torch.tensor([0, 0], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), (1, 2))
    tensors = topo.to(DEVICE).tensors()
    x = torch.tensor([[128.0, 129.0]], dtype=dtype, device=DEVICE)
    values, bias = torch.ones(2, dtype=dtype, device=DEVICE), torch.tensor([-256.0], dtype=dtype, device=DEVICE)
    assert tb.spmm(x, values, tensors, bias, form=form).item() == 1.0


@pytest.mark.parametrize("batch", [3, 9])  # below and above TRANSPOSE_MIN_BATCH: both layouts
def test_the_pointer_spmm_runs_a_batch_past_the_grid_limit_in_chunks(batch, monkeypatch, launches):
    """CUDA caps grid axis 1 at 65535 batch tiles (4,194,240 rows); past it the form used to
    raise, though the heuristic picks it for every large batch."""
    monkeypatch.setattr(tb, "MAX_BLOCK_B", 1)
    monkeypatch.setattr(tb, "_BATCH_GRID_LIMIT", 2)  # 2 rows per launch
    topo, x, dy, values = _inputs("33x17", batch)
    bias = torch.randn(topo.rowptr.numel() - 1, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    got = tb.spmm(x, values, topo, bias, form="pointer")
    assert launches == ["pointer_spmm"] * math.ceil(batch / 2)
    torch.testing.assert_close(got, reference.spmm(x, values, topo) + bias, **TOL[torch.float32])
    torch.testing.assert_close(tb.spmm_t(dy, values, topo, form="pointer"), reference.spmm_t(dy, values, topo),
                               **TOL[torch.float32])


@pytest.mark.parametrize("op", ["spmm", "sddmm"])
def test_band_pointers_follow_the_shape_when_row_and_col_are_shared(op):
    """A topology of another shape over the same row and col tensors used to get the first one's
    cached band pointers (an out-of-bounds read in the patch forms)."""
    row, col = (t.to(DEVICE) for t in random_coo(40, 50, 0.8, generator=torch.Generator().manual_seed(0)))
    for out_features in (40, 48):
        topo = Topology(row, col, (out_features, 50)).tensors()
        generator = torch.Generator().manual_seed(out_features)
        x = torch.randn(3, 50, generator=generator).to(DEVICE)
        dy = torch.randn(3, out_features, generator=generator).to(DEVICE)
        values = torch.randn(row.numel(), generator=generator).to(DEVICE)
        if op == "spmm":
            got, expected = tb.spmm(x, values, topo, form="patches"), reference.spmm(x, values, topo)
        else:
            got, expected = tb.sddmm(dy, x, topo, form="patches"), reference.sddmm(dy, x, topo)
        torch.testing.assert_close(got, expected, **TOL[torch.float32])


@pytest.mark.parametrize(("n_out", "kernel"), [(2 * tb._DEFAULT_SM_COUNT, "pointer_sddmm"), (100, "segment_sddmm")])
def test_the_sddmm_form_counts_rows_not_batch_tiles(n_out, kernel, launches, monkeypatch):
    """The pointer SDDMM runs one program per row with the batch looped inside: a large batch
    does not fill idle SMs (a 256-row batch into 100 rows used to launch 100 programs)."""
    monkeypatch.setattr(tb, "_sm_count", lambda device: tb._DEFAULT_SM_COUNT)
    topo = Topology(*random_coo(n_out, 3, 0.5, generator=torch.Generator().manual_seed(0)), (n_out, 3)).to(DEVICE)
    tensors = topo.tensors()
    tb.sddmm(torch.randn(256, n_out, device=DEVICE), torch.randn(256, 3, device=DEVICE), tensors)
    assert launches == [kernel]


def test_a_broken_triton_install_makes_the_backend_unavailable_not_every_op_raise(monkeypatch):
    """Triton present but failing to import (e.g. a mismatched libtriton.so): reported once, the
    device falls back, and use_backend("triton") says so at once."""
    def broken():
        raise ImportError("libtriton.so: undefined symbol")

    monkeypatch.setattr(triton_package, "_backend", broken)
    saved = {key: dict(table) for key, table in (("loaded", backends._LOADED), ("failed", backends._FAILED))}
    backends._LOADED.pop("triton", None)
    backends._RESOLVED.clear()
    try:
        with pytest.warns(RuntimeWarning, match="snack backend 'triton' is unavailable: ImportError: libtriton"):
            assert backends.default_backend_name("cuda") == "reference"
        with pytest.raises(backends.BackendUnavailableError, match="libtriton.so: undefined symbol"):
            with snack.use_backend("triton"):
                pass
    finally:
        backends._LOADED.clear(), backends._LOADED.update(saved["loaded"])
        backends._FAILED.clear(), backends._FAILED.update(saved["failed"])
        backends._RESOLVED.clear()


def test_a_sparse_embedding_on_the_device_matches_dense_math():
    """SparseEmbedding has no Triton kernel: on a GPU (and on the CPU under the forced backend, as
    here) its lookup and values gradient run torch's index ops. Repeated ids, a 2-D batch."""
    layer = snack.SparseEmbedding(97, 24, sparsity=0.8, device=DEVICE)
    ids = torch.randint(0, 97, (5, 13), device=DEVICE)
    ids[0, :4] = 3
    grad = torch.randn(5, 13, 24, device=DEVICE)
    with snack.use_backend("triton"):
        output = layer(ids)
        output.backward(grad)
    table = layer.to_dense().detach().requires_grad_()
    expected = torch.nn.functional.embedding(ids, table)
    (table_grad,) = torch.autograd.grad(expected, table, grad)
    assert torch.equal(output, expected)
    torch.testing.assert_close(layer.values.grad, table_grad[layer.row.long(), layer.col.long()])


@pytest.mark.parametrize("mode", ["sum", "max"])
def test_a_sparse_embedding_bag_on_the_device_matches_dense_math(mode):
    """SparseEmbeddingBag has no Triton kernel either: on a GPU its fused sum runs the lookup, then
    an index_add, and its max the lookup and torch's reductions. Offsets with an empty bag,
    repeated ids, per-sample weights for the sum."""
    layer = snack.SparseEmbeddingBag(97, 24, mode=mode, sparsity=0.8, device=DEVICE)
    ids = torch.randint(0, 97, (40,), device=DEVICE)
    ids[:4] = 3
    offsets = torch.tensor([0, 10, 10, 25], device=DEVICE)
    weights = torch.rand(40, device=DEVICE) if mode == "sum" else None
    grad = torch.randn(4, 24, device=DEVICE)
    with snack.use_backend("triton"):
        output = layer(ids, offsets, weights)
        output.backward(grad)
    table = layer.to_dense().detach().requires_grad_()
    expected = torch.nn.functional.embedding_bag(ids, table, offsets, mode=mode, per_sample_weights=weights)
    (table_grad,) = torch.autograd.grad(expected, table, grad)
    torch.testing.assert_close(output, expected)
    torch.testing.assert_close(layer.values.grad, table_grad[layer.row.long(), layer.col.long()])
