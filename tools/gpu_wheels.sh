#!/usr/bin/env bash
# Fetch the wheels tools/gpu_check.sh installs offline on the lent GPU machine (python 3.12,
# no network): pytest and what it imports. Run here, with network, before the device run:
#   bash tools/gpu_wheels.sh && then pass .whl in the device tool's carry list (it is ignored by git).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
    "pytest>=8" "pluggy>=1.6" "iniconfig>=2" "packaging>=24" "pygments>=2.15"
ls -la .whl
