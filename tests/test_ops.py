"""The custom ops: schemas (opcheck), gradients, dispatch to backends."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

import snack
from snack import backends
from snack.topology import Topology, random_coo

from conftest import make_layer


def _case(out_features=9, in_features=7, batch=4, sparsity=0.6, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    topo = Topology(*random_coo(out_features, in_features, sparsity, generator=generator), (out_features, in_features))
    values = torch.randn(topo.nnz, dtype=dtype, generator=generator)
    x = torch.randn(batch, in_features, dtype=dtype, generator=generator)
    dy = torch.randn(batch, out_features, dtype=dtype, generator=generator)
    return topo, values, x, dy


def _dense(topo, values):
    weight = torch.zeros(topo.shape, dtype=values.dtype)
    weight[topo.row.long(), topo.col.long()] = values
    return weight


def test_ops_match_dense_math():
    topo, values, x, dy = _case()
    weight = _dense(topo, values)
    torch.testing.assert_close(snack.ops.spmm(x, values, topo), x @ weight.T, rtol=0, atol=1e-12)
    torch.testing.assert_close(snack.ops.spmm_t(dy, values, topo), dy @ weight, rtol=0, atol=1e-12)
    full_grad = dy.T @ x
    torch.testing.assert_close(
        snack.ops.sddmm(dy, x, topo), full_grad[topo.row.long(), topo.col.long()], rtol=0, atol=1e-12
    )


@pytest.mark.parametrize("op", ["spmm", "spmm_t", "sddmm"])
def test_ops_run_in_the_autocast_dtype_like_torch_mm(op):
    topo, values, x, dy = _case(dtype=torch.float32)
    args = {"spmm": (x, values), "spmm_t": (dy, values), "sddmm": (dy, x)}[op]
    expected = getattr(snack.ops, op)(*(a.bfloat16() for a in args), topo)
    leaf = args[1].clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = getattr(snack.ops, op)(args[0], leaf, topo)
        assert (args[0] @ args[0].T).dtype == out.dtype == torch.bfloat16
        assert getattr(snack.ops, op)(*(a.double() for a in args), topo).dtype == torch.float64  # left alone
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out.float().sum().backward()
    assert leaf.grad.dtype == torch.float32  # the gradient reaches the full-precision argument


@pytest.mark.parametrize("op", ["spmm", "spmm_t", "sddmm"])
@pytest.mark.parametrize("sparsity", [0.0, 0.6, 0.95])
def test_opcheck(op, sparsity):
    topo, values, x, dy = _case(sparsity=sparsity)
    first, second = {"spmm": (x, values), "spmm_t": (dy, values), "sddmm": (dy, x)}[op]
    args = (first.requires_grad_(), second.requires_grad_(), *topo.tensors())
    torch.library.opcheck(getattr(torch.ops.snack, op).default, args)


def test_opcheck_spmm_backward():
    """The fused backward op (no autograd of its own: backwards call it with grad mode off)."""
    topo, values, x, dy = _case()
    torch.library.opcheck(torch.ops.snack.spmm_backward.default, (dy, x, values, *topo.tensors()))
    dx, dvalues = torch.ops.snack.spmm_backward(dy, x, values, *topo.tensors())
    torch.testing.assert_close(dx, snack.ops.spmm_t(dy, values, topo), rtol=0, atol=1e-12)
    torch.testing.assert_close(dvalues, snack.ops.sddmm(dy, x, topo), rtol=0, atol=1e-12)


def test_differentiating_spmm_backward_raises_instead_of_giving_no_gradient():
    topo, values, x, dy = _case()
    dx, dvalues = torch.ops.snack.spmm_backward(dy, x.requires_grad_(), values, *topo.tensors())
    with pytest.raises(RuntimeError, match="spmm_backward is not differentiable: .* differentiate snack.ops.spmm_t"):
        (dx.sum() + dvalues.sum()).backward()
    assert x.grad is None


@pytest.mark.parametrize("op", ["spmm", "spmm_t", "sddmm", "spmm_backward"])
def test_the_ops_are_tagged_pt2_compliant(op):
    assert torch.Tag.pt2_compliant_tag in getattr(torch.ops.snack, op).default.tags


def test_the_autograd_nodes_are_named_after_the_ops():
    topo, values, x, dy = _case()
    values.requires_grad_()
    nodes = [type(getattr(snack.ops, op)(a, b, topo).grad_fn).__name__ for op, a, b in
             (("spmm", x, values), ("spmm_t", dy, values), ("sddmm", dy, x.requires_grad_()))]  # fmt: skip
    assert nodes == ["SpmmBackward", "SpmmTBackward", "SddmmBackward"]


def test_importing_snack_imports_neither_dynamo_nor_triton_nor_onnxscript():
    """Triton reads TRITON_INTERPRET when it is imported, after which the tests' interpreter
    runs fail; and each import costs every user's ``import snack`` seconds (onnxscript, only
    needed by ``snack.onnx_translations()``, is imported there)."""
    modules = ("torch._dynamo", "triton", "onnxscript", "onnx")
    code = f"import sys, snack; print(sorted(m for m in {modules!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_opcheck_empty_topology():
    empty = torch.empty(0, dtype=torch.int32)
    topo = Topology(empty, empty, (5, 3))
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    values = torch.empty(0, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(torch.ops.snack.spmm.default, (x, values, *topo.tensors()))
    assert torch.equal(snack.ops.spmm(x, values, topo), torch.zeros(2, 5, dtype=torch.float64))


@pytest.mark.parametrize("op", ["spmm", "spmm_t", "sddmm"])
def test_gradcheck_and_gradgradcheck(op):
    topo, values, x, dy = _case(out_features=6, in_features=5, batch=3)
    fn = getattr(snack.ops, op)
    first, second = {"spmm": (x, values), "spmm_t": (dy, values), "sddmm": (dy, x)}[op]
    inputs = (first.requires_grad_(), second.requires_grad_())
    assert torch.autograd.gradcheck(lambda a, b: fn(a, b, topo), inputs)
    assert torch.autograd.gradgradcheck(lambda a, b: fn(a, b, topo), inputs)


def test_backward_saves_only_what_is_needed():
    topo, values, x, _ = _case()
    values.requires_grad_()
    y = snack.ops.spmm(x, values, topo)  # x needs no grad -> values need not be saved
    (grad_values,) = torch.autograd.grad(y.sum(), values)
    torch.testing.assert_close(grad_values, snack.ops.sddmm(torch.ones_like(y), x, topo))


def test_op_rejects_mismatched_inputs():
    topo, values, x, dy = _case()
    with pytest.raises(ValueError, match=r"x must have shape \(B, 7\)"):
        snack.ops.spmm(dy, values, topo)
    with pytest.raises(ValueError, match="values must have shape"):
        snack.ops.spmm(x, values[:-1], topo)
    with pytest.raises(TypeError, match="share a dtype"):
        snack.ops.spmm(x.float(), values, topo)
    with pytest.raises(ValueError, match=r"on one device, got \['cpu', 'meta'\]"):  # (autocast knows no meta)
        snack.ops.spmm(x.to("meta"), values, topo)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("batch", [1, 5])
def test_sparse_linear_paths_agree_with_dense_math(backend, batch):
    # three eager paths: inference (no autograd node), the autograd.Function, and under
    # create_graph the custom ops; all against x·Wᵀ + b on the masked dense weight
    topo, values, x, dy = _case(batch=batch)
    bias = torch.randn(topo.shape[0], dtype=values.dtype)
    weight = _dense(topo, values)
    expected = x @ weight.T + bias
    with snack.use_backend(backend):
        with torch.no_grad():
            torch.testing.assert_close(snack.ops.sparse_linear(x, values, topo, bias), expected)
        leaves = [t.clone().requires_grad_() for t in (x, values, bias)]
        y = snack.ops.sparse_linear(*leaves[:2], topo, leaves[2])
        torch.testing.assert_close(y, expected)
        grads = torch.autograd.grad(y, leaves, dy, create_graph=True)
    full_grad = dy.T @ x
    torch.testing.assert_close(grads[0], dy @ weight)
    torch.testing.assert_close(grads[1], full_grad[topo.row.long(), topo.col.long()])
    torch.testing.assert_close(grads[2], dy.sum(0))
    assert grads[0].requires_grad  # create_graph kept a differentiable graph


def test_arguments_of_the_wrong_type_are_named():
    topo, values, x, dy = _case()
    for op, args in (("spmm", (x, values)), ("spmm_t", (dy, values)), ("sddmm", (dy, x))):
        with pytest.raises(TypeError, match=f"snack.ops.{op}: topology must be a snack.Topology .*, got tuple"):
            getattr(snack.ops, op)(*args, (topo.row, topo.col))
    with pytest.raises(TypeError, match="snack.ops.sparse_linear: x must be a Tensor, got ndarray"):
        snack.ops.sparse_linear(x.numpy(), values, topo)
    with pytest.raises(TypeError, match="snack.ops.sparse_linear: topology must be a snack.Topology"):
        snack.ops.sparse_linear(x, values, None)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("layout", ["expanded", "strided"])
def test_a_non_contiguous_bias_works_as_in_nn_linear(backend, layout):
    """``functional_call`` with such a bias, or a bias sliced from a larger tensor."""
    topo, values, x, _ = _case()
    if layout == "expanded":
        bias = torch.randn(1, dtype=values.dtype).expand(9)
    else:
        bias = torch.randn(18, dtype=values.dtype)[::2]
    with snack.use_backend(backend):
        for grad in (False, True):
            with torch.set_grad_enabled(grad):
                y = snack.ops.sparse_linear(x.clone().requires_grad_(grad), values, topo, bias)
            torch.testing.assert_close(y, x @ _dense(topo, values).T + bias)


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda x, v, b: (x[:, :-1], v, b), ValueError, r"x must have shape \(\*, 7\)"),
        (lambda x, v, b: (x, v[:-1], b), ValueError, r"values must have shape"),
        (lambda x, v, b: (x.float(), v, b), TypeError, "share a floating dtype"),
        (lambda x, v, b: (x, v, b[:-1]), ValueError, r"bias must have shape \(9,\)"),
        (lambda x, v, b: (x, v, b.float()), ValueError, r"bias must have shape \(9,\), dtype torch.float64"),
        (lambda x, v, b: (x.to("meta"), v, b), ValueError, "must be on one device, got meta, cpu and cpu"),
    ],
    ids=["x-width", "values-length", "dtype", "bias-shape", "bias-dtype", "x-on-meta"],
)
def test_sparse_linear_rejects_bad_arguments(change, error, message):
    topo, values, x, _ = _case()
    bias = torch.zeros(9, dtype=values.dtype)
    with pytest.raises(error, match=message):
        snack.ops.sparse_linear(*change(x, values, bias)[:2], topo, change(x, values, bias)[2])


def test_use_backend_forces_and_restores():
    layer = make_layer(8, 6, 0.5)
    calls = []
    reference = backends.get_backend("reference")

    class Recording:
        supports = staticmethod(reference.supports)

        def spmm(self, *args):
            calls.append("spmm")
            return reference.spmm(*args)

        spmm_t = staticmethod(reference.spmm_t)
        sddmm = staticmethod(reference.sddmm)

    backends.register_backend("recording", Recording)
    try:
        x = torch.randn(2, 6, dtype=torch.float64)
        with snack.use_backend("recording"):
            layer(x)
        assert calls == ["spmm"]
        layer(x)
        assert calls == ["spmm"]  # restored on exit
    finally:
        backends.unregister_backend("recording")


@pytest.mark.parametrize("path", ["layer", "custom_ops"])
def test_a_backward_runs_on_the_backend_its_forward_was_forced_to(path):
    """Also where the ``with`` block is not seen: after it, or on another thread (PyTorch runs a
    CUDA backward on a worker thread)."""
    layer = make_layer(8, 6, 0.5)
    calls = []
    reference = backends.get_backend("reference")

    class Recording:
        supports = staticmethod(reference.supports)

        def __getattr__(self, op):
            def recorded(*args, **kwargs):
                calls.append(op)
                return getattr(reference, op)(*args, **kwargs)

            return recorded if op in ("spmm", "spmm_t", "sddmm") else super().__getattribute__(op)

    backends.register_backend("recording", Recording)
    try:
        for run_backward in (lambda loss: loss.backward(), _on_another_thread):
            calls.clear()
            x = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)
            with snack.use_backend("recording"):
                y = layer(x) if path == "layer" else snack.ops.spmm(x, layer.values, layer.topology)
            run_backward(y.sum())
            assert calls == ["spmm", "spmm_t", "sddmm"]
    finally:
        backends.unregister_backend("recording")


def _on_another_thread(loss):
    thread = threading.Thread(target=loss.backward)
    thread.start()
    thread.join()


def test_use_backend_unknown_name():
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        with snack.use_backend("nope"):
            pass
    with pytest.raises(ValueError, match="unknown backend 'nope'"):  # also called without `with`
        snack.use_backend("nope")


def test_use_backend_decorates_a_function_as_a_context_manager_does():
    @snack.use_backend("reference")
    def forced(depth):
        inner = forced(depth - 1) if depth else None
        return snack.backends.forced_backend(), inner

    assert forced(2) == ("reference", ("reference", ("reference", None)))  # recursion nests the blocks
    assert snack.backends.forced_backend() is None
    choice = snack.use_backend("reference")
    with choice:
        with choice:  # entered again inside its own block: the outer exit restored nothing before
            pass
        assert snack.backends.forced_backend() == "reference"
    assert snack.backends.forced_backend() is None


def test_use_backend_called_without_with_warns_that_it_forced_nothing():
    with pytest.warns(RuntimeWarning, match=r"use_backend\('reference'\) forces the backend only inside a `with`"):
        snack.use_backend("reference")
    assert snack.backends.forced_backend() is None


def test_failing_backend_is_reported_not_silent():
    def broken():
        raise ImportError("compiler not found")

    backends.register_backend("broken", broken)
    try:
        with pytest.raises(backends.BackendUnavailableError, match="compiler not found"):
            with snack.use_backend("broken"):
                pass
    finally:
        backends.unregister_backend("broken")


def test_registering_a_default_backend_takes_effect_at_once():
    device = torch.device("cpu")
    before = backends.resolve(device)
    reference = backends.get_backend("reference")
    backends.register_backend("preferred", lambda: reference, default_for=("cpu",))
    try:
        assert backends.default_backend_name(device) == "preferred"
        assert backends.resolve(device) is reference
    finally:
        backends.unregister_backend("preferred")
    assert backends.resolve(device) is before


def test_custom_op_backward_saves_only_the_tensors_the_needed_gradients_use():
    """What the op's autograd saves, seen through saved-tensor hooks: d values needs x only, d x
    needs values only (saving both costs memory, and fails in-place edits of the unsaved one)."""
    topology, values, x, _ = _case()

    def saved_while(build):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            build()
        return saved

    def holds(saved, tensor):
        return any(t.data_ptr() == tensor.data_ptr() and t.shape == tensor.shape for t in saved)

    v = values.clone().requires_grad_()
    saved = saved_while(lambda: snack.ops.spmm(x, v, topology))
    assert holds(saved, x) and not holds(saved, v)
    xg = x.clone().requires_grad_()
    saved = saved_while(lambda: snack.ops.spmm(xg, values, topology))
    assert holds(saved, values) and not holds(saved, xg)
