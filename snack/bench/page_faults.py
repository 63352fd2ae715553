"""Fresh memory in a benchmark: count the page faults a call takes, and tell glibc to keep freed
memory so that there are none.

PyTorch's CPU allocator takes its memory from the C library's ``malloc``. glibc serves a block
larger than its mmap threshold (at most 32 MiB by default) from a fresh ``mmap``, unless its heap
happens to hold a free block that large, and gives it back to the system when it is freed, so
the next such block is fresh again: the kernel faults it in a 4 KiB page at a time, zero-filled.
A dense 4096×4096 layer's backward allocates its 64 MiB weight gradient every step (a fresh
``.grad``, or a fresh result that autograd adds into the old one): 16,385 faults per step, 22-24
ms of a 30-52 ms ``nn.Linear`` training step at batch 1 and 32 (AMD EPYC, 2026-12-07); whether a
step pays them depends on the heap's state, so that one run of ``snack bench`` timed the batch-1
step at 47 ms and the next at 10. ``snack bench`` counts the faults per call and, by default,
raises glibc's thresholds first (what the environment variables ``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_``, or an allocator such as jemalloc or tcmalloc, do for a whole program).
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["keep_freed_memory", "keeps_freed_memory", "minor_faults"]

# mallopt's parameters (glibc's malloc.h) and the largest value it takes (an int)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_LARGEST = 2**31 - 1

_kept = False  # whether keep_freed_memory succeeded in this process


def minor_faults() -> int | None:
    """The minor page faults this process has taken so far (fresh pages the kernel mapped in),
    or ``None`` where the platform does not count them (no ``resource`` module)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def keep_freed_memory() -> None:
    """Make glibc's ``malloc`` serve blocks of up to 2 GiB from its heap and keep what is freed
    (``mallopt(M_MMAP_THRESHOLD)`` and ``mallopt(M_TRIM_THRESHOLD)`` at their largest), for the
    rest of the process: a tensor freed and allocated again reuses its pages instead of faulting
    in fresh ones. The process's resident memory then stays at its peak.

    Raises:
        RuntimeError: the C library has no ``mallopt`` (not glibc: musl, macOS, Windows), this
            process's ``malloc`` is another library's (preloaded: AddressSanitizer, jemalloc,
            tcmalloc), where ``mallopt`` would change nothing, or glibc refused a value. Nothing
            changed in the first two cases.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        raise RuntimeError(
            f"cannot keep freed memory: the C library ({name or 'not found'}) has no mallopt; "
            "this needs glibc (Linux)"
        ) from None
    replacement = _malloc_replacing(libc)
    if replacement is not None:
        raise RuntimeError(
            f"cannot keep freed memory: this process's malloc comes from {replacement}, not from "
            "glibc (preloaded?), so glibc's mallopt would change nothing"
        )
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    for parameter, label in ((_M_MMAP_THRESHOLD, "M_MMAP_THRESHOLD"), (_M_TRIM_THRESHOLD, "M_TRIM_THRESHOLD")):
        if mallopt(parameter, _LARGEST) != 1:
            raise RuntimeError(f"cannot keep freed memory: glibc's mallopt refused {label} = {_LARGEST}")
    global _kept
    _kept = True


def _malloc_replacing(libc: ctypes.CDLL) -> str | None:
    """The library whose ``malloc`` this process calls instead of glibc's (its file, as the dynamic
    linker names it), or ``None`` when it calls glibc's. A preloaded library (ASan's runtime
    under ``./dev sanitize``, jemalloc, tcmalloc) comes first in the process's symbol lookup."""
    process = ctypes.CDLL(None)  # the whole process's symbols, in lookup order
    called = ctypes.cast(process.malloc, ctypes.c_void_p).value
    if called == ctypes.cast(libc.malloc, ctypes.c_void_p).value:
        return None
    info = _DlInfo()
    found = getattr(process, "dladdr", None)
    if found is None or not found(ctypes.c_void_p(called), ctypes.byref(info)) or not info.dli_fname:
        return "another library"
    return info.dli_fname.decode(errors="replace")


class _DlInfo(ctypes.Structure):
    """``Dl_info`` of ``<dlfcn.h>``: what ``dladdr`` says of an address."""

    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def keeps_freed_memory() -> bool:
    """Whether :func:`keep_freed_memory` has run in this process (results files say so)."""
    return _kept
