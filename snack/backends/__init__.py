"""Kernel backends, and how one is chosen for each call.

A backend implements the three sparse ops on the flat topology tensors
(:class:`snack.topology.TopologyTensors`); shapes are those of :mod:`snack.ops`:

* ``spmm(x, values, topo, bias=None)`` ``x (B, in)`` → ``(B, out)``, ``Y = X·Wᵀ (+ bias)``
  (``bias (out,)``: the eager :class:`snack.SparseLinear` passes it, so a backend can fuse it)
* ``spmm_t(dy, values, topo)`` ``dy (B, out)`` → ``(B, in)``, ``dX = dY·W``
* ``sddmm(dy, x, topo)`` → ``(nnz,)``, ``dvalues[k] = Σ_b dy[b, row_k] · x[b, col_k]``

and ``supports(device) -> bool``; optionally ``spmm_backward(dy, x, values, topo, *, bias_grad=False)
-> (dx, dvalues[, dy.sum(0)])`` (all in one pass). What a backend keeps per topology goes through
:func:`snack.backends.derived.derived` (so memory accounting finds it with ``held``).
``out = rowptr.numel() - 1`` and ``in = colptr.numel() - 1``.
Inputs arrive contiguous, checked, on one device; outputs must be new tensors. The custom ops in :mod:`snack.ops` register one kernel per
device type with PyTorch's dispatcher; that kernel asks :func:`resolve` which backend to run:
the one forced by :func:`use_backend`, else the first default for the device type that loads
(or, for a topology that holds every connection, :mod:`snack.backends.full`'s dense math).

Backends are registered by name with a *loader* so that heavy ones (a C++ build, Triton) are
only imported when first used.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import warnings
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from snack.backends import full
from snack.topology import TopologyTensors

__all__ = [
    "Backend",
    "BackendUnavailableError",
    "available_backends",
    "default_backend_name",
    "forced_backend",
    "forcing",
    "get_backend",
    "register_backend",
    "resolve",
    "unregister_backend",
    "use_backend",
]


class Backend(Protocol):
    """What a backend provides (a module or any object with these functions): the three ops on
    one topology's :class:`~snack.topology.TopologyTensors`, shapes as in :mod:`snack.ops`.

    Optionally also ``spmm_backward(dy, x, values, topo, *, bias_grad=False)`` → ``(dx, dvalues)``
    (plus ``dbias`` when ``bias_grad``): both gradients in one pass over the weight, which the
    backward prefers when present. Per-topology copies a backend keeps (e.g. 16-bit columns) go
    through :func:`snack.backends.derived.derived`, which drops them with the topology.
    """

    def supports(self, device: torch.device) -> bool: ...
    def spmm(self, x: Tensor, values: Tensor, topo: TopologyTensors, bias: Tensor | None = None) -> Tensor: ...
    def spmm_t(self, dy: Tensor, values: Tensor, topo: TopologyTensors) -> Tensor: ...
    def sddmm(self, dy: Tensor, x: Tensor, topo: TopologyTensors) -> Tensor: ...


class BackendUnavailableError(RuntimeError):
    """A backend was asked for that cannot run here (not installed, failed to build, wrong device)."""


_LOADERS: dict[str, Callable[[], Backend]] = {}
_LOADED: dict[str, Backend] = {}
_FAILED: dict[str, str] = {}
# Device type -> backend names, most preferred first. "reference" is the last resort everywhere.
_DEFAULTS: dict[str, list[str]] = {}
_FORCED: contextvars.ContextVar[str | None] = contextvars.ContextVar("snack_backend", default=None)
# device -> its default backend, filled on first use: resolving runs on every op call.
_RESOLVED: dict[torch.device, Backend] = {}


def register_backend(name: str, loader: Callable[[], Backend] | str, *, default_for: tuple[str, ...] = ()) -> None:
    """Make backend ``name`` available.

    Args:
        loader: a zero-argument callable returning the backend, or a module path to import.
        default_for: device types (``"cpu"``, ``"cuda"``) for which this backend is preferred
            over those registered before it.
    """
    if isinstance(loader, str):
        module_path = loader
        loader = lambda: importlib.import_module(module_path)  # noqa: E731
    _LOADERS[name] = loader
    _RESOLVED.clear()
    _LOADED.pop(name, None)
    _FAILED.pop(name, None)
    for device_type in default_for:
        order = _DEFAULTS.setdefault(device_type, [])
        if name in order:
            order.remove(name)
        order.insert(0, name)


def unregister_backend(name: str) -> None:
    """Forget backend ``name`` (for plugins and tests); the reference backend stays."""
    if name == "reference":
        raise ValueError("the reference backend cannot be unregistered")
    _LOADERS.pop(name, None)
    _RESOLVED.clear()
    _LOADED.pop(name, None)
    _FAILED.pop(name, None)
    for order in _DEFAULTS.values():
        if name in order:
            order.remove(name)


def available_backends() -> list[str]:
    """Names of all registered backends (whether or not they load on this machine)."""
    return sorted(_LOADERS)


def get_backend(name: str) -> Backend:
    """Load (once) and return backend ``name``; raise :class:`BackendUnavailableError` if it can't."""
    if name not in _LOADERS:
        raise ValueError(f"unknown backend {name!r}; expected one of {available_backends()}")
    if name in _LOADED:
        return _LOADED[name]
    if name in _FAILED:
        raise BackendUnavailableError(f"snack backend {name!r} is unavailable: {_FAILED[name]}")
    try:
        backend = _LOADERS[name]()
    except Exception as error:  # any loader failure (ImportError, a compiler error, ...) is reported the same way
        _FAILED[name] = f"{type(error).__name__}: {error}"
        raise BackendUnavailableError(f"snack backend {name!r} is unavailable: {_FAILED[name]}") from error
    _LOADED[name] = backend
    return backend


def default_backend_name(device: torch.device | str) -> str:
    """The backend that runs on ``device`` (a device or a device type) when none is forced.

    The first registered default for the device type that loads and supports the device wins;
    each one that fails to load is reported with a ``RuntimeWarning`` each time a device is
    resolved (once per process, as ``_RESOLVED`` keeps the answer), also when the failure first
    happened elsewhere (the native index helpers of layer construction ask for the CPU backend
    and quietly run torch without it): a broken native build is never silently replaced by the
    slow reference.
    """
    device = torch.device(device)
    for name in _DEFAULTS.get(device.type, []):
        try:
            backend = get_backend(name)
        except BackendUnavailableError as error:
            warnings.warn(f"{error}; falling back to the next backend for {device.type}", RuntimeWarning, stacklevel=2)
            continue
        if backend.supports(device):
            return name
    return "reference"


def use_backend(name: str) -> contextlib.AbstractContextManager:
    """Force every snack op inside the ``with`` block to run on backend ``name``.

    The backward of an op run eagerly inside the block runs there too, wherever and whenever
    autograd runs it (PyTorch runs a CUDA backward on a worker thread, which does not see the
    block). Code compiled by ``torch.compile`` runs its backward on the backend in force when
    the backward runs.
    Raises at once (also outside a ``with``) if the backend does not exist or cannot load; a call
    whose result is never entered warns when dropped, as it forces nothing. Ops on a device the
    backend does not support raise :class:`BackendUnavailableError` when called.
    """
    get_backend(name)
    return _BackendChoice(name)


def forced_backend() -> str | None:
    """The backend name :func:`use_backend` forces here, or ``None``."""
    return _FORCED.get()


def forcing(name: str | None) -> contextlib.AbstractContextManager:
    """Force backend ``name`` (unchecked; ``None``: leave the choice as it is) inside a ``with``
    block: how a backward restores the :func:`forced_backend` of its forward. (A class, not a
    generator: every layer's backward enters one.)"""
    return _NOT_FORCING if name is None else _Forcing(name)


class _Forcing:
    def __init__(self, name: str):
        self.name = name
        self.tokens: list = []  # a stack: one object may be entered again inside its own block

    def __enter__(self) -> None:
        self.tokens.append(_FORCED.set(self.name))

    def __exit__(self, *exc_info) -> None:
        _FORCED.reset(self.tokens.pop())


class _BackendChoice(_Forcing, contextlib.ContextDecorator):
    """What :func:`use_backend` returns: a :class:`_Forcing` that is also a decorator, as a
    ``contextlib.contextmanager`` is, and says so when it is dropped without being used
    (``snack.use_backend("reference")`` as a statement does nothing)."""

    entered = False

    def __enter__(self) -> None:
        self.entered = True
        super().__enter__()

    def __call__(self, function):
        self.entered = True
        return super().__call__(function)

    def _recreate_cm(self) -> _Forcing:
        return _Forcing(self.name)  # one per call of a decorated function: recursion nests them

    def __del__(self) -> None:
        if not self.entered:
            warnings.warn(
                f"snack.use_backend({self.name!r}) forces the backend only inside a `with` block; this call was "
                "never entered and changed nothing",
                RuntimeWarning,
                stacklevel=2,
            )


_NOT_FORCING = contextlib.nullcontext()


def resolve(device: torch.device, topo: TopologyTensors | None = None) -> Backend:
    """The backend an op on ``device`` runs on now: for a ``topo`` that holds every connection,
    unless a backend is forced, :mod:`snack.backends.full` (dense math on the values)."""
    name = _FORCED.get()
    if name is None:
        if topo is not None and full.applies(device, topo):
            return full
        backend = _RESOLVED.get(device)
        if backend is None:
            backend = _RESOLVED[device] = get_backend(default_backend_name(device))
        return backend
    backend = get_backend(name)
    if not backend.supports(device):
        raise BackendUnavailableError(f"snack backend {name!r} does not support device {device}")
    return backend


register_backend("reference", "snack.backends.reference")
register_backend("triton", lambda: importlib.import_module("snack.backends.triton").load(), default_for=("cuda",))
register_backend("cpu", "snack.backends.cpu.native", default_for=("cpu",))
