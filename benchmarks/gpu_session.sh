#!/usr/bin/env bash
# One device-tool call's work on the GPU machine (its image has torch, wrapt, packaging and pytest, not
# diffusers): the wheels travel in .whl (carry: [".whl"]), results go to $OUT.
#
#   bash benchmarks/gpu_session.sh tests   # GPU tests, raw JSON per release, environment
#   bash benchmarks/gpu_session.sh stacks  # the training-stack GPU tests only (raw gpu-stacks-*.json)
#   bash benchmarks/gpu_session.sh import  # bench_import.py on that machine's CPU
#   bash benchmarks/gpu_session.sh references  # tests/test_references.py under that machine's Python
#   bash benchmarks/gpu_session.sh notrace  # leave no trace on the GPU: generators and flags around the probe
#                                          # (tests/test_no_trace.py -m gpu; 0.39.0, 0.42.1), about 1 min
#   bash benchmarks/gpu_session.sh ringmask  # ring attention with masks on the real kernels (0.39.0, 0.42.1;
#                                          # tests/test_gpu_ring_masks.py), about 2 min
#   bash benchmarks/gpu_session.sh ulyssesmodels  # Ulysses at world size 1 on the real kernels: keys
#                                                 # of another length, a per-head mask, host syncs of a
#                                                 # masked layer stack (0.39.0, 0.42.1;
#                                                 # tests/test_gpu_ulysses_models.py), the kept
#                                                 # key-padding plan and its device-side check
#                                                 # (tests/test_key_padding_ulysses.py -m gpu), and
#                                                 # bench_mask_plan.py; about 4 min
#   bash benchmarks/gpu_session.sh keypad  # key-padding masks: bench_gpu.py --sections keypad on 0.39.0 and
#                                          # 0.42.1, and tests/test_gpu_key_padding.py (about 3 min)
#   bash benchmarks/gpu_session.sh verify   # `diffusers-cudnn-fix verify` on this GPU: tests/test_gpu_verify.py
#                                           # (raw JSON verify-*.json; docs/verify.md), about 5 min
#   bash benchmarks/gpu_session.sh trust    # the doctor on 0.39.0 and 0.42.1, launch matrix + GPU tests
#                                           # (tests/test_gpu.py, ring at degrees 2-4 on 0.36.0, 0.39.0,
#                                           # 0.40.0, 0.42.1 included; tests/test_gpu_compile.py), training
#                                           # stacks, random cases, mask/ops benchmark, the bare kernels'
#                                           # masked rows (each step under its own time limit; DCF_STEPS picks
#                                           # steps, default all six: "doctor tests stacks random bench
#                                           # dead_rows", for a device call's 10 minutes)
#   bash benchmarks/gpu_session.sh upstream  # the upstream patches (upstream/<fix_id>/) without the package, on
#                                           # 0.42.1 as shipped and patched: each reproducer (on the GPU where it
#                                           # has one) and each added test (its GPU parts included); about 2 min;
#                                           # upstream.log and one <fix>-<shipped|patched>.log per run in $OUT
#
# Each step runs under its own time limit and the next runs whatever it ended with; gpu-session.log gives each one's
# exit status. The session's own exit status is 1 when a step ended otherwise than expected (0, or what EXPECT says
# for it: the upstream mode expects 1 of a reproducer on the release as shipped), naming those steps last.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# Every wheel but diffusers' (importlib_metadata, and zipp, which it imports).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $(ls .whl/*.whl | grep -v '/diffusers-') || exit 1
export PYTHONPATH=/tmp/site
export DIFFUSERS_WHEELS=$PWD/.whl  # tests/releases.py installs each release from there, offline
RELEASES="0.36.0 0.39.0 0.40.0 0.42.1"
[ "${1:-}" = upstream ] && RELEASES=0.42.1  # the upstream mode needs (and carries the wheel of) 0.42.1 only
[ "${1:-}" = ringmask ] && RELEASES="0.39.0 0.42.1"  # as tests/test_gpu_ring_masks.py runs them
[ "${1:-}" = notrace ] && RELEASES="0.39.0 0.42.1"  # as tests/test_no_trace.py's GPU test runs them
[ "${1:-}" = ulyssesmodels ] && RELEASES="0.39.0 0.42.1"  # as tests/test_gpu_ulysses_models.py runs them
python3 tests/releases.py $RELEASES >/dev/null || exit 1

# Process groups started by the tests / the random-case runner, ended if a step's time limit stops its parent.
export DCF_PGID_FILE=/tmp/dcf-pgids
# The steps that ended otherwise than expected, one line each (steps run in pipelines and subshells: a file).
FAILED_STEPS=/tmp/dcf-failed-steps
: >"$FAILED_STEPS"
kill_leftovers() {
    [ -f "$DCF_PGID_FILE" ] || return 0
    while read -r pgid; do
        kill -0 -- "-$pgid" 2>/dev/null && kill -KILL -- "-$pgid" 2>/dev/null && echo "killed leftover group $pgid"
    done <"$DCF_PGID_FILE"
    : >"$DCF_PGID_FILE"
}
step() {  # [EXPECT=N|any] step NAME LIMIT_S COMMAND...: timed, logged in gpu-session.log; returns its exit status
    local name=$1 limit=$2 t0=$SECONDS rc expect=${EXPECT:-0}
    shift 2
    timeout -s INT -k 10 "$limit" "$@"
    rc=$?
    kill_leftovers >>"$OUT/gpu-session.log" 2>&1
    echo "$name: exit $rc after $((SECONDS - t0)) s (limit $limit s)" >>"$OUT/gpu-session.log"
    [ "$expect" = any ] || [ "$rc" = "$expect" ] || echo "$name: exit $rc, expected $expect" >>"$FAILED_STEPS"
    return "$rc"
}

case "${1:-tests}" in
trust)
    {
        date -u
        nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
        python3 -c "import torch; print('torch', torch.__version__, 'cuDNN', torch.backends.cudnn.version())"
        python3 --version
        git log -1 --format='HEAD %h %s' 2>/dev/null
        # Contents only, files in sorted order: compare with the same one-liner run in your checkout.
        python3 -c "import hashlib, pathlib; h = hashlib.sha256(); [h.update(p.read_bytes()) for p in sorted(pathlib.Path('diffusers_cudnn_fix').rglob('*.py'))]; print('package sources sha256', h.hexdigest())"
    } >"$OUT/gpu-session.log" 2>&1
    STEPS=" ${DCF_STEPS:-doctor tests stacks random bench dead_rows} "
    # The doctor on this GPU, as a user runs it (benchmarks/results/doctor-<version>.txt; docs/doctor.md's H200
    # table cites the 0.39.0 one). Its exit status is the file's last line.
    [[ $STEPS == *" doctor "* ]] && for version in 0.39.0 0.42.1; do
        step "doctor $version" "${DCF_DOCTOR_LIMIT:-120}" bash -c \
            'PYTHONPATH=$PWD/.cache/diffusers/$1:$PYTHONPATH python3 -m diffusers_cudnn_fix >"$2" 2>&1; rc=$?
             echo "rc=$rc" >>"$2"; exit $rc' _ "$version" "$OUT/doctor-$version.txt"
    done
    RES=/tmp/dcf-results
    mkdir -p "$RES"
    [[ $STEPS == *" tests "* ]] && step tests "${DCF_TESTS_LIMIT:-280}" env DIFFUSERS_CUDNN_FIX_RESULTS=$RES \
        python3 -m pytest ${DCF_TEST_FILES:-tests/test_gpu.py tests/test_gpu_compile.py tests/test_gpu_key_padding.py} \
        -q -p no:cacheprovider -rfE \
        -k "not training_stack" 2>&1 | tee "$OUT/gpu-tests.log"
    # Training stacks (QwenImage with padded prompts: eager, inductor, autocast, checkpointing), under a limit
    # of their own: inductor compiles the model per release (raw JSON gpu-stacks-<release>.json).
    [[ $STEPS == *" stacks "* ]] && step stacks "${DCF_STACKS_LIMIT:-420}" env DIFFUSERS_CUDNN_FIX_RESULTS=$RES \
        python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -rfExX -k training_stack 2>&1 \
        | tee "$OUT/gpu-stacks-tests.log"
    python3 - "$RES" "$OUT/gpu-tests.json" <<'PY'
import json, sys
from pathlib import Path
folder, out = Path(sys.argv[1]), Path(sys.argv[2])
out.write_text(json.dumps({p.name: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}, indent=1))
PY
    RC=/tmp/dcf-random
    mkdir -p "$RC"
    [[ $STEPS == *" random "* ]] && : >"$OUT/gpu-random-cases.log"
    [[ $STEPS == *" random "* ]] && for spec in ${DCF_RANDOM:-0.39.0:300:150 0.42.1:120:70 0.36.0:120:70}; do
        IFS=: read -r version count limit <<<"$spec"  # the runner stops starting cases 10 s before the limit
        step "random $version" "$limit" python3 benchmarks/gpu_random_cases.py --release "$version" --cases "$count" \
            --jobs 8 --chunk 25 --budget $((limit - 10)) --out "$RC/random-$version.json" 2>&1 \
            | tee -a "$OUT/gpu-random-cases.log"
    done
    python3 - "$RC" "$OUT/gpu-random-cases.json" <<'PY'
import json, sys
from pathlib import Path
folder, out = Path(sys.argv[1]), Path(sys.argv[2])
out.write_text(json.dumps({p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}, indent=1))
PY
    [[ $STEPS == *" bench "* ]] && step bench "${DCF_BENCH_LIMIT:-60}" python3 benchmarks/bench_gpu.py --out "$OUT/bench-gpu.json" 2>&1 \
        | tee "$OUT/bench-gpu.log"
    # The bare cuDNN kernels with fully masked rows and few key positions (what cudnn_masked_row_grads is for).
    [[ $STEPS == *" dead_rows "* ]] && step "dead rows" "${DCF_DEAD_ROWS_LIMIT:-90}" python3 benchmarks/probe_dead_rows.py \
        --budget $(( ${DCF_DEAD_ROWS_LIMIT:-90} - 15 )) --out "$OUT/probe-dead-rows.json" 2>&1 \
        | tee "$OUT/probe-dead-rows.log"
    date -u >>"$OUT/gpu-session.log"
    ;;
stacks)
    # The training-stack GPU tests alone (also a step of trust), for a device call of their own.
    RES=/tmp/dcf-results
    mkdir -p "$RES"
    python3 -c "import torch; print('torch', torch.__version__, 'cuDNN', torch.backends.cudnn.version())" \
        >"$OUT/gpu-session.log" 2>&1
    step stacks "${DCF_STACKS_LIMIT:-420}" env DIFFUSERS_CUDNN_FIX_RESULTS=$RES \
        python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -rfExX -k training_stack 2>&1 \
        | tee "$OUT/gpu-stacks-tests.log"
    cp "$RES"/gpu-stacks-*.json "$OUT"/ 2>/dev/null
    ;;
tests)
    {
        nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
        python3 -c "import torch; print('torch', torch.__version__, 'cuDNN', torch.backends.cudnn.version())"
        python3 --version
    } >"$OUT/env.txt" 2>&1
    step tests "${DCF_TESTS_LIMIT:-540}" env DIFFUSERS_CUDNN_FIX_RESULTS=$OUT \
        python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log"
    ;;
import)
    step import "${DCF_IMPORT_LIMIT:-540}" python3 benchmarks/bench_import.py --runs 15 \
        --out "$OUT/bench-import-gpu-host.json" 2>&1 | tee "$OUT/bench-import-gpu-host.log"
    ;;
notrace)
    # Leave no trace (#49) on the GPU: CUDA initialised and seeded before the import; the checks, the probe on the GPU
    # and the doctor leave every CUDA generator, the CPU's and torch's flags as they were, with the package imported
    # first and without it (raw JSON gpu-no-trace-<release>.json); about 1 min.
    python3 -c "import torch; print('torch', torch.__version__, 'cuDNN', torch.backends.cudnn.version())" \
        >"$OUT/gpu-session.log" 2>&1
    step "no trace" "${DCF_TESTS_LIMIT:-240}" env DIFFUSERS_CUDNN_FIX_RESULTS=$OUT \
        python3 -m pytest tests/test_no_trace.py -m gpu -q -p no:cacheprovider -rfEs 2>&1 \
        | tee "$OUT/gpu-no-trace-tests.log"
    ;;
ringmask)
    # Ring attention with masks on the real kernels (a thread per ring rank, degrees 2 - 4): every mask kind and
    # layout through the package's ring, the flash refusal and diffusers' own ring as the control (raw JSON
    # gpu-ring-masks-<release>.json), about 2 min.
    python3 -c "import torch; print('torch', torch.__version__, 'cuDNN', torch.backends.cudnn.version())" \
        >"$OUT/gpu-session.log" 2>&1
    step "ring masks" "${DCF_TESTS_LIMIT:-240}" env DIFFUSERS_CUDNN_FIX_RESULTS=$OUT \
        python3 -m pytest tests/test_gpu_ring_masks.py -q -p no:cacheprovider -rfEs 2>&1 \
        | tee "$OUT/gpu-ring-masks-tests.log"
    ;;
ulyssesmodels)
    # diffusers' Ulysses attention in a one-process NCCL group (issue #42): keys shorter than the queries on the cuDNN
    # and flash ops, a per-head mask on cuDNN, and diffusers' shipped backward as the control (raw JSON
    # gpu-ulysses-models-<release>.json).
    python3 -c "import torch; print('torch', torch.__version__, 'cuDNN', torch.backends.cudnn.version())" \
        >"$OUT/gpu-session.log" 2>&1
    step "ulysses models" "${DCF_TESTS_LIMIT:-240}" env DIFFUSERS_CUDNN_FIX_RESULTS=$OUT \
        python3 -m pytest tests/test_gpu_ulysses_models.py -q -p no:cacheprovider -rfEs 2>&1 \
        | tee "$OUT/gpu-ulysses-models-tests.log"
    # Issue #40, item 3 on the real kernels: one plan per rank over a layer stack, and a mask changed on one rank
    # between layers stopping the run with a device-side assert (raw JSON gpu-key-padding-ulysses-*.json).
    step "kept plan" "${DCF_TESTS_LIMIT:-240}" env DIFFUSERS_CUDNN_FIX_RESULTS=$OUT \
        python3 -m pytest tests/test_key_padding_ulysses.py -m gpu -q -p no:cacheprovider -rfEs 2>&1 \
        | tee "$OUT/gpu-key-padding-ulysses-tests.log"
    # Issue #40, item 3: the key-padding plan once per step, timed against once per layer (a 24-layer stack).
    step "mask plan bench" "${DCF_BENCH_LIMIT:-150}" python3 benchmarks/bench_mask_plan.py \
        --out "$OUT/bench-mask-plan.json" 2>&1 | tee "$OUT/bench-mask-plan.log"
    ;;
keypad)
    # Key-padding masks run on the valid keys alone: timings side by side (0.39.0: the package's corrected op
    # pair; 0.42.1: diffusers' own ops behind the package's wrappers) and the exactness tests on real cuDNN.
    python3 -c "import torch; print('torch', torch.__version__, 'cuDNN', torch.backends.cudnn.version())" \
        >"$OUT/gpu-session.log" 2>&1
    for version in 0.39.0 0.42.1; do
        step "keypad bench $version" "${DCF_BENCH_LIMIT:-90}" python3 benchmarks/bench_gpu.py --sections keypad \
            --release "$version" --out "$OUT/bench-keypad-$version.json" 2>&1 | tee -a "$OUT/bench-keypad.log"
    done
    step "keypad tests" "${DCF_TESTS_LIMIT:-300}" env DIFFUSERS_CUDNN_FIX_RESULTS=$OUT \
        python3 -m pytest tests/test_gpu_key_padding.py -q -p no:cacheprovider -rfE 2>&1 \
        | tee "$OUT/gpu-key-padding-tests.log"
    ;;
verify)
    # diffusers-cudnn-fix verify on the real kernels: two ranks sharing this GPU over gloo, eager and compiled.
    python3 -c "import torch; print('torch', torch.__version__, 'cuDNN', torch.backends.cudnn.version())" \
        >"$OUT/gpu-session.log" 2>&1
    step verify "${DCF_VERIFY_LIMIT:-480}" env DIFFUSERS_CUDNN_FIX_RESULTS=$OUT \
        python3 -m pytest tests/test_gpu_verify.py -q -p no:cacheprovider -rfEs 2>&1 | tee "$OUT/gpu-verify-tests.log"
    ;;
upstream)
    # .ci/upstream's checks on the GPU, one reproducer or test per process (a misaligned flash call ends the
    # process's CUDA context): exit status 1 expected as shipped, 0 patched; cudnn_masked_row_grads' reproducer is
    # the kernel's own (PyTorch only: exit 1 wherever the fault is, patched or not), its --through-diffusers run and
    # its test are diffusers' workaround.
    python3 -c "import torch; print('torch', torch.__version__, 'cuDNN', torch.backends.cudnn.version())" \
        >"$OUT/upstream.log" 2>&1
    SHIPPED=$PWD/.cache/diffusers/0.42.1
    printf '[pytest]\naddopts = -p no:cacheprovider -rs\n' >/tmp/upstream-pytest.ini
    # One background job per fix (each writes its own logs and copy): the fixes run side by side.
    for fix in cudnn_bool_mask flash_input_alignment cudnn_input_dtypes cudnn_masked_row_grads ring_grad_route \
        ulysses_mask_grad; do (
        site=/tmp/upstream-site-$fix
        rm -rf "$site" && mkdir -p "$site" && cp -r "$SHIPPED/diffusers" "$site/"
        if command -v patch >/dev/null; then patch -s -d "$site" -p1 <"upstream/$fix/fix.patch"; else
            (cd "$site" && git apply -p1 "$PWD/upstream/$fix/fix.patch"); fi >>"$OUT/upstream.log" 2>&1 \
            || echo "upstream $fix: the patch does not apply" >>"$OUT/upstream.log"
        args=()
        case $fix in cudnn_bool_mask | flash_input_alignment | cudnn_input_dtypes) args=(--device cuda) ;;
            cudnn_masked_row_grads) args=(--through-diffusers) ;; esac
        for which in shipped patched; do
            path=$SHIPPED
            [ "$which" = patched ] && path=$site
            log=$OUT/$fix-$which.log
            expect=0
            [ "$which" = shipped ] && expect=1  # the bug is there as shipped
            EXPECT=$expect step "upstream $fix $which: reproduce.py ${args[*]}" 120 env DIFFUSERS_CUDNN_FIX=0 \
                PYTHONPATH="$path:$PYTHONPATH" python3 "upstream/$fix/reproduce.py" "${args[@]}" >"$log" 2>&1
            EXPECT=$expect step "upstream $fix $which: test_$fix.py" 180 env DIFFUSERS_CUDNN_FIX=0 \
                PYTHONPATH="$path:$PYTHONPATH" python3 -m pytest -q -c /tmp/upstream-pytest.ini --rootdir /tmp \
                "upstream/$fix/test_$fix.py" >>"$log" 2>&1
        done
    ) & done
    # The kernel's own fault, patched or not: whether it shows depends on the card and cuDNN, so no expectation.
    EXPECT=any step "upstream cudnn_masked_row_grads: kernel reproducer (PyTorch only)" 120 \
        python3 upstream/cudnn_masked_row_grads/reproduce.py >"$OUT/cudnn_masked_row_grads-kernel.log" 2>&1
    wait
    grep '^upstream' "$OUT/gpu-session.log" | sort -s -k2,2 >>"$OUT/upstream.log"
    cat "$OUT/upstream.log"
    ;;
references)
    # The reference check counts references with sys.getrefcount: run its tests under this Python too
    # (the releases carried here only).
    step references "${DCF_TESTS_LIMIT:-540}" python3 -m pytest tests/test_references.py -q -p no:cacheprovider \
        -k "0.36.0 or 0.39.0 or 0.40.0 or 0.42.1" 2>&1 | tee "$OUT/references-gpu-host.log"
    ;;
*)
    echo "gpu_session.sh: unknown mode '$1' (the modes are listed at the top of this file)" >&2
    exit 64
    ;;
esac
if [ -s "$FAILED_STEPS" ]; then
    { echo "steps that ended otherwise than expected:"; cat "$FAILED_STEPS"; } | tee -a "$OUT/gpu-session.log" >&2
    exit 1
fi
