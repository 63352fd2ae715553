"""The native CPU backend: C++ kernels built once per machine, just in time: the sparse ops
(``kernels.cpp``), the index helpers of topology updates (``index_ops.cpp``), RigL's gradient
scores (``grow_scores.cpp``) and ``SparseConv2d``'s direct convolution (``conv_kernels.cpp``, its
depthwise form ``depthwise_kernels.cpp``, both walking as ``conv_walk.h`` lays out), the 3-D
layers' plane layout (``plane_kernels.cpp``), the embedding lookup (``embedding_kernels.cpp``) and
the LSTM and GRU steps' elementwise cells (``recurrent_kernels.cpp``), one library.

This package builds them; :mod:`.native` loads them (building first if needed) and wraps the ops,
and is what :mod:`snack.backends` imports. Importing this package itself builds nothing, so that
``python -m snack.backends.cpu --build --verbose`` (or ``--prune``, ``--help``) acts before any build.

The kernels are compiled with :func:`torch.utils.cpp_extension.load` on first use (or ahead of
time by ``python -m snack.backends.cpu --build``, which ``./dev`` runs during set-up) and cached
under ``$SNACK_CACHE_DIR`` (default ``~/.cache/snack``). The cache key covers the sources, the
compiler flags, the torch version and the instruction set, so an edit or a torch upgrade
rebuilds, and a cache shared between machines never runs code built for a wider instruction set.

Memory checking: with ``SNACK_CPU_SANITIZE=address`` the kernels are built with AddressSanitizer
(a separate cache entry) and every out-of-bounds or use-after-free access aborts with a report.
The ASan runtime must then be preloaded into Python; ``./dev sanitize`` sets that up and runs
the CPU tests so.

Instruction set: the kernels are compiled for the vector extension PyTorch itself uses on this
machine (``torch.backends.cpu.get_cpu_capability()``: AVX-512, AVX2, or none), never with
``-march=native``. ``ATEN_CPU_CAPABILITY=avx2`` lowers both.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

import torch
from filelock import FileLock

__all__ = ["BuildError", "build", "prune"]

_SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "kernels.cpp", "index_ops.cpp", "grow_scores.cpp", "conv_kernels.cpp", "depthwise_kernels.cpp",
        "plane_kernels.cpp", "embedding_kernels.cpp", "recurrent_kernels.cpp",
    )
)
_HEADERS = (Path(__file__).with_name("conv_walk.h"),)  # included by the sources: part of the cache key
_COMMON_FLAGS = ["-O3", "-fopenmp", "-std=c++17"]
# Vector extensions per PyTorch CPU capability. FMA comes with every AVX2 machine.
_ISA_FLAGS = {
    "AVX2": ["-mavx2", "-mfma"],
    "AVX512": ["-mavx2", "-mfma", "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-mprefer-vector-width=512"],
}


# SNACK_CPU_SANITIZE value -> (extra compiler flags, extra linker flags). -g gives reports lines;
# -O1 (after -O3, so it wins) compiles an instrumented build in about 1 minute rather than 5.
_SANITIZER_FLAGS = {
    "address": (["-O1", "-fsanitize=address", "-fno-omit-frame-pointer", "-g"], ["-fsanitize=address"]),
}


class BuildError(RuntimeError):
    """The native CPU kernels could not be compiled or loaded."""


def _cache_dir() -> Path:
    return Path(os.environ.get("SNACK_CACHE_DIR") or Path.home() / ".cache" / "snack")


def _sanitizer() -> str | None:
    """The sanitizer ``SNACK_CPU_SANITIZE`` asks for (``None`` when unset or empty)."""
    sanitizer = os.environ.get("SNACK_CPU_SANITIZE") or None
    if sanitizer is not None and sanitizer not in _SANITIZER_FLAGS:
        raise BuildError(f"SNACK_CPU_SANITIZE must be one of {sorted(_SANITIZER_FLAGS)} or unset, got {sanitizer!r}")
    if sanitizer == "address" and "libasan" not in os.environ.get("LD_PRELOAD", ""):
        # without it, loading the library aborts the interpreter rather than raise
        raise BuildError(
            "SNACK_CPU_SANITIZE=address needs the ASan runtime preloaded into Python "
            "(LD_PRELOAD=\"$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so.6)\"); "
            "`./dev sanitize` sets it up"
        )
    return sanitizer


def _build_spec() -> tuple[str, list[str], list[str], Path]:
    """``(library name, compiler flags, linker flags, build directory)`` for this machine, source
    and sanitizer."""
    name, flags, ldflags = _library(torch.backends.cpu.get_cpu_capability(), _sanitizer())
    return name, flags, ldflags, _cache_dir() / name


def _library(capability: str, sanitizer: str | None) -> tuple[str, list[str], list[str]]:
    """``(library name, compiler flags, linker flags)`` of this source, torch and Python for a
    CPU capability (``"AVX512"``, ``"AVX2"``, ``"DEFAULT"``) and sanitizer."""
    extra_flags, extra_ldflags = _SANITIZER_FLAGS[sanitizer] if sanitizer else ([], [])
    flags = _COMMON_FLAGS + _ISA_FLAGS.get(capability, []) + extra_flags
    ldflags = ["-fopenmp"] + extra_ldflags
    sources = b"\0".join(source.read_bytes() for source in _SOURCES + _HEADERS)
    parts = (sources, " ".join(flags + ldflags).encode(), torch.__version__.encode(), sys.version.encode())
    key = hashlib.sha256(b"".join(parts))
    name = f"snack_cpu_{capability.lower()}{'_' + sanitizer if sanitizer else ''}_{key.hexdigest()[:12]}"
    return name, flags, ldflags


def prune() -> list[Path]:
    """Delete the cached builds this source, torch and Python would never load again (those of
    earlier sources, or of another torch or Python), for every ISA and sanitizer; return them.

    The cache keeps every build it makes, 1-3 MB each and up to 45 MB sanitized (measured on this
    project's machine); a cache shared by environments with another torch or Python loses their
    builds, which are rebuilt on first use.
    """
    sanitizers = (None, *_SANITIZER_FLAGS)
    current = {_library(isa, sanitizer)[0] for isa in ("DEFAULT", *_ISA_FLAGS) for sanitizer in sanitizers}
    stale = [path for path in sorted(_cache_dir().glob("snack_cpu_*")) if path.is_dir() and path.name not in current]
    for path in stale:
        shutil.rmtree(path)
        path.with_name(f"{path.name}.lock").unlink(missing_ok=True)  # build()'s
    return stale


def build(*, verbose: bool | None = None) -> Path:
    """Compile the kernels if the cache lacks them, load them, and return the library's path.
    Processes building at once take turns (a file lock beside the build directory); from a cache
    where no lock can be made (read-only), a build it holds is loaded all the same.

    ``verbose`` (default: the ``SNACK_BUILD_VERBOSE`` environment variable is set) shows the
    compiler's output.

    Raises:
        BuildError: with the compiler's message when the build fails.
    """
    if verbose is None:
        verbose = bool(os.environ.get("SNACK_BUILD_VERBOSE"))
    name, flags, ldflags, build_dir = _build_spec()
    try:
        build_dir.parent.mkdir(parents=True, exist_ok=True)
        # Processes that start together on a cache without this build (DDP ranks, test workers)
        # take turns: the first builds it, the others wait and load it. Unlocked, one could load
        # a library still being linked, find it truncated and delete the build under the other.
        lock = FileLock(build_dir.with_name(f"{name}.lock"))
        lock.acquire()
    except OSError as error:
        if (build_dir / f"{name}.so").exists():  # a read-only cache that holds the build: load it
            return _load_or_build(name, flags, ldflags, build_dir, verbose)
        raise _build_error(error, build_dir) from error
    try:
        return _load_or_build(name, flags, ldflags, build_dir, verbose)
    finally:
        lock.release()


def _load_or_build(name: str, flags: list[str], ldflags: list[str], build_dir: Path, verbose: bool) -> Path:
    """:func:`build`'s work, under its lock: load the cached library, else compile and load it."""
    library = build_dir / f"{name}.so"
    if library.exists():
        try:
            torch.ops.load_library(str(library))
            return library
        except OSError as error:  # e.g. truncated by a build that was killed: build it again
            print(f"snack: the cached native kernels cannot be loaded ({error}); rebuilding", file=sys.stderr)
            shutil.rmtree(build_dir, ignore_errors=True)
    print("snack: compiling native CPU kernels (one-time, about 30 s)...", file=sys.stderr, flush=True)
    from torch.utils import cpp_extension  # heavy import, only needed to build

    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        # cpp_extension takes turns through a "baton" file of its own, which a build killed mid-compile
        # leaves behind; every later build then waits on it forever, silently. Under build()'s lock no
        # other snack process is compiling here, so a baton found now is such a leftover.
        (build_dir / "lock").unlink(missing_ok=True)
        cpp_extension.load(
            name=name,
            sources=[str(source) for source in _SOURCES],
            extra_cflags=flags,
            extra_ldflags=ldflags,
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=verbose,
        )
    except Exception as error:  # compiler missing, compile error, ninja failure: all reported the same way
        raise _build_error(error, build_dir) from error
    return library


def _build_error(error: Exception, build_dir: Path) -> BuildError:
    return BuildError(
        f"building snack's native CPU kernels failed ({type(error).__name__}: {error}). "
        f"They need a C++17 compiler (g++ or clang++) and ninja; the build directory is {build_dir}. "
        "Run `python -m snack.backends.cpu --build --verbose` for the full log, or use "
        "snack.use_backend('reference') to run without them (slowly)."
    )
