"""Where and when a benchmark result was measured: the lines the results files and the README quote."""

from __future__ import annotations

import datetime
import os
import platform

import torch

from snack import backends
from snack.bench.page_faults import keeps_freed_memory

__all__ = ["machine_line", "utc_stamp"]


def machine_line(device: torch.device) -> str:
    """One line naming the hardware and software a result was measured on, and whether the process
    told glibc to keep freed memory (:func:`snack.bench.page_faults.keep_freed_memory`)."""
    if device.type == "cuda":
        hardware = torch.cuda.get_device_name(device)
    else:
        model = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as info:
                model = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
        except (OSError, StopIteration):
            pass
        hardware = f"{model}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, {_cpu_kernels()}"
    line = f"{hardware}; torch {torch.__version__}; Python {platform.python_version()}"
    return line + ("; glibc keeps freed memory" if keeps_freed_memory() else "")


def _cpu_kernels() -> str:
    """The vector ISA the native kernels are built for, with the batch-1 gather mode of an
    AVX-512 build (which one is faster depends on the CPU, see ``snack.backends.cpu.native``)."""
    isa = torch.backends.cpu.get_cpu_capability()
    try:
        native = backends.get_backend("cpu")
    except backends.BackendUnavailableError:
        return isa
    mode = native.gather_mode()
    return f"{isa} (batch-1 gathers: {mode})" if mode else isa


def utc_stamp() -> str:
    """The time now, as results are dated: ``"2026-11-30 10:15 UTC"``."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
