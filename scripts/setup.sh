#!/usr/bin/env bash
# Installs specray into ./.venv from nothing: a venv, specray's llama-cpp-python
# build (scripts/build-llama-cpp.sh, cached per machine), then the project.
#   bash scripts/setup.sh         # runtime
#   bash scripts/setup.sh --dev   # + test dependencies
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
extra=""
[[ "${1:-}" == "--dev" ]] && extra="[dev]"

if [[ ! -x .venv/bin/python ]]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# llama-cpp-python's runtime deps (its wheel is installed with --no-deps)
.venv/bin/python -m pip install --quiet numpy typing-extensions diskcache jinja2
bash scripts/build-llama-cpp.sh .venv/bin/python
.venv/bin/python -m pip install --quiet -e ".$extra"
.venv/bin/python -c "import specray.engine, specray.native.lib as l; ok, why = l.exact_mode_available(); print('specray installed; exact mode:', 'available' if ok else why)"
