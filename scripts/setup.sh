#!/usr/bin/env bash
# Installs specray into ./.venv from nothing: a venv, specray's llama-cpp-python
# build (scripts/build-llama-cpp.sh, cached per machine), then the project.
#   bash scripts/setup.sh         # runtime
#   bash scripts/setup.sh --dev   # + test dependencies and the `specray train-head` extra (torch)
# llama.cpp is built with CUDA where nvcc and a GPU are found (scripts/gpu-flags.sh); --cuda insists on it (and
# fails, saying why, without them), --cpu builds for the CPU only. Either goes with --dev.
#   bash scripts/setup.sh --wheelhouse DIR [--dev]   # offline: every package from DIR (scripts/wheelhouse.sh
#                                                    # wrote it), llama.cpp built from the sdist there
set -euo pipefail
caller_dir=$PWD
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
extra=""
wheelhouse=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dev) extra="[dev,train]" ;;
        --cuda) export SPECRAY_CUDA=on ;;
        --cpu) export SPECRAY_CUDA=off ;;
        --wheelhouse)
            [[ $# -ge 2 && -n "$2" && "$2" != --* ]] || { echo "setup.sh: --wheelhouse needs a DIR" >&2; exit 2; }
            wheelhouse=$2; [[ "$wheelhouse" == /* ]] || wheelhouse="$caller_dir/$wheelhouse"; shift ;;
        -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
        *) echo "setup.sh: unknown option '$1' (--dev, --cuda, --cpu, --wheelhouse DIR)" >&2; exit 2 ;;
    esac
    shift
done
if [[ -n "$wheelhouse" ]]; then
    # shellcheck source=wheelhouse-env.sh
    source scripts/wheelhouse-env.sh  # checks DIR, exports PIP_NO_INDEX / PIP_FIND_LINKS; may narrow $extra
fi

if [[ ! -x .venv/bin/python ]]; then
    "$PYTHON" -m venv .venv
fi
if [[ -n "$wheelhouse" ]]; then
    wheelhouse_preflight .venv/bin/python
else
    .venv/bin/python -m pip install --quiet --upgrade pip
fi
# llama-cpp-python's runtime deps (its wheel is installed with --no-deps)
.venv/bin/python -m pip install --quiet numpy typing-extensions diskcache jinja2
bash scripts/build-llama-cpp.sh .venv/bin/python
if [[ -n "$extra" && -z "$wheelhouse" && "${SPECRAY_CUDA:-auto}" != on ]] && ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; }; then
    # no GPU: the train extra's torch pinned to the CPU build this machine kind has (an open range would fetch
    # the newest torch, a multi-GB CUDA build); with a GPU the extra's range picks pip's default (CUDA) build
    .venv/bin/python -m pip install --quiet torch==2.13.0
fi
.venv/bin/python -m pip install --quiet -e ".$extra"
.venv/bin/python -c "import specray.engine, specray.native.lib as l; from specray.engine.cores import cores_in_use; ok, why = l.exact_mode_available(); off = [k for k, v in cores_in_use().items() if not v]; print('specray installed; exact mode:', 'available' if ok else why, end='; '); print('compiled cores:', 'built' if not off else 'not built for ' + ', '.join(off) + ' (their Python references run)')"
