"""``snack compile-check``: compile every Triton kernel ahead of time for given GPU architectures,
without a GPU (``triton.compile`` with a ``GPUTarget``), so a kernel that does not build for a
target fails here and not on the first call on that GPU.

Prints one line per kernel variant, dtype and architecture::

    segment_spmm               float32   sm_90  ok  15048 bytes

and returns 1 if any fails (the error follows its line). Block sizes are the fixed configs of
:mod:`snack.backends.triton.tuning`.
"""

from __future__ import annotations

import argparse
import sys
import traceback

# (variant name, kernel name, constexpr flags): each compiled variant a layer runs. The SpMM kernels
# read values sequentially (forward) or through csc_perm (INDIRECT_VALUES: a transposed SpMM); the
# pointer kernel adds the bias in its epilogue in a layer's forward; the SDDMM of a training step also
# sums the bias gradient (BIAS_GRAD), as does the backward's row walk. The patch kernels (prepared for
# measurement) compile for the batch tiles where they may win (BLOCK_B; the others take _BLOCK_B):
# 1 for the transposed SpMM, 32 for the SpMM and the SDDMM; with its loop software-pipelined
# (NUM_STAGES) or not.
_NO_FLAGS = {"INDIRECT_VALUES": False}
_VARIANTS = [
    ("segment_spmm", "segment_spmm", _NO_FLAGS),
    ("segment_spmm[indirect]", "segment_spmm", {"INDIRECT_VALUES": True}),
    ("pointer_spmm", "pointer_spmm", {"HAS_BIAS": False, **_NO_FLAGS}),
    ("pointer_spmm[bias]", "pointer_spmm", {"HAS_BIAS": True, **_NO_FLAGS}),
    ("pointer_spmm[indirect]", "pointer_spmm", {"HAS_BIAS": False, "INDIRECT_VALUES": True}),
    ("segment_sddmm", "segment_sddmm", {"BIAS_GRAD": False}),
    ("segment_sddmm[bias]", "segment_sddmm", {"BIAS_GRAD": True}),
    ("pointer_sddmm", "pointer_sddmm", {"BIAS_GRAD": False, "SINGLE_TILE": True}),
    ("pointer_sddmm[bias]", "pointer_sddmm", {"BIAS_GRAD": True, "SINGLE_TILE": True}),
    ("pointer_sddmm[bias,tiles]", "pointer_sddmm", {"BIAS_GRAD": True, "SINGLE_TILE": False}),
    ("rowwise_backward", "rowwise_backward", {"BIAS_GRAD": False}),
    ("rowwise_backward[bias]", "rowwise_backward", {"BIAS_GRAD": True}),
    ("patch_spmm[indirect]", "patch_spmm", {"INDIRECT_VALUES": True, "BLOCK_B": 1}),
    ("patch_spmm[indirect,stages]", "patch_spmm", {"INDIRECT_VALUES": True, "BLOCK_B": 1, "NUM_STAGES": 3}),
    ("patch_spmm[B=32]", "patch_spmm", {**_NO_FLAGS, "BLOCK_B": 32}),
    ("patch_spmm[B=32,stages]", "patch_spmm", {**_NO_FLAGS, "BLOCK_B": 32, "NUM_STAGES": 3}),
    ("patch_sddmm[bias,B=32]", "patch_sddmm", {"BIAS_GRAD": True, "SINGLE_TILE": True, "BLOCK_B": 32}),
    ("patch_sddmm[bias,B=32,stages]", "patch_sddmm", {"BIAS_GRAD": True, "SINGLE_TILE": True, "BLOCK_B": 32,
                                                      "NUM_STAGES": 3}),
    ("patch_sddmm[bias,tiles]", "patch_sddmm", {"BIAS_GRAD": True, "SINGLE_TILE": False, "BLOCK_B": 32}),
]
_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
# Batch tile compiled for the pointer and SDDMM kernels (a mid-size one of backend._block_b).
_BLOCK_B = 16


# Compute capabilities Triton 3.6 compiles these kernels for (sm_75 and up; others make LLVM abort
# the process or ptxas reject the PTX).
ARCHS = (75, 80, 86, 87, 89, 90, 100, 103, 120)


def _arch(text: str) -> int:
    try:
        arch = int(text)
    except ValueError:
        arch = None
    if arch not in ARCHS:
        raise argparse.ArgumentTypeError(f"must be a compute capability of {', '.join(map(str, ARCHS))}; got {text!r}")
    return arch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--arch", type=_arch, action="append", metavar="SM",
        help=f"CUDA compute capability to compile for, e.g. 80 (A100) or 90 (H100/H200); one of "
             f"{', '.join(map(str, ARCHS))}; repeatable (default: 80 and 90)",
    )  # fmt: skip
    parser.add_argument(
        "--dtype", action="append", choices=sorted(_DTYPES),
        help="value/activation dtype to compile for; repeatable (default: all three)",
    )  # fmt: skip


def _signature(kernel_name: str, dtype: str, flags: dict[str, bool]) -> tuple[dict[str, str], dict[str, object]]:
    """Argument types and constexpr values of one kernel variant, as ``ASTSource`` takes them."""
    from snack.backends.triton.backend import PATCH_SEGMENTS
    from snack.backends.triton.tuning import FIXED_CONFIGS

    t = _DTYPES[dtype]
    config = {k: v for k, v in FIXED_CONFIGS[kernel_name].items() if k != "num_warps"}
    if kernel_name == "segment_spmm":
        pointers = {"a_ptr": t, "values_ptr": t, "value_index_ptr": "i32", "seg_ptr_ptr": "i32",
                    "seg_index_ptr": "i32", "gather_index_ptr": "i32", "y_ptr": "fp32"}  # fmt: skip
        scalars = ["nnz", "batch", "n_out", "stride_ab", "stride_ai"]
        constexprs = {**flags, **config}
    elif kernel_name == "pointer_spmm":
        pointers = {"a_ptr": t, "values_ptr": t, "value_index_ptr": "i32", "seg_ptr_ptr": "i32",
                    "gather_index_ptr": "i32", "bias_ptr": t, "y_ptr": t}  # fmt: skip
        scalars = ["batch", "stride_ab", "stride_ai", "stride_yb", "stride_ys"]
        constexprs = {**flags, "WHILE_LOOP": False, "BLOCK_B": _BLOCK_B, **config}
    elif kernel_name == "segment_sddmm":
        pointers = {"dy_ptr": t, "x_ptr": t, "row_ptr": "i32", "col_ptr": "i32", "out_ptr": t, "bias_grad_ptr": t}
        scalars = ["nnz", "batch", "n_out", "stride_db", "stride_dr", "stride_xb", "stride_xc"]
        constexprs = {**flags, "BLOCK_B": _BLOCK_B, **config}
    elif kernel_name == "pointer_sddmm":
        pointers = {"dy_ptr": t, "x_ptr": t, "rowptr_ptr": "i32", "col_ptr": "i32", "out_ptr": t, "bias_grad_ptr": t}
        scalars = ["batch", "stride_db", "stride_dr", "stride_xb", "stride_xc"]
        constexprs = {**flags, "WHILE_LOOP": False, "BLOCK_B": _BLOCK_B, **config}
    elif kernel_name == "patch_sddmm":
        pointers = {"dy_ptr": t, "x_ptr": t, "band_ptr_ptr": "i32", "col_ptr": "i32", "out_ptr": t, "bias_grad_ptr": t}
        scalars = ["batch", "n_out", "stride_db", "stride_dr", "stride_xb", "stride_xc"]
        constexprs = {"WHILE_LOOP": False, "BLOCK_S": PATCH_SEGMENTS, **config, **flags}
    elif kernel_name == "patch_spmm":
        pointers = {"a_ptr": t, "values_ptr": t, "value_index_ptr": "i32", "band_ptr_ptr": "i32",
                    "gather_index_ptr": "i32", "y_ptr": "fp32"}  # fmt: skip
        scalars = ["batch", "n_out", "stride_ab", "stride_ai"]
        constexprs = {"WHILE_LOOP": False, "BLOCK_S": PATCH_SEGMENTS, **config, **flags}
    else:  # rowwise_backward
        pointers = {"dy_ptr": t, "x_ptr": t, "values_ptr": t, "rowptr_ptr": "i32", "col_ptr": "i32", "dx_ptr": "fp32",
                    "dvalues_ptr": t, "bias_grad_ptr": t}  # fmt: skip
        scalars = ["batch", "stride_db", "stride_dr", "stride_xb", "stride_xc", "stride_gb", "stride_gc"]
        constexprs = {**flags, "WHILE_LOOP": False, "BLOCK_B": _BLOCK_B, **config}
    types = {name: "*" + kind for name, kind in pointers.items()}
    types.update({name: "i32" for name in scalars})
    types.update({name: "constexpr" for name in constexprs})
    # in the kernel's argument order, which is how Triton matches types to arguments
    return {name: types[name] for name in _arg_names(kernel_name)}, constexprs


def _arg_names(kernel_name: str) -> list[str]:
    from snack.backends.triton import kernels

    return list(kernels.KERNELS[kernel_name].arg_names)


def compile_kernel(variant: str, dtype: str, arch: int):
    """Compile one kernel variant for ``sm_<arch>``; returns the ``CompiledKernel``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from snack.backends.triton import kernels
    from snack.backends.triton.tuning import FIXED_CONFIGS

    _, kernel_name, flags = next(v for v in _VARIANTS if v[0] == variant)
    fn = kernels.KERNELS[kernel_name]
    signature, constexprs = _signature(kernel_name, dtype, flags)
    options = {"num_warps": FIXED_CONFIGS[kernel_name]["num_warps"]}
    return triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=GPUTarget("cuda", arch, 32), options=options)


def run(args: argparse.Namespace) -> int:
    import triton

    if triton.knobs.runtime.interpret:  # TRITON_INTERPRET as Triton reads it ("1", "true", "on", ...)
        print("snack compile-check: unset TRITON_INTERPRET; the interpreter builds no GPU binaries", file=sys.stderr)
        return 1
    archs = list(dict.fromkeys(args.arch or [80, 90]))  # each once, in the order given
    dtypes = list(dict.fromkeys(args.dtype or _DTYPES))
    failures = 0
    for variant, _, _ in _VARIANTS:
        for dtype in dtypes:
            for arch in archs:
                try:
                    compiled = compile_kernel(variant, dtype, arch)
                    size = len(compiled.asm["cubin"])
                except Exception:  # report every failure, then exit non-zero
                    failures += 1
                    print(f"{variant:26s} {dtype:9s} sm_{arch}  FAILED", flush=True)
                    print(traceback.format_exc(), flush=True)
                    continue
                print(f"{variant:26s} {dtype:9s} sm_{arch}  ok  {size} bytes", flush=True)
    total = len(_VARIANTS) * len(dtypes) * len(archs)
    print(f"{total - failures}/{total} kernels compiled")
    return 1 if failures else 0
