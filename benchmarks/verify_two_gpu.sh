#!/usr/bin/env bash
# diffusers-cudnn-fix verify on two GPUs of one host over NCCL (one GPU per rank), as a user would run it,
# both ways of launching: --nproc 2 (verify starts its ranks) and torchrun --nproc-per-node 2. Not run yet:
# no two-GPU machine was lent. From the checkout, with torch (CUDA) and diffusers installed, or with a release
# folder first on PYTHONPATH:
#
#   bash benchmarks/verify_two_gpu.sh                  # the installed diffusers
#   DCF_RELEASES="0.39.0 0.42.1" bash benchmarks/verify_two_gpu.sh   # releases under .cache/diffusers
#
# Each run is under a time limit; its output and exit status go to ${OUT:-/tmp/out}/verify-two-gpu.log.
# Expected: exit 0 (PASS) everywhere with the package; 0.39.0 ring without the package exit 1 (MISMATCH).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG=$OUT/verify-two-gpu.log
: >"$LOG"
one() {  # one RELEASE|installed ARGS...: a verify run under a 300 s limit, logged with its exit status
    local release=$1 path=${PYTHONPATH:-}
    shift
    [ "$release" != installed ] && path=$PWD/.cache/diffusers/$release${path:+:$path}
    echo "### $release: $*" | tee -a "$LOG"
    PYTHONPATH=$path timeout -s INT -k 10 300 "$@" 2>&1 | tee -a "$LOG"
    echo "exit ${PIPESTATUS[0]}" | tee -a "$LOG"
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >>"$LOG" 2>&1
for release in ${DCF_RELEASES:-installed}; do
    for backend in _native_cudnn _native_flash; do
        one "$release" python3 -m diffusers_cudnn_fix verify --nproc 2 --backend $backend
        one "$release" python3 -m diffusers_cudnn_fix verify --nproc 2 --ring 2 --backend $backend
        one "$release" python3 -m diffusers_cudnn_fix verify --nproc 2 --backend $backend --compile
    done
    one "$release" python3 -m diffusers_cudnn_fix verify --nproc 2 --model qwen --mask padded
    one "$release" python3 -m diffusers_cudnn_fix verify --nproc 2 --checkpointing
    one "$release" torchrun --nproc-per-node 2 -m diffusers_cudnn_fix verify --ring 2
    one "$release" python3 -m diffusers_cudnn_fix verify --nproc 2 --ring 2 --without-package
done
