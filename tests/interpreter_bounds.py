"""Bounds checking for Triton's interpreter: every memory access must land inside a kernel argument.

On a GPU an out-of-bounds read returns whatever lies next to the tensor, or faults, and
``compute-sanitizer`` is the tool that notices. Under ``TRITON_INTERPRET=1`` the interpreter
reads and writes host memory through raw addresses, just as unchecked. ``checked_accesses()``
closes that gap for the tests: while it is active, each launch records the byte ranges of its
tensor arguments (each tensor's own elements, not its whole storage, so a view's neighbours
count as outside), and every load, store and atomic checks the addresses of its *unmasked*
lanes against them. A stray access fails the test with the kernel, the operation, the address
and the nearest argument, even when its value never reaches a result.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from triton.runtime import interpreter


def _extent(tensor: torch.Tensor) -> tuple[int, int]:
    """``[first byte, one past the last byte)`` of the elements ``tensor`` can address."""
    if tensor.numel() == 0:
        return tensor.data_ptr(), tensor.data_ptr()
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return tensor.data_ptr(), tensor.data_ptr() + (last + 1) * tensor.element_size()


class _Launch:
    """The argument ranges of the kernel running now, merged where they overlap."""

    def __init__(self, kernel: str, arguments: dict[str, object]):
        self.kernel = kernel
        spans = sorted((*_extent(t), name) for name, t in arguments.items() if isinstance(t, torch.Tensor))
        self.named = [span for span in spans if span[1] > span[0]]
        merged: list[list[int]] = []
        for start, end, _ in self.named:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        self.starts = np.array([m[0] for m in merged], dtype=np.uint64)
        self.ends = np.array([m[1] for m in merged], dtype=np.uint64)

    def check(self, operation: str, addresses: np.ndarray, mask: np.ndarray | None, item_bytes: int) -> None:
        """Fails if any unmasked ``addresses`` (uint64 array) reads or writes outside every argument."""
        addresses = addresses if mask is None else addresses[np.broadcast_to(mask, addresses.shape)]
        addresses = addresses.astype(np.uint64).ravel()
        if addresses.size == 0:
            return
        inside = np.zeros(addresses.shape, dtype=bool)
        if self.starts.size:
            which = np.searchsorted(self.starts, addresses, side="right") - 1
            found = which >= 0
            span = np.where(found, which, 0)
            inside = found & (addresses + np.uint64(item_bytes) <= self.ends[span])
        if not inside.all():
            stray = int(addresses[~inside][0])
            pytest.fail(
                f"{self.kernel}: {operation} of {item_bytes} bytes at {self._describe(stray)} "
                f"({int((~inside).sum())} stray lanes in this access)",
                pytrace=False,
            )

    def _describe(self, address: int) -> str:
        if not self.named:
            return f"address {address:#x}, and the kernel has no tensor arguments"
        start, end, name = min(self.named, key=lambda s: min(abs(address - s[0]), abs(address - s[1])))
        if address < start:
            return f"{start - address} bytes before {name!r}"
        return f"byte {address - start} of {name!r}, which has {end - start} bytes"


@contextlib.contextmanager
def checked_accesses() -> Iterator[None]:
    """Within the block, interpreted kernels fail on any access outside their tensor arguments."""
    builder = interpreter.interpreter_builder
    launches: list[_Launch] = []
    real_call = interpreter.GridExecutor.__call__
    real_load, real_store = builder.create_masked_load, builder.create_masked_store
    real_rmw, real_cas = builder.create_atomic_rmw, builder.create_atomic_cas

    def call(executor, *args, **kwargs):
        names = inspect.signature(executor.fn).parameters
        bound = dict(zip(names, args)) | kwargs
        launches.append(_Launch(getattr(executor.fn, "__name__", "kernel"), bound))
        try:
            return real_call(executor, *args, **kwargs)
        finally:
            launches.pop()

    def item_bytes(pointers) -> int:
        return np.dtype(interpreter._get_np_dtype(pointers.get_element_ty())).itemsize

    def load(ptrs, mask, *rest):
        launches[-1].check("load", ptrs.data, mask.data, item_bytes(ptrs))
        return real_load(ptrs, mask, *rest)

    def store(ptrs, value, mask, *rest):
        launches[-1].check("store", ptrs.data, mask.data, item_bytes(ptrs))
        return real_store(ptrs, value, mask, *rest)

    def rmw(op, ptr, value, mask, *rest):
        launches[-1].check("atomic", ptr.data, mask.data, item_bytes(ptr))
        return real_rmw(op, ptr, value, mask, *rest)

    def cas(ptr, compare, value, *rest):
        launches[-1].check("atomic_cas", ptr.data, None, item_bytes(ptr))
        return real_cas(ptr, compare, value, *rest)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(interpreter.GridExecutor, "__call__", call)
        patch.setattr(builder, "create_masked_load", load)
        patch.setattr(builder, "create_masked_store", store)
        patch.setattr(builder, "create_atomic_rmw", rmw)
        patch.setattr(builder, "create_atomic_cas", cas)
        yield
