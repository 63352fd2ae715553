"""The Triton backend: GPU kernels for the three sparse ops (:mod:`.kernels`) and their host
wrappers (:mod:`.backend`), which run on CPU tensors too under ``TRITON_INTERPRET=1``.

The backend interface (``supports``, ``spmm``, ``spmm_t``, ``sddmm``) is loaded on first access,
so that importing this package (e.g. for ``snack compile-check``'s argument parser, built by
every ``snack`` command) does not import Triton.
"""

from __future__ import annotations

import importlib

__all__ = ["sddmm", "spmm", "spmm_t", "supports"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("snack.backends.triton.backend"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
