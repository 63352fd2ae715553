"""The three sparse ops as ``torch.library`` custom ops, with fake kernels and autograd.

For a sparse ``W`` (``out × in``, ``nnz`` non-zeros) given by ``values`` and a topology
(:class:`snack.topology.TopologyTensors`: ``row, col, rowptr, colptr, csc_perm``):

=================  ==================================================  ==========================
op                 math                                                shapes
=================  ==================================================  ==========================
``snack::spmm``    ``Y = X · Wᵀ``                                      ``x (B, in)`` → ``(B, out)``
``snack::spmm_t``  ``dX = dY · W``                                     ``dy (B, out)`` → ``(B, in)``
``snack::sddmm``   ``out[k] = Σ_b dY[b, row_k] · X[b, col_k]``         → ``(nnz,)``
=================  ==================================================  ==========================

``out`` and ``in`` are read off the pointer lengths (``rowptr``: ``out + 1``, ``colptr``:
``in + 1``), so the schemas carry no sizes. The backward of each op is written with the other
two, so gradients of any order stay sparse. The kernel registered for each device type asks
:func:`snack.backends.resolve` which backend runs (see :func:`snack.use_backend`).

A first-order backward of ``spmm`` that needs both gradients calls ``snack::spmm_backward``
instead, which runs the backend's optional ``spmm_backward(dy, x, values, topo) -> (dx, dvalues)``
(both in one pass over the weight where that pays; the CPU backend decides per call) or, when the
backend has none, its ``spmm_t`` and ``sddmm``.

:func:`sparse_linear` (what :class:`snack.SparseLinear` runs) uses the custom ops only under
``torch.compile``. Eagerly it checks its arguments once and runs one autograd node,
:class:`_SparseLinearFunction`, that calls the backend directly: the bias goes into the backend's
``spmm``, and a training step's backward asks the fused ``spmm_backward`` for the bias gradient
too. Without autograd (inference) it calls the backend's ``spmm`` and nothing else.

One more custom op, ``snack::topology_index_data``, lives in :mod:`snack.nn.tracing`: programs
made by ``torch.jit.trace`` and ``torch.export`` derive a layer's index data through it.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from snack import backends, func
from snack.topology import Topology, TopologyTensors

__all__ = ["autocast_inputs", "sddmm", "sparse_linear", "spmm", "spmm_t"]


# the names of each op's two dense arguments, for error messages
_ARGUMENT_NAMES = {"spmm": ("x", "values"), "spmm_t": ("dy", "values"), "sddmm": ("dy", "x")}


def _check(op: str, dense_a: Tensor, dense_b: Tensor, topo: TopologyTensors, *, check_devices: bool = True) -> None:
    """Shape/dtype/device checks shared by the real and fake kernels of every op. ``check_devices=False``
    leaves out the device check (CPU kernels: the dispatcher runs one only when every tensor is on
    the CPU, the lowest-priority backend; the check is most of this function's 3 µs)."""
    out_features, in_features = topo.rowptr.numel() - 1, topo.colptr.numel() - 1
    nnz = topo.row.numel()
    names = _ARGUMENT_NAMES[op]
    expected_width = {"spmm": in_features, "spmm_t": out_features, "sddmm": out_features}[op]
    a_name, b_name = names
    if dense_a.dim() != 2 or dense_a.shape[1] != expected_width:
        raise ValueError(f"snack.{op}: {a_name} must have shape (B, {expected_width}), got {tuple(dense_a.shape)}")
    if op == "sddmm":
        if tuple(dense_b.shape) != (dense_a.shape[0], in_features):  # tuples: torch.Size == is slow
            raise ValueError(
                f"snack.sddmm: x must have shape ({dense_a.shape[0]}, {in_features}), got {tuple(dense_b.shape)}"
            )
    elif tuple(dense_b.shape) != (nnz,):
        raise ValueError(f"snack.{op}: values must have shape ({nnz},), got {tuple(dense_b.shape)}")
    if dense_a.dtype != dense_b.dtype:
        raise TypeError(f"snack.{op}: {a_name} and {b_name} must share a dtype, got {dense_a.dtype} and {dense_b.dtype}")
    if not dense_a.is_floating_point():
        raise TypeError(f"snack.{op}: {a_name} must be floating point, got {dense_a.dtype}")
    if not check_devices:
        return
    devices = {t.device for t in (dense_a, dense_b, *topo)}
    if len(devices) != 1:
        raise ValueError(f"snack.{op}: all tensors must be on one device, got {sorted(map(str, devices))}")


def _device_kernel(op_name: str):
    """The kernel of ``snack::<op_name>``: check the inputs, then run the backend that
    :func:`snack.backends.resolve` picks for the inputs' device."""

    def kernel(a: Tensor, b: Tensor, *topology: Tensor, check_devices: bool = True) -> Tensor:
        topo = TopologyTensors(*topology)
        _check(op_name, a, b, topo, check_devices=check_devices)
        return _run_backend(op_name, a, b, topo)

    return kernel


def _run_backend(op_name: str, a: Tensor, b: Tensor, topo: TopologyTensors) -> Tensor:
    """``op_name`` on the backend for ``a``'s device, on inputs already checked."""
    return getattr(backends.resolve(a.device, topo), op_name)(a.contiguous(), b.contiguous(), topo)


def _linear_kernel(x: Tensor, values: Tensor, bias: Tensor | None, topo: TopologyTensors) -> Tensor:
    """``x·Wᵀ + bias`` on the device's backend, which adds the bias in its spmm kernel, for
    inputs that :func:`sparse_linear` (or :class:`snack.SparseLinear`) has checked."""
    bias = bias.contiguous() if bias is not None else None  # e.g. an expanded one, as nn.Linear takes
    return backends.resolve(x.device, topo).spmm(x.contiguous(), values.contiguous(), topo, bias)


_spmm_kernel = _device_kernel("spmm")
_spmm_t_kernel = _device_kernel("spmm_t")
_sddmm_kernel = _device_kernel("sddmm")


def _spmm_backward_kernel(
    dy: Tensor,
    x: Tensor,
    values: Tensor,
    row: Tensor,
    col: Tensor,
    rowptr: Tensor,
    colptr: Tensor,
    csc_perm: Tensor,
    *,
    check_devices: bool = True,
) -> tuple[Tensor, Tensor]:
    """The kernel of ``snack::spmm_backward``: ``(spmm_t(dy, values), sddmm(dy, x))`` from the
    backend's ``spmm_backward`` (one pass over the weight where that pays) when it has one, else
    from its two kernels."""
    topo = TopologyTensors(row, col, rowptr, colptr, csc_perm)
    _check_backward(dy, x, values, topo, check_devices=check_devices)
    return _backward_kernels(dy, x, values, topo, bias_grad=False)


def _check_backward(
    dy: Tensor, x: Tensor, values: Tensor, topo: TopologyTensors, *, check_devices: bool = True
) -> None:
    """:func:`_check` for ``snack::spmm_backward``'s inputs (its real and fake kernels)."""
    _check("spmm_t", dy, values, topo, check_devices=check_devices)
    _check("sddmm", dy, x, topo, check_devices=check_devices)


def _backward_kernels(dy: Tensor, x: Tensor, values: Tensor, topo: TopologyTensors, *, bias_grad: bool) -> tuple[Tensor, ...]:
    """``(dx, dvalues)`` as :func:`_spmm_backward_kernel`, and ``dy.sum(0)`` (the bias gradient)
    third when ``bias_grad``, on inputs already checked (the eager layer's backward: its forward
    checked them, and every check is host time the step pays again)."""
    backend = backends.resolve(dy.device, topo)
    dy, x, values = dy.contiguous(), x.contiguous(), values.contiguous()
    fused = getattr(backend, "spmm_backward", None)
    if fused is not None:
        return fused(dy, x, values, topo, bias_grad=True) if bias_grad else fused(dy, x, values, topo)
    grads = backend.spmm_t(dy, values, topo), backend.sddmm(dy, x, topo)
    return (*grads, dy.sum(0)) if bias_grad else grads


# ---------------------------------------------------------------- fake (meta) kernels


def _spmm_fake(x, values, row, col, rowptr, colptr, csc_perm):
    _check("spmm", x, values, TopologyTensors(row, col, rowptr, colptr, csc_perm))
    return x.new_empty(x.shape[0], rowptr.shape[0] - 1)


def _spmm_t_fake(dy, values, row, col, rowptr, colptr, csc_perm):
    _check("spmm_t", dy, values, TopologyTensors(row, col, rowptr, colptr, csc_perm))
    return dy.new_empty(dy.shape[0], colptr.shape[0] - 1)


def _sddmm_fake(dy, x, row, col, rowptr, colptr, csc_perm):
    _check("sddmm", dy, x, TopologyTensors(row, col, rowptr, colptr, csc_perm))
    return dy.new_empty(row.shape[0])


def _spmm_backward_fake(dy, x, values, row, col, rowptr, colptr, csc_perm):
    _check_backward(dy, x, values, TopologyTensors(row, col, rowptr, colptr, csc_perm))
    return dy.new_empty(dy.shape[0], colptr.shape[0] - 1), dy.new_empty(row.shape[0])


# ---------------------------------------------------------------- the ops in the dispatcher
# Defined through torch.library's Library rather than @torch.library.custom_op, with an Autograd
# kernel of our own (_register_autograd) and no device check in CPU kernels (_check): a custom_op
# call runs four more Python frames (its per-device lookup, two wrappers keeping Dynamo out of the
# kernel, a general autograd wrapper). A 64×64 forward and backward through snack.ops.spmm took
# 111 µs with custom_op and 79 µs so (batch 32, one thread), and compiled graphs call the ops
# (benchmarks/compile_overhead_mlp.txt). The kernels keep Dynamo out with the wrapper that imports
# Dynamo when first called: importing it with snack would import Triton before a test can set
# TRITON_INTERPRET (tests/test_ops.py). Same schemas, tags and fake kernels as before.

_LIBRARY = torch.library.Library("snack", "FRAGMENT")
_TOPOLOGY_ARGUMENTS = "Tensor row, Tensor col, Tensor rowptr, Tensor colptr, Tensor csc_perm"


def _define(name: str, arguments: str, returns: str, kernel, fake) -> None:
    """``snack::<name>(<arguments>, <topology>) -> <returns>`` with ``kernel`` for CPU and CUDA
    tensors (``check_devices`` on CUDA only: see :func:`_check`) and ``fake`` for tracing
    (FakeTensor, meta)."""
    _LIBRARY.define(f"{name}({arguments}, {_TOPOLOGY_ARGUMENTS}) -> {returns}", tags=(torch.Tag.pt2_compliant_tag,))
    for dispatch_key in ("CPU", "CUDA"):
        device_kernel = functools.partial(kernel, check_devices=dispatch_key != "CPU")
        _LIBRARY.impl(name, torch._disable_dynamo(device_kernel), dispatch_key)
    torch.library.register_fake(f"snack::{name}", fake, lib=_LIBRARY)


_define("spmm", "Tensor x, Tensor values", "Tensor", _spmm_kernel, _spmm_fake)
_define("spmm_t", "Tensor dy, Tensor values", "Tensor", _spmm_t_kernel, _spmm_t_fake)
_define("sddmm", "Tensor dy, Tensor x", "Tensor", _sddmm_kernel, _sddmm_fake)
_define(
    "spmm_backward", "Tensor dy, Tensor x, Tensor values", "(Tensor, Tensor)", _spmm_backward_kernel, _spmm_backward_fake
)


# ---------------------------------------------------------------- autograd
# Each op saves only what the requested gradients need, and its backward calls the other ops.

_NO_TOPOLOGY_GRADS = (None,) * 5


def _setup(ctx, inputs, output):
    a, b, *topo = inputs
    needs_a, needs_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    # grad of a needs b (and vice versa) for all three ops
    ctx.save_for_backward(a if needs_b else None, b if needs_a else None, *topo)
    ctx.forced = backends.forced_backend()  # the backward runs where the forward ran


def _spmm_grads(
    grad: Tensor,
    x: Tensor | None,
    values: Tensor | None,
    topo: TopologyTensors,
    need_x: bool,
    need_values: bool,
    *,
    direct: bool,
) -> tuple[Tensor | None, Tensor | None]:
    """``(dx, dvalues)`` of ``y = spmm(x, values)`` for the incoming ``grad (B, out)``; ``None``
    where not needed.

    With grad mode on (``create_graph=True``) the differentiable custom ops compute them, so
    gradients of any order work. Otherwise both gradients, when both are needed, come from one
    pass over the weight (``spmm_backward``). ``direct=True`` (eager only: the device kernels
    have no fake implementation for tracing) calls the device kernels without the custom ops'
    Python wrappers.
    """
    if torch.is_grad_enabled():
        direct = False
    elif need_x and need_values:
        if direct:
            return _backward_kernels(grad, x, values, topo, bias_grad=False)
        return torch.ops.snack.spmm_backward(grad, x, values, *topo)
    if direct:  # checked by the forward: every check is host time a small layer's step pays again
        dx = _run_backend("spmm_t", grad, values, topo) if need_x else None
        dvalues = _run_backend("sddmm", grad, x, topo) if need_values else None
    else:
        dx = torch.ops.snack.spmm_t(grad, values, *topo) if need_x else None
        dvalues = torch.ops.snack.sddmm(grad, x, *topo) if need_values else None
    return dx, dvalues


def _spmm_backward(ctx, grad):
    x, values, *topo = ctx.saved_tensors
    with backends.forcing(ctx.forced):
        dx, dvalues = _spmm_grads(grad, x, values, TopologyTensors(*topo), *ctx.needs_input_grad[:2], direct=False)
    return (dx, dvalues, *_NO_TOPOLOGY_GRADS)


def _spmm_t_backward(ctx, grad):
    dy, values, *topo = ctx.saved_tensors
    with backends.forcing(ctx.forced):
        ddy = torch.ops.snack.spmm(grad, values, *topo) if ctx.needs_input_grad[0] else None
        dvalues = torch.ops.snack.sddmm(dy, grad, *topo) if ctx.needs_input_grad[1] else None
    return (ddy, dvalues, *_NO_TOPOLOGY_GRADS)


def _sddmm_backward(ctx, grad):
    dy, x, *topo = ctx.saved_tensors
    with backends.forcing(ctx.forced):
        ddy = torch.ops.snack.spmm(x, grad, *topo) if ctx.needs_input_grad[0] else None
        dx = torch.ops.snack.spmm_t(dy, grad, *topo) if ctx.needs_input_grad[1] else None
    return (ddy, dx, *_NO_TOPOLOGY_GRADS)


def _register_autograd(name: str, backward, setup=_setup) -> None:
    """``snack::<name>``'s Autograd kernel: ``setup`` and ``backward`` in an autograd node when a
    gradient is needed, else straight on to the device kernel.

    What ``torch.library.register_autograd`` registers, less its generality (out= variants,
    keyword-only arguments, argument defaults), which cost every call, a compiled graph's
    included, about 4 µs here: the ops have none of those."""
    op = getattr(torch.ops.snack, name).default
    below_autograd = torch._C._after_autograd_keyset

    # the keyset the op was called with comes last: needs_input_grad[0], [1] stay the inputs'
    def forward(ctx, *inputs_and_keyset):
        *inputs, keyset = inputs_and_keyset
        with torch._C._AutoDispatchBelowAutograd():
            output = op.redispatch(keyset & below_autograd, *inputs)
        setup(ctx, inputs, output)
        return output

    def backward_with_keyset(ctx, *grads):
        return (*backward(ctx, *grads), None)

    # its grad_fn: SpmmBackward, SpmmTBackward, SddmmBackward, SpmmBackwardBackward
    node = type(name.title().replace("_", ""), (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(backward_with_keyset),
    })  # fmt: skip

    def autograd_kernel(keyset, *inputs):
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*inputs):
            return node.apply(*inputs, keyset)
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & below_autograd, *inputs)

    _LIBRARY.impl(name, autograd_kernel, "Autograd", with_keyset=True)


def _spmm_backward_backward(ctx, *grads):
    raise RuntimeError(
        "snack::spmm_backward is not differentiable: for gradients of gradients, differentiate snack.ops.spmm_t and "
        "snack.ops.sddmm (what a backward with create_graph=True runs)"
    )


for _name, _backward in (("spmm", _spmm_backward), ("spmm_t", _spmm_t_backward), ("sddmm", _sddmm_backward)):
    _register_autograd(_name, _backward)
# (the backwards call it with grad mode off; differentiated, it raises, as a custom_op without a
# formula does, rather than let the dispatcher's fallback give no gradient with a warning)
_register_autograd("spmm_backward", _spmm_backward_backward, setup=lambda ctx, inputs, output: None)


# ---------------------------------------------------------------- public functions


def _check_topology(caller: str, topology) -> None:
    if not isinstance(topology, Topology):
        raise TypeError(
            f"{caller}: topology must be a snack.Topology (e.g. layer.topology), got {type(topology).__name__}"
        )


def _topology_tensors(caller: str, topology: Topology) -> TopologyTensors:
    _check_topology(caller, topology)
    return topology.tensors()


# The three public ops, like torch.mm, run in the region's dtype inside torch.autocast (float64
# excepted): their arguments are cast first. (torch.library.register_autocast would fix one dtype
# at registration; autocast regions choose theirs.)


def spmm(x: Tensor, values: Tensor, topology: Topology) -> Tensor:
    """``Y = X · Wᵀ`` for ``x (B, in)``; returns ``(B, out)``. Differentiable in ``x`` and ``values``."""
    return _public_op("spmm", func.Spmm, x, values, topology)


def spmm_t(dy: Tensor, values: Tensor, topology: Topology) -> Tensor:
    """``dX = dY · W`` for ``dy (B, out)``; returns ``(B, in)``."""
    return _public_op("spmm_t", func.SpmmT, dy, values, topology)


def sddmm(dy: Tensor, x: Tensor, topology: Topology) -> Tensor:
    """``out[k] = Σ_b dy[b, row_k] · x[b, col_k]`` for ``dy (B, out)``, ``x (B, in)``; returns ``(nnz,)``."""
    return _public_op("sddmm", func.Sddmm, dy, x, topology)


def _public_op(name: str, function, a: Tensor, b: Tensor, topology: Topology) -> Tensor:
    """``snack::<name>`` on the autocast arguments, or inside a ``torch.func`` transform the
    :mod:`snack.func` ``function`` (the custom ops do not compose with transforms)."""
    tensors = _topology_tensors(f"snack.ops.{name}", topology)
    a, b = _autocast_pair(a, b)
    if func.transforms_active():
        for argument, value in zip(_ARGUMENT_NAMES[name], (a, b)):
            if not isinstance(value, Tensor):
                raise TypeError(f"snack.ops.{name}: {argument} must be a Tensor, got {type(value).__name__}")
        _check(name, a, b, tensors)
        return function.apply(a, b, tensors)
    return getattr(torch.ops.snack, name)(a, b, *tensors)


def _autocast_pair(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`_autocast` for an op's two dense arguments, on ``a``'s device (non-Tensors pass
    through, for the op's own type error)."""
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
        return a, b
    return _autocast(a.device.type, a, b)


class _SparseLinearFunction(torch.autograd.Function):
    """Eager ``y = x·Wᵀ + b`` for ``x (B, in)`` → ``(B, out)``, calling the device kernels directly.

    Through the custom ops' Python kernels (autograd's, then the device's) a forward and backward
    of a 64×64 layer took about 80 µs on this project's 2-core CPU, one thread: more than its
    kernels, and most of the step at 99% sparsity. This one autograd node runs the same backend
    kernels on inputs :func:`sparse_linear` has checked, in about 55 µs (a 64×64 training step
    takes about 1.3× ``nn.Linear``'s: ``benchmarks/eager_overhead.txt``). Tracing
    (``torch.compile``) uses the custom ops, which have fake implementations.
    """

    # the old-style forward(ctx, ...): with a separate setup_context, apply() binds the arguments
    # through inspect.signature on every call (~40 µs)
    @staticmethod
    def forward(
        ctx, x: Tensor, values: Tensor, bias: Tensor | None, topo: TopologyTensors, cast_from: tuple[Tensor, ...]
    ) -> Tensor:
        # values is saved even when dx is not needed: its version check makes a backward through
        # a graph recorded before the layer's connections changed (set_topology, load_state_dict)
        # raise, rather than give the new connections the old ones' gradients. Under autocast
        # values is a cast, which a rewire leaves alone: cast_from, (the tensor it was cast
        # from,) in a tuple that autograd does not take for an input, is saved for that check.
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, values, *cast_from)
        ctx.topo = topo
        ctx.forced = backends.forced_backend()  # the backward runs where the forward ran
        return _linear_kernel(x, values, bias, topo)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, values = ctx.saved_tensors[:2]
        if grad.layout != torch.strided:  # e.g. sparse grad_outputs, which the kernels do not take
            grad = grad.to_dense()
        need_x, need_values, need_bias = ctx.needs_input_grad[:3]
        with backends.forcing(ctx.forced):
            if need_x and need_values and need_bias and not torch.is_grad_enabled():
                # a training step's backward: all three gradients from one pass over the weight
                return (*_backward_kernels(grad, x, values, ctx.topo, bias_grad=True), None, None)
            dx, dvalues = _spmm_grads(grad, x, values, ctx.topo, need_x, need_values, direct=True)
        return dx, dvalues, grad.sum(0) if need_bias else None, None, None


def _check_linear(x: Tensor, values: Tensor, topology: Topology, bias: Tensor | None) -> None:
    """The argument checks of :func:`sparse_linear`: shapes, one floating dtype, one device."""
    out_features, in_features = topology.shape
    if x.dim() == 0 or x.shape[-1] != in_features:
        raise ValueError(f"snack.ops.sparse_linear: x must have shape (*, {in_features}), got {tuple(x.shape)}")
    if values.dim() != 1 or values.shape[0] != topology.nnz:
        raise ValueError(f"snack.ops.sparse_linear: values must have shape ({topology.nnz},), got {tuple(values.shape)}")
    if x.dtype != values.dtype or not x.is_floating_point():
        raise TypeError(f"snack.ops.sparse_linear: x and values must share a floating dtype, got {x.dtype} and {values.dtype}")
    if x.device != values.device or x.device != topology.device:
        raise ValueError(
            f"snack.ops.sparse_linear: x, values and topology must be on one device, "
            f"got {x.device}, {values.device} and {topology.device}"
        )
    if bias is not None and (
        bias.dim() != 1 or bias.shape[0] != out_features or bias.dtype != values.dtype or bias.device != x.device
    ):
        raise ValueError(
            f"snack.ops.sparse_linear: bias must have shape ({out_features},), dtype {values.dtype} and device "
            f"{x.device}, got {tuple(bias.shape)}, {bias.dtype} and {bias.device}"
        )


def autocast_inputs(x: Tensor, values: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(x, values, bias)`` as ``torch.autocast`` treats ``nn.Linear``'s: inside an autocast
    region for ``x``'s device, every floating tensor but float64 in the region's dtype (a cast
    of ``values`` is ``(nnz,)``; its gradient flows back to the full-precision ``values``);
    outside one, unchanged."""
    return _autocast(x.device.type, x, values, bias)


def _autocast(device_type: str, *tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """``tensors``, each floating one but float64 in the autocast dtype of ``device_type`` when
    an autocast region for it is active; unchanged otherwise (and ``None`` stays ``None``)."""
    if not torch._C._is_any_autocast_enabled():  # one flag read: every layer call asks
        return tensors
    try:
        if not torch.is_autocast_enabled(device_type):
            return tensors
    except RuntimeError:  # a device type without autocast (meta): the device checks refuse it
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(
        t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t for t in tensors
    )


def sparse_linear(x: Tensor, values: Tensor, topology: Topology, bias: Tensor | None = None) -> Tensor:
    """Functional form of :class:`snack.SparseLinear`: ``x (*, in)`` → ``(*, out)``, ``y = x·Wᵀ + b``.

    ``values``: ``(nnz,)``; ``bias``: ``(out,)`` or ``None``, both with ``x``'s floating dtype
    and device (inside ``torch.autocast``, in the region's dtype after :func:`autocast_inputs`).
    Differentiable in ``x``, ``values`` and ``bias`` (to any order).
    """
    for name, value in (("x", x), ("values", values), ("bias", bias)):
        if not isinstance(value, Tensor) and not (name == "bias" and value is None):
            raise TypeError(f"snack.ops.sparse_linear: {name} must be a Tensor, got {type(value).__name__}")
    _check_topology("snack.ops.sparse_linear", topology)
    x, cast_values, bias = autocast_inputs(x, values, bias)
    _check_linear(x, cast_values, topology, bias)
    return _sparse_linear(x, cast_values, topology, bias, values)


def _sparse_linear(
    x: Tensor, values: Tensor, topology: Topology, bias: Tensor | None, source: Tensor | None = None
) -> Tensor:
    """:func:`sparse_linear` without its argument checks, for callers that guarantee them
    (:class:`snack.SparseLinear` checks its input, and its own tensors are consistent).
    ``source``: the tensor ``values`` was cast from under autocast (an eager backward checks that
    it did not change since, as it checks ``values`` itself)."""
    out_features, in_features = topology.shape
    # torch.compile, torch.export, and shape propagation in a FakeTensorMode (FakeTensorProp): the
    # custom ops, which have fake kernels
    compiling = (
        torch.compiler.is_compiling() or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None
    )
    tracing = not compiling and torch._C._get_tracing_state() is not None  # torch.jit.trace
    # the batch size spelled out: reshape(-1, in) cannot infer it for an empty batch inside vmap
    x2d = x if x.dim() == 2 else x.reshape(math.prod(x.shape[:-1]), in_features)
    if compiling or tracing:  # record the custom op, with its registered autograd
        y = torch.ops.snack.spmm(x2d, values, *topology.tensors())
        if bias is not None:
            y = y + bias
    elif func.transforms_active():  # torch.func.grad, vmap, ...: Functions that compose with them
        y = func.Spmm.apply(x2d, values, topology.tensors())
        if bias is not None:
            y = y + bias
    elif torch.is_grad_enabled() and (x.requires_grad or values.requires_grad or (bias is not None and bias.requires_grad)):
        cast_from = (source,) if source is not None and source is not values else ()
        y = _SparseLinearFunction.apply(x2d, values, bias, topology.tensors(), cast_from)
    else:  # inference: no autograd node needed
        y = _linear_kernel(x2d, values, bias, topology.tensors())
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], out_features)
