"""The Triton backend: GPU kernels for the three sparse ops (:mod:`.kernels`) and their host
wrappers (:mod:`.backend`), which run on CPU tensors too under ``TRITON_INTERPRET=1``.

The ops are loaded on first access, so that importing this package (e.g. for
``snack compile-check``'s argument parser, which every ``snack`` command builds) does not import
Triton, and so that :func:`supports` can answer ``False`` where Triton is not installed.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

import torch

__all__ = ["sddmm", "spmm", "spmm_backward", "spmm_t", "supports"]

# what the package forwards from the backend module (the backend protocol of snack.backends)
_OPS = ("sddmm", "spmm", "spmm_backward", "spmm_t")


def supports(device: torch.device) -> bool:
    """CUDA devices, and CPU tensors when ``TRITON_INTERPRET=1`` was set before the kernels were
    imported; never when Triton is not installed."""
    return _triton_installed() and _backend().supports(device)


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _backend():
    return importlib.import_module("snack.backends.triton.backend")


def load():
    """This package, with the kernels imported when Triton is installed: the loader
    :mod:`snack.backends` registers, so that a broken Triton install makes the backend
    unavailable (reported once, falling back to another) rather than raise from every op."""
    package = importlib.import_module(__name__)
    if _triton_installed():
        _backend()
    return package


def __getattr__(name: str):
    if name in _OPS:
        # bound once: this runs only for names not yet in the module's globals, and every op call
        # looks its function up here (an import_module per lookup cost ~3 µs)
        value = globals()[name] = getattr(_backend(), name)
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
