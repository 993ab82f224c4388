#!/usr/bin/env bash
# Installs specray into ./.venv from nothing: a venv, specray's llama-cpp-python
# build (scripts/build-llama-cpp.sh, cached per machine), then the project.
#   bash scripts/setup.sh         # runtime
#   bash scripts/setup.sh --dev   # + test dependencies and the `specray train-head` extra (torch)
# llama.cpp is built with CUDA where nvcc and a GPU are found (scripts/gpu-flags.sh); --cuda insists on it (and
# fails, saying why, without them), --cpu builds for the CPU only. Either goes with --dev.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
extra=""
for arg in "$@"; do
    case "$arg" in
        --dev) extra="[dev,train]" ;;
        --cuda) export SPECRAY_CUDA=on ;;
        --cpu) export SPECRAY_CUDA=off ;;
        -h|--help) sed -n '2,7p' "$0"; exit 0 ;;
        *) echo "setup.sh: unknown option '$arg' (--dev, --cuda, --cpu)" >&2; exit 2 ;;
    esac
done

if [[ ! -x .venv/bin/python ]]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# llama-cpp-python's runtime deps (its wheel is installed with --no-deps)
.venv/bin/python -m pip install --quiet numpy typing-extensions diskcache jinja2
bash scripts/build-llama-cpp.sh .venv/bin/python
if [[ -n "$extra" && "${SPECRAY_CUDA:-auto}" != on ]] && ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; }; then
    # no GPU: the train extra's torch pinned to the CPU build this machine kind has (an open range would fetch
    # the newest torch, a multi-GB CUDA build); with a GPU the extra's range picks pip's default (CUDA) build
    .venv/bin/python -m pip install --quiet torch==2.13.0
fi
.venv/bin/python -m pip install --quiet -e ".$extra"
.venv/bin/python -c "import specray.engine, specray.native.lib as l; ok, why = l.exact_mode_available(); print('specray installed; exact mode:', 'available' if ok else why)"
