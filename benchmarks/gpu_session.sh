#!/usr/bin/env bash
# One device-tool call's work on the GPU machine (its image has torch, wrapt, packaging and pytest, not
# diffusers): the wheels travel in .whl (carry: [".whl"]), results go to $OUT.
#
#   bash benchmarks/gpu_session.sh tests   # GPU tests, raw JSON per release, environment
#   bash benchmarks/gpu_session.sh import  # bench_import.py and hook_phases.py on that machine's CPU
#   bash benchmarks/gpu_session.sh references  # tests/test_references.py under that machine's Python
#   bash benchmarks/gpu_session.sh hook-ab  # the hook only, this package against .base, more runs
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# Every wheel but diffusers' (importlib_metadata, and zipp, which it imports).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $(ls .whl/*.whl | grep -v '/diffusers-') || exit 1
export PYTHONPATH=/tmp/site
export DIFFUSERS_WHEELS=$PWD/.whl  # tests/releases.py installs each release from there, offline
python3 tests/releases.py 0.36.0 0.39.0 0.40.0 0.42.1 >/dev/null || exit 1

case "${1:-tests}" in
tests)
    {
        nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
        python3 -c "import torch; print('torch', torch.__version__, 'cuDNN', torch.backends.cudnn.version())"
        python3 --version
    } >"$OUT/env.txt" 2>&1
    DIFFUSERS_CUDNN_FIX_RESULTS=$OUT python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider 2>&1 \
        | tee "$OUT/gpu-tests.log"
    ;;
import)
    # .base (carried, if there): an earlier version of the package, timed side by side as the baseline.
    python3 benchmarks/bench_import.py --runs 15 --out "$OUT/bench-import-h200-host.json" \
        $( [ -d .base/diffusers_cudnn_fix ] && echo --baseline .base ) 2>&1 \
        | tee "$OUT/bench-import-h200-host.log"
    python3 benchmarks/hook_phases.py --runs 9 2>&1 \
        | tee "$OUT/hook-phases-h200-host.log"
    ;;
hook-ab)
    python3 benchmarks/bench_import.py --runs 22 --hook-only --baseline .base \
        --out "$OUT/bench-hook-ab-h200-host.json" 2>&1 | tee "$OUT/bench-hook-ab-h200-host.log"
    ;;
references)
    # The reference check counts references with sys.getrefcount: run its tests under this Python too
    # (the releases carried here only).
    python3 -m pytest tests/test_references.py -q -p no:cacheprovider -k "0.36.0 or 0.39.0 or 0.40.0 or 0.42.1" 2>&1 \
        | tee "$OUT/references-h200-host.log"
    ;;
esac
