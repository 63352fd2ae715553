"""How the Triton kernels are configured and launched.

Configs
    On a GPU, ``triton.autotune`` picks among a few configs, so a first call per key costs
    seconds, not minutes: segment ``BLOCK_NNZ`` ∈ {128, 256, 512} × ``ROWS_PER_PROGRAM`` ∈ {1, 4}
    (key: batch); pointer and SDDMM tiles ``BLOCK_K`` ∈ {4, …, 256} (patches: {1, …, 32}, some
    with a pipelined loop) × ``num_warps`` ∈ {1, …, 8} (key: ``BLOCK_B`` and the kernel's flags),
    pruned to tiles of at most 2048 elements with 2–16 per thread, which keep every lane busy
    without spilling registers (:func:`tile_configs_for`): 6 to 15 configs per batch tile
    (patches: 4 to 26). The first H200 run's configs gave a 128-thread program a 32- or 64-wide
    tile at batch 1, leaving half its lanes idle. A sweep on the H200 (95%, 4096²) found the
    fastest pointer tiles well inside this space: 1-warp programs, with ``BLOCK_K`` 32 at batch 8
    and 4-16 at batch 16-64 (B=16: 11.2 µs against 16.3 µs for the best of the earlier space).
    Under the interpreter (``TRITON_INTERPRET=1``), or with ``SNACK_TRITON_AUTOTUNE=0``, the
    fixed :data:`FIXED_CONFIGS` run instead (``@triton.autotune`` cannot run in the interpreter).

Launches (:func:`launch`)
    A launch through ``kernel[grid](...)`` costs host time that an eager layer at small batch
    pays on every call, and Triton's Autotuner adds more (31 µs per launch on the H200 machine,
    against 17 µs for the kernel itself: it rebuilds its key from every argument). So only a
    key's first call goes through the autotuner (:data:`PICKED` keeps its config), and only the
    first launch with a given specialization goes through ``kernel[grid]``: later ones call the
    compiled kernel's launcher directly (:func:`_launch_compiled`). Triton's own binder still
    computes each call's specialization (dtypes, 16-byte alignment of pointers, integers
    divisible by 16 or equal to 1), which keys the compiled kernel, so a call never runs a
    kernel compiled for another specialization. Interleaved on the H200 machine (batch 1,
    4096², 90%; medians of host time): 22.7 µs per launch against 30.1 µs through
    ``kernel[grid]``; an eager inference call 51 µs against 61; a training step 273 µs against
    305 (backward on the calling thread). The launcher's calling convention is Triton's
    internal one, checked against Triton 3.6 (the GPU machine's, and the ``dev`` pin): with
    another version (:data:`COMPILED_LAUNCH` false), under the interpreter, or while Triton's
    launch hooks are set (a profiler), every launch goes through ``kernel[grid]``.
"""

from __future__ import annotations

import os

import torch
import triton

from snack.backends.triton import kernels

__all__ = [
    "AUTOTUNE", "COMPILED_LAUNCH", "CONFIGS", "FIXED_CONFIGS", "INTERPRETED", "PATCH_CONFIGS", "PICKED",
    "TILE_CONFIGS", "TUNED", "launch", "tile_configs_for",
]  # fmt: skip

# triton.jit returns an interpreter-backed function when TRITON_INTERPRET=1 was set at import.
INTERPRETED = not isinstance(kernels.segment_sddmm_kernel, triton.runtime.JITFunction)
AUTOTUNE = not INTERPRETED and os.environ.get("SNACK_TRITON_AUTOTUNE", "1") != "0"

# Whether launches may call compiled kernels' launchers directly (module docstring, *Launches*).
COMPILED_LAUNCH = not INTERPRETED and triton.__version__.startswith("3.6.")

# Used when not autotuning. Tests shrink them to cross block boundaries on small shapes.
FIXED_CONFIGS: dict[str, dict[str, int]] = {
    "segment_spmm": {"BLOCK_NNZ": 128, "ROWS_PER_PROGRAM": 1, "num_warps": 4},
    "pointer_spmm": {"BLOCK_K": 64, "num_warps": 4},
    "segment_sddmm": {"BLOCK_K": 64, "num_warps": 4},
    "pointer_sddmm": {"BLOCK_K": 64, "num_warps": 4},
    "rowwise_backward": {"BLOCK_K": 64, "num_warps": 4},
    # their 64 × 1 × 32 tiles at batch 32: no spills
    "patch_spmm": {"BLOCK_K": 1, "NUM_STAGES": 1, "num_warps": 4},
    "patch_sddmm": {"BLOCK_K": 1, "NUM_STAGES": 1, "num_warps": 4},
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
# A patch's tile is already BLOCK_S × BLOCK_B wide: down to one non-zero per segment and step; its
# loop software-pipelined or not (NUM_STAGES: kernels.patch_spmm_kernel), the pipelined ones up to
# BLOCK_K 8: with 16 and 32, the transposed SpMM's (two loads deep) spilled registers (ptxas, sm_90).
PATCH_CONFIGS = [
    triton.Config({"BLOCK_K": k, "NUM_STAGES": s}, num_warps=w)
    for k in (1, 2, 4, 8, 16, 32) for w in (1, 2, 4, 8) for s in ((1, 3) if k <= 8 else (1,))
]  # fmt: skip
# Tile elements (BLOCK_B × BLOCK_K) per thread worth trying: fewer idle lanes, more spill registers.
TILE_ELEMENTS_PER_THREAD = (2, 16)
# Largest tile: one program holds it twice in registers (the gathered operand and the accumulator).
MAX_TILE_ELEMENTS = 2048


def tile_configs_for(configs: list, named_args: dict, **kwargs) -> list:
    """The tile configs worth timing for the call's ``BLOCK_B`` (the patch kernel's tiles are
    ``BLOCK_S × BLOCK_K × BLOCK_B``): an autotune ``early_config_prune``."""
    low, high = TILE_ELEMENTS_PER_THREAD
    tile_rows = kwargs.get("BLOCK_S", 1) * kwargs["BLOCK_B"]
    kept = [
        c for c in configs
        if low <= tile_rows * c.kwargs["BLOCK_K"] / (32 * c.num_warps) <= high
        and tile_rows * c.kwargs["BLOCK_K"] <= MAX_TILE_ELEMENTS
    ]  # fmt: skip
    return kept or configs[:1]


# kernel name -> its autotune key: argument names whose values (with the tensors' dtypes) pick a config
_AUTOTUNE_KEYS = {
    # the segment kernel's batch is in its key: rows per program depend on it
    "segment_spmm": ("batch", "INDIRECT_VALUES"),
    "pointer_spmm": ("BLOCK_B", "HAS_BIAS", "INDIRECT_VALUES"),
    "segment_sddmm": ("BLOCK_B", "BIAS_GRAD"),
    "pointer_sddmm": ("BLOCK_B", "BIAS_GRAD", "SINGLE_TILE"),
    "rowwise_backward": ("BLOCK_B", "BIAS_GRAD"),
    "patch_spmm": ("BLOCK_S", "BLOCK_B", "INDIRECT_VALUES"),
    "patch_sddmm": ("BLOCK_S", "BLOCK_B", "BIAS_GRAD", "SINGLE_TILE"),
}
# kernel name -> positions of its autotune key's non-constexpr arguments (none under the
# interpreter, which does not autotune)
_KEY_ARG_POSITIONS = {
    name: tuple(
        i for i, p in enumerate(getattr(kernels.KERNELS[name], "params", ())) if p.name in keys and not p.is_constexpr
    )
    for name, keys in _AUTOTUNE_KEYS.items()
}
# kernel name -> the configs its autotuner may time (the tile kernels' pruned per call)
CONFIGS = {
    "segment_spmm": _SEGMENT_CONFIGS,
    **dict.fromkeys(("pointer_spmm", "segment_sddmm", "pointer_sddmm", "rowwise_backward"), TILE_CONFIGS),
    **dict.fromkeys(("patch_spmm", "patch_sddmm"), PATCH_CONFIGS),
}
# kernel name -> the output its kernel accumulates into (atomic adds): every trial must start from zeros
_ACCUMULATED = {"segment_spmm": "y_ptr", "rowwise_backward": "dx_ptr", "patch_spmm": "y_ptr"}
# kernel name -> its autotuner, or None when not autotuning
TUNED = {
    name: _autotuned(
        kernels.KERNELS[name], configs, list(_AUTOTUNE_KEYS[name]),
        # the segment kernel's configs are not tiles
        prune_configs_by=None if name == "segment_spmm" else {"early_config_prune": tile_configs_for},
        reset_to_zero=[_ACCUMULATED[name]] if name in _ACCUMULATED else None,
    )
    for name, configs in CONFIGS.items()
}  # fmt: skip
# (kernel name, dtype, the call's constexprs, its positional autotune-key arguments) -> the
# config the autotuner picked for them (module docstring, *Launches*)
PICKED: dict[tuple, dict] = {}
# (kernel name, device, Triton's specialization of the call, launch options) -> the compiled kernel
_COMPILED: dict[tuple, object] = {}


def launch(name: str, grid, *args, **constexprs) -> None:
    """Run kernel ``name`` with its autotuned config, else with ``FIXED_CONFIGS[name]``.

    ``grid``: a tuple, or a function of the bound arguments (config included) returning one, as
    ``kernel[grid]`` takes it; ``args``: the kernel's positional arguments; ``constexprs``: its
    flags and ``BLOCK_B``, not the config's."""
    kernel, tuned = kernels.KERNELS[name], TUNED[name]
    if tuned is None:
        config = FIXED_CONFIGS[name]
    else:
        # a finer key than the autotuner's (all the flags): one more first call at most
        key = (name, args[0].dtype, *constexprs.values(), *(args[i] for i in _KEY_ARG_POSITIONS[name]))
        config = PICKED.get(key)
        if config is None:
            tuned[grid](*args, **constexprs)
            PICKED[key] = tuned.best_config.all_kwargs()
            return
    if COMPILED_LAUNCH:
        _launch_compiled(name, kernel, grid, args, {**constexprs, **config})
    else:
        kernel[grid](*args, **constexprs, **config)


def _launch_compiled(name: str, kernel, grid, args: tuple, kwargs: dict) -> None:
    """``kernel[grid](*args, **kwargs)`` on the current CUDA device and stream, through the
    compiled kernel's launcher once ``kernel[grid]`` has compiled it for this specialization
    (module docstring, *Launches*)."""
    device = torch.cuda.current_device()
    bind = kernel.device_caches[device][4]  # Triton's per-kernel argument binder
    bound, specialization, options = bind(*args, **kwargs)
    key = (name, device, tuple(specialization), tuple(options.items()))
    compiled = _COMPILED.get(key)
    if compiled is None or _launch_hooks_set():
        _COMPILED[key] = kernel[grid](*args, **kwargs)
        return
    if callable(grid):
        grid = grid(bound)
    compiled.run(
        grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
        torch._C._cuda_getCurrentRawStream(device), compiled.function, compiled.packed_metadata,
        None, None, None, *bound.values(),
    )  # fmt: skip


def _launch_hooks_set() -> bool:
    """Whether a launch hook is set (Triton 3.6 keeps them in ``HookChain``s; a plain function or
    ``None`` may be assigned too)."""
    runtime = triton.knobs.runtime
    return any(getattr(hook, "calls", hook) for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook))
