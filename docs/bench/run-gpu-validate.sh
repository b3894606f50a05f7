#!/usr/bin/env bash
# One device call that validates this tree on a GPU: the golden sets in fast mode with their worst |dp| printed
# (native and compute_70 PTX), then the whole GPU suite with cuBLAS, then the kernel and engine suites in a process
# that cannot load cuBLAS (tests/no_cublas: the lean image's GEMMs). Ends within 9 minutes.
# Prepare here, in the repository root (.whl/ is ignored by git; carry [".whl"]):
#   PYENV_VERSION=3.12.1 python -m pip wheel --no-deps -w .whl/new .      # the device's python3 is 3.12
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl/deps prometheus_client Brotli backports.zstd uvloop ml_dtypes Pillow
#   the compute_70 PTX of every kernel file into .whl/ptx70 (CLEFCORE_KERNEL_CACHE), made with the pip NVRTC 12:
#   CLEFCORE_KERNEL_CACHE=.whl/ptx70 python -c "from clefcore.backends.cuda import compile as C
#   [C.ptx70_path(p.name) for p in C.kernel_files()]"
# Run (device tool): CLEFCORE_KERNEL_CACHE=$PWD/.whl/ptx70 bash docs/bench/run-gpu-validate.sh
# T_GOLDEN, T_SUITE, T_LEAN: each step's limit in seconds (default 90, 250, 130); T_LEAN=skip leaves the lean step out.
# SUITE: the test files of the whole-suite step (default: tests, all of them), for a run that must fit less time.
# Writes to $OUT as it goes: device.txt, golden.txt, suite.txt, suite-no-cublas.txt.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-validate-out}
mkdir -p "$OUT"
ROOT=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$ROOT"/.whl/deps/*.whl \
  "$ROOT"/.whl/new/clefcore-*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv >"$OUT/device.txt" 2>&1
# `pytest`, not `python3 -m pytest`: the installed package, not the source tree (setup.cfg: --import-mode=importlib)
timeout "${T_GOLDEN:-90}" pytest -q -s -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_vision_gpu.py \
  -k "golden and probabilities" 2>&1 | grep -E "GOLDEN|passed|failed|Error" | tee "$OUT/golden.txt"
# shellcheck disable=SC2086  # SUITE is a list of paths
timeout "${T_SUITE:-250}" pytest -q -p no:cacheprovider -m gpu ${SUITE:-tests} 2>&1 | tee "$OUT/suite-full.txt" | tail -30 \
  | tee "$OUT/suite.txt"
if [ "${T_LEAN:-}" != skip ]; then
  PYTHONPATH=tests/no_cublas:$PYTHONPATH timeout "${T_LEAN:-130}" pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py \
    tests/test_gpu_engine.py 2>&1 | tail -20 | tee "$OUT/suite-no-cublas.txt"
fi
