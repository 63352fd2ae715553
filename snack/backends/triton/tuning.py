"""How the Triton kernels are configured, launched and picked between.

Configs
    On a GPU, ``triton.autotune`` picks among a few configs, so a first call per key costs
    seconds, not minutes: segment ``BLOCK_NNZ`` ∈ {128, 256, 512} × ``ROWS_PER_PROGRAM`` ∈ {1, 4}
    (key: batch); pointer and SDDMM tiles ``BLOCK_K`` ∈ {4, …, 256} × ``num_warps`` ∈ {1, …, 8}
    (key: ``BLOCK_B`` and the kernel's flags), pruned to tiles of at most 2048 elements with 2–16
    per thread, which keep every lane busy without spilling registers (:func:`tile_configs_for`):
    6 to 15 configs per batch tile. The first H200 run's configs gave a 128-thread program a 32-
    or 64-wide tile at batch 1, leaving half its lanes idle. A sweep on the H200 (95%, 4096²)
    found the fastest pointer tiles well inside this space: 1-warp programs, with ``BLOCK_K`` 32
    at batch 8 and 4-16 at batch 16-64 (B=16: 11.2 µs against 16.3 µs for the best of the
    earlier space). Under the interpreter (``TRITON_INTERPRET=1``), or with
    ``SNACK_TRITON_AUTOTUNE=0``, the fixed :data:`FIXED_CONFIGS` run instead
    (``@triton.autotune`` cannot run in the interpreter).

Launches (:func:`launch`)
    Triton's Autotuner rebuilds its key from every argument on each call: 31 µs of host time per
    launch on the H200 machine against 17 µs for calling the kernel itself. So only a key's
    first call goes through the autotuner; later ones launch the kernel directly with the config
    it picked (:data:`PICKED`).

Timed picks (:func:`fastest`)
    Where two implementations of a product compete (the backend's value reads and SDDMM forms),
    the first call of a key on a GPU times each, computing the whole product, and keeps the
    faster.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable

import torch
import triton

from snack.backends.triton import kernels

__all__ = ["AUTOTUNE", "FIXED_CONFIGS", "INTERPRETED", "PICKED", "TILE_CONFIGS", "TUNED", "fastest", "launch",
           "tile_configs_for"]  # fmt: skip

# triton.jit returns an interpreter-backed function when TRITON_INTERPRET=1 was set at import.
INTERPRETED = not isinstance(kernels.segment_sddmm_kernel, triton.runtime.JITFunction)
AUTOTUNE = not INTERPRETED and os.environ.get("SNACK_TRITON_AUTOTUNE", "1") != "0"

# Used when not autotuning. Tests shrink them to cross block boundaries on small shapes.
FIXED_CONFIGS: dict[str, dict[str, int]] = {
    "segment_spmm": {"BLOCK_NNZ": 128, "ROWS_PER_PROGRAM": 1, "num_warps": 4},
    "pointer_spmm": {"BLOCK_K": 64, "num_warps": 4},
    "segment_sddmm": {"BLOCK_K": 64, "num_warps": 4},
    "pointer_sddmm": {"BLOCK_K": 64, "num_warps": 4},
}


def _autotuned(kernel, configs, key, **options):
    if not AUTOTUNE:
        return None
    # Short benchmarks per config: tuning happens on the first call of every new key.
    bench = lambda fn, quantiles: triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)  # noqa: E731
    return triton.autotune(configs, key=key, do_bench=bench, **options)(kernel)


_SEGMENT_CONFIGS = [
    triton.Config({"BLOCK_NNZ": n, "ROWS_PER_PROGRAM": r}, num_warps=4) for n in (128, 256, 512) for r in (1, 4)
]
TILE_CONFIGS = [triton.Config({"BLOCK_K": k}, num_warps=w) for k in (4, 8, 16, 32, 64, 128, 256) for w in (1, 2, 4, 8)]
# Tile elements (BLOCK_B × BLOCK_K) per thread worth trying: fewer idle lanes, more spill registers.
TILE_ELEMENTS_PER_THREAD = (2, 16)
# Largest tile: one program holds it twice in registers (the gathered operand and the accumulator).
MAX_TILE_ELEMENTS = 2048


def tile_configs_for(configs: list, named_args: dict, **kwargs) -> list:
    """The tile configs worth timing for the call's ``BLOCK_B`` (an autotune ``early_config_prune``)."""
    low, high = TILE_ELEMENTS_PER_THREAD
    block_b = kwargs["BLOCK_B"]
    kept = [
        c for c in configs
        if low <= block_b * c.kwargs["BLOCK_K"] / (32 * c.num_warps) <= high
        and block_b * c.kwargs["BLOCK_K"] <= MAX_TILE_ELEMENTS
    ]  # fmt: skip
    return kept or configs[:1]


# kernel name -> its autotune key: argument names whose values (with the tensors' dtypes) pick a config
_AUTOTUNE_KEYS = {
    # the segment kernel's batch is in its key: rows per program depend on it
    "segment_spmm": ("batch", "INDIRECT_VALUES"),
    "pointer_spmm": ("BLOCK_B", "HAS_BIAS", "INDIRECT_VALUES"),
    "segment_sddmm": ("BLOCK_B", "BIAS_GRAD"),
    "pointer_sddmm": ("BLOCK_B", "BIAS_GRAD", "SINGLE_TILE"),
}
_PRUNED = {"early_config_prune": tile_configs_for}
# kernel name -> its autotuner, or None when not autotuning
TUNED = {
    # The segment kernel accumulates into its output: every trial must start from zeros.
    "segment_spmm": _autotuned(
        kernels.segment_spmm_kernel, _SEGMENT_CONFIGS, list(_AUTOTUNE_KEYS["segment_spmm"]), reset_to_zero=["y_ptr"]
    ),
    **{
        name: _autotuned(kernels.KERNELS[name], TILE_CONFIGS, list(_AUTOTUNE_KEYS[name]), prune_configs_by=_PRUNED)
        for name in ("pointer_spmm", "segment_sddmm", "pointer_sddmm")
    },
}
# (kernel name, autotune key values, dtype) -> the config the autotuner picked for them (module
# docstring, *Launches*); and the key of each timed pick -> the variant :func:`fastest` kept.
PICKED: dict[tuple, dict | str] = {}


def launch(name: str, grid, *args, **constexprs) -> None:
    """Run kernel ``name`` with its autotuned config, else with ``FIXED_CONFIGS[name]``."""
    kernel, tuned = kernels.KERNELS[name], TUNED[name]
    if tuned is None:
        kernel[grid](*args, **constexprs, **FIXED_CONFIGS[name])
        return
    # the autotuner's key: the key arguments' values and the tensors' dtypes (the first tensor's
    # fixes them all: the others share it or are int32 indices)
    key_values = tuple(constexprs[k] if k in constexprs else args[kernel.arg_names.index(k)] for k in _AUTOTUNE_KEYS[name])
    key = (name, key_values, args[0].dtype)
    config = PICKED.get(key)
    if config is None:
        tuned[grid](*args, **constexprs)
        PICKED[key] = tuned.best_config.all_kwargs()
    else:
        kernel[grid](*args, **constexprs, **config)


def fastest(key: tuple, variants: tuple[str, ...], run: Callable[[str], object], default: str) -> str:
    """The fastest of ``variants``, where ``run(variant)`` computes the product (allocation
    included), timed on the first call of ``key`` on a GPU (``do_bench``, cold caches, as the
    autotuner times) and remembered; ``default`` when not autotuning, and during CUDA-graph
    capture (timing would break it). A variant that raises while timed (say, one that does not
    compile for this GPU) is left out with a ``RuntimeWarning``; if all raise, the first error
    propagates. A remembered pick costs one dict lookup: this runs on every call.

    The callers' keys hold the batch tile, the dtype and ``nnz.bit_length()``: whether the
    weight fits in L2 may change the winner, so layers whose sizes differ by more than 2× are
    timed apart."""
    if not AUTOTUNE:
        return default
    picked = PICKED.get(key)
    if picked is None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return default
        import triton.testing

        times, errors = {}, {}
        for name in variants:
            try:
                times[name] = triton.testing.do_bench(functools.partial(run, name), warmup=5, rep=20)
            except Exception as error:  # e.g. a variant that does not compile for this GPU
                errors[name] = error
        if not times:
            raise next(iter(errors.values()))
        for name, error in errors.items():
            warnings.warn(
                f"snack triton backend: variant {name!r} failed for {key} ({type(error).__name__}: {error}); "
                f"using {min(times, key=times.get)!r}",
                RuntimeWarning, stacklevel=2,
            )  # fmt: skip
        picked = PICKED[key] = min(times, key=times.get)
    return picked
