#!/usr/bin/env bash
# The one prepared GPU check: environment, the static kernel/binding checks,
# the GPU tests, the golden cases, memory modes on ResNet-50, the benchmark, a summary.
#
# Run from the repository root on a machine with a GPU, CuPy (14, CUDA 13) and cuDNN 9 and no
# network:   bash tools/gpu_check.sh        (at most 6 minutes: GPU_CHECK_SECONDS, default 355)
#
# The report goes to $OUT/gpu_check.log (and the summary to $OUT/gpu_check_summary.txt) where
# $OUT is set (the device tool's output folder), else to stdout only.
# Uses python3 on PATH ($PYTHON overrides) with PYTHONPATH=. (no install step); `import sncaffe`
# needs numpy, protobuf >= 4.21 and sortedcontainers only. Where something the tests need is
# missing there (pytest and its pluggy/iniconfig/packaging/pygments), wheels carried in ./.whl
# (tools/gpu_wheels.sh fetches them; .whl is git-ignored: name it in the device tool's carry)
# are installed offline into a temporary folder first.
# Golden tests read tests/data/shared ($SNCAFFE_SHARED names another copy). Every stage
# prints a header and its result; a failing stage does not stop the next. Exit status: 0 when
# every stage passed.
set -u
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-8}
PY=${PYTHON:-$(command -v python3 || command -v python)}
DEADLINE=$(( $(date +%s) + ${GPU_CHECK_SECONDS:-355} ))
if [[ -n "${OUT:-}" ]]; then
    mkdir -p "$OUT"
    exec > >(tee "$OUT/gpu_check.log") 2>&1
fi
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
    echo "installing the carried wheels offline: $(ls .whl | tr '\n' ' ')"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/sncaffe-site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/sncaffe-site"
fi

ENVIRONMENT='
import platform, sys
print("python", sys.version.split()[0], platform.machine())
import numpy; print("numpy", numpy.__version__)
import cupy
props = cupy.cuda.runtime.getDeviceProperties(0)
name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
print("cupy", cupy.__version__, "| CUDA runtime", cupy.cuda.runtime.runtimeGetVersion(), "| driver",
      cupy.cuda.runtime.driverGetVersion(), "|", name, "cc %d.%d" % (props["major"], props["minor"]))
from sncaffe.backend import cudnn
print("cuDNN", ".".join(map(str, cudnn.version())), "at", cudnn.library_path())
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
except ImportError:
    print("torch: not installed (the benchmark runs sncaffe only)")
import google.protobuf; print("protobuf", google.protobuf.__version__)
import sncaffe; print("sncaffe", sncaffe.__version__, "imports")
from sncaffe.backend.cuda import CUDADevice, unusable_reason
print("cuda device:", unusable_reason() or "usable (a probe kernel compiled and ran)")
d = CUDADevice("256MiB", host_capacity="64MiB")
print(d, "| streams", [d.stream(n).ptr for n in ("compute", "d2h", "h2d")])
d.close()
'
PYTEST=("$PY" -m pytest --maxfail=10 -q -rs -p no:cacheprovider)
if "$PY" -c "import pytest_timeout" 2>/dev/null; then PYTEST+=(--timeout=240); fi
PARITY=tests/backend/test_gpu_parity.py

# seconds per stage: 10 + 25 + 30 + 30 + 60 + 30 + 50 + 120 = 355 at most
stage "nvidia-smi" 10 nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
stage "environment" 25 "$PY" -c "$ENVIRONMENT"
stage "NVRTC kernels, cuDNN headers" 30 "${PYTEST[@]}" tests/backend/test_nvrtc.py tests/backend/test_cudnn_headers.py
stage "cuDNN and the cuda device" 30 "${PYTEST[@]}" tests/backend/test_cudnn.py tests/backend/test_cuda_device.py \
    tests/backend/test_device_order.py
stage "layer parity" 60 "${PYTEST[@]}" "$PARITY" -k "cuda and not golden and not zoo and not memory"
stage "golden cases on cuda" 30 "${PYTEST[@]}" "$PARITY" -k "cuda and golden"
stage "memory modes, ResNet-50" 50 "${PYTEST[@]}" "$PARITY" -k "cuda and (memory_modes and resnet50 or out_of_memory)"
# ResNet-50 batch 64 against PyTorch eager (fp32), overlap from the trace, ResNet-2500 in 12 GiB
stage "benchmark" 120 "$PY" tools/bench_gpu.py --stages resnet50,trace,resnet2500 --fp32-only --iterations 5

echo
echo "=================== summary ==================="
printf '%s\n' "${RESULTS[@]}"
[[ -n "${OUT:-}" ]] && printf '%s\n' "${RESULTS[@]}" > "$OUT/gpu_check_summary.txt"
exit $FAILED
