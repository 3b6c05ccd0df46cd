#!/usr/bin/env bash
# The one prepared GPU check (issue 5): environment, the GPU tests, the benchmark, a summary.
#
# Run from the repository root on a machine with a GPU, CuPy and cuDNN 9 installed and no
# network:   bash tools/gpu_check.sh        (about 7 minutes; GPU_CHECK_SECONDS caps it, default 560)
#
# Uses `python` on PATH (else python3; $PYTHON overrides) with PYTHONPATH=. (no install step).
# Where sncaffe's own dependencies are missing there (lmdb, a new enough protobuf), wheels
# carried in ./.whl are installed offline into a temporary folder first. Golden and zoo tests need the shared data: ../shared,
# ./shared or $SNCAFFE_SHARED. Every stage prints a header and its result; a failing stage does
# not stop the next. Exit status: 0 when every stage passed.
set -u
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-8}
PY=${PYTHON:-$(command -v python || command -v python3)}
DEADLINE=$(( $(date +%s) + ${GPU_CHECK_SECONDS:-560} ))
RESULTS=()
FAILED=0

# stage NAME MAX_SECONDS COMMAND...: run with a timeout (capped by what is left), record the result
stage() {
    local name=$1 max=$2 left rc start
    shift 2
    left=$(( DEADLINE - $(date +%s) - 5 ))
    echo
    echo "=================== $name ==================="
    if (( left < 20 )); then
        echo "skipped: the check's time is used up"
        RESULTS+=("$(printf '%-28s %s' "$name" "SKIPPED (no time left)")")
        FAILED=1
        return
    fi
    (( max > left )) && max=$left
    start=$(date +%s)
    timeout --kill-after=10 "$max" "$@"
    rc=$?
    local took=$(( $(date +%s) - start ))
    if (( rc == 0 )); then
        RESULTS+=("$(printf '%-28s %s' "$name" "ok (${took} s)")")
    else
        (( rc == 124 || rc == 137 )) && why="TIMED OUT after ${max} s" || why="FAILED (exit $rc, ${took} s)"
        RESULTS+=("$(printf '%-28s %s' "$name" "$why")")
        FAILED=1
    fi
    echo "--- $name: ${RESULTS[-1]#"$name"}"
}

if [[ -d .whl ]] && ls .whl/*.whl >/dev/null 2>&1; then
    echo "installing the carried wheels offline: $(ls .whl)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/sncaffe-site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/sncaffe-site"
fi
if [[ -z "${SNCAFFE_SHARED:-}" && -d shared/golden ]]; then
    export SNCAFFE_SHARED=$PWD/shared
fi

ENVIRONMENT='
import platform, sys
print("python", sys.version.split()[0], platform.machine())
import numpy; print("numpy", numpy.__version__)
import cupy
props = cupy.cuda.runtime.getDeviceProperties(0)
print("cupy", cupy.__version__, "| CUDA runtime", cupy.cuda.runtime.runtimeGetVersion(), "| driver",
      cupy.cuda.runtime.driverGetVersion(), "|", props["name"], "cc %d.%d" % (props["major"], props["minor"]))
from sncaffe.backend import cudnn
print("cuDNN", ".".join(map(str, cudnn.version())), "at", cudnn.library_path())
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
except ImportError:
    print("torch: not installed (the benchmark runs sncaffe only)")
import google.protobuf; print("protobuf", google.protobuf.__version__)
import sncaffe; print("sncaffe", sncaffe.__version__, "imports")
from sncaffe.backend.cuda import CUDADevice
d = CUDADevice("256MiB", host_capacity="64MiB")
print(d, "| streams", [d.stream(n).ptr for n in ("compute", "d2h", "h2d")])
d.close()
'
PYTEST=("$PY" -m pytest -x -q -rs -p no:cacheprovider)
if "$PY" -c "import pytest_timeout" 2>/dev/null; then PYTEST+=(--timeout=240); fi
PARITY=tests/backend/test_gpu_parity.py

stage "nvidia-smi" 30 nvidia-smi
stage "environment" 60 "$PY" -c "$ENVIRONMENT"
stage "cuDNN and the cuda device" 120 "${PYTEST[@]}" tests/backend/test_cudnn.py tests/backend/test_cuda_device.py
stage "layer parity" 150 "${PYTEST[@]}" "$PARITY" -k "not golden and not zoo and not memory and not out_of_memory"
stage "golden cases on cuda" 90 "${PYTEST[@]}" "$PARITY" -k "golden"
stage "benchmark" 300 "$PY" tools/bench_gpu.py
stage "memory runtime on cuda" 150 "${PYTEST[@]}" "$PARITY" -k "memory or out_of_memory"
stage "zoo nets, cuda vs cpu" 150 "${PYTEST[@]}" "$PARITY" -k "zoo"

echo
echo "=================== summary ==================="
printf '%s\n' "${RESULTS[@]}"
if [[ -z "${SNCAFFE_SHARED:-}" && ! -d ../shared/golden ]]; then
    echo "note: no shared data (../shared, ./shared or \$SNCAFFE_SHARED): golden and zoo tests were skipped"
fi
exit $FAILED
