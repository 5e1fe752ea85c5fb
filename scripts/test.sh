#!/usr/bin/env bash
# The test command: set up (scripts/setup.sh), then the whole suite on the CPU (CUDA tests skip without a GPU;
# Triton kernels run in interpreter mode), then the transformers-facing tests again on transformers 5.17.0
# (the version on the GPU machine) from a side folder that shadows the pinned 5.24. Extra args go to pytest
# (e.g. `-m simt`: only the CUDA kernels' source in the SIMT emulator; `-m "not simt"`: everything else).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
# The SIMT emulator (arkernels/simt.py): the CUDA kernels' own source compiled by g++ and run on the CPU, so every
# CUDA-kernel test case also runs here as its "simt" variant. Built whenever the CUDA toolkit's headers are present
# (always in CI); then those cases must run (ARKERNELS_SIMT_REQUIRED=1), never skip.
if "$PY" -c "import sys, arkernels.simt as s; sys.exit(0 if s._cuda_include() else 1)"; then
  "$PY" -m arkernels.simt build >/dev/null
  export ARKERNELS_SIMT_REQUIRED=1
else
  echo "[test] no CUDA toolkit headers: the SIMT emulator cases (-m simt) will skip"
fi
"$PY" -m pytest -q -p no:cacheprovider "$@" tests
hf_tests=$(ls tests/test_hf_*.py tests/test_generate.py tests/test_fuse.py 2>/dev/null || true)
if [ -n "$hf_tests" ] && [ $# -eq 0 ]; then
  if [ ! -d .tf517/transformers ]; then
    echo "[test] installing transformers 5.17.0 into .tf517 (once; the second pass of the transformers-facing tests)"
    # 5.17 needs huggingface-hub 1.x (and its httpx), where 5.24 has 2.x: they go into the side folder too
    "$PY" -m pip install -q --disable-pip-version-check --no-deps --target .tf517 transformers==5.17.0 \
      "huggingface-hub>=1.5,<2"
    "$PY" -m pip install -q --disable-pip-version-check --target .tf517 httpx
  fi
  echo "[test] transformers-facing tests on transformers $(PYTHONPATH=.tf517 "$PY" -c 'import transformers; print(transformers.__version__)')"
  PYTHONPATH=.tf517 "$PY" -m pytest -q -p no:cacheprovider $hf_tests
fi
