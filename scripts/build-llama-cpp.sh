#!/usr/bin/env bash
# Builds (once per machine) and installs specray's llama-cpp-python wheel into
# the Python given as $1 (default: python3).
#
# Why a custom build rather than `pip install llama-cpp-python`:
#  - the default build is -march=native; on Xeons with AMX it segfaults in
#    ggml_backend_amx_mul_mat at the first decode. We build with GGML_NATIVE=OFF
#    and enable exactly the x86 features /proc/cpuinfo reports, AMX excluded.
#  - native/patches/ (applied in name order) adds a run-time switch for
#    llamafile's sgemm, so one build serves both the fast path and the
#    batch-invariant exact mode, and a one-weight-row-by-many-columns Q8_0/Q4_1
#    kernel that makes a few-token speculative verify cheaper (bitwise the same
#    results; SPECRAY_GGML_COLS=0 turns it off), and makes EAGLE-3 and MTP head
#    batches output the rows of the pairs that asked (a subset got the first
#    pairs' rows: native/hidden.py, PairHead).
# The built wheel is cached in $SPECRAY_WHEEL_CACHE (default
# ~/.cache/specray/wheels) keyed by version + flags + patches, so only the first
# install on a machine pays the ~7-10 minute compile. With CUDA (scripts/gpu-flags.sh: detected, or
# SPECRAY_CUDA=on from `setup.sh --cuda`) the flags, and so the key, carry the backend and the GPU architecture.
# Offline ($SPECRAY_WHEELHOUSE, set by `setup.sh --wheelhouse DIR` with PIP_NO_INDEX): the sdist and the
# build's own requirements (scikit-build-core, cmake, ninja) come from that folder.
set -euo pipefail

PY=${1:-python3}
HERE=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=cpu-flags.sh
source "$HERE/scripts/cpu-flags.sh"   # LLAMA_CPP_VERSION, GGML_CPU_ARGS, SPECRAY_PATCHES, GGML_GPU_ARGS
VERSION=$LLAMA_CPP_VERSION
PATCHES=("${SPECRAY_PATCHES[@]}")
CACHE=${SPECRAY_WHEEL_CACHE:-$HOME/.cache/specray/wheels}

CMAKE_ARGS="$GGML_CPU_ARGS${GGML_GPU_ARGS:+ $GGML_GPU_ARGS}"
CMAKE_ARGS+=" -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"

# The key hashes the exact same text as before cpu-flags.sh was split out, so
# machines (and CI) with a cached wheel keep it.
key=$( (echo "$VERSION $CMAKE_ARGS"; cat "${PATCHES[@]}") | sha256sum | cut -c1-16)
wheel_dir="$CACHE/$key"

if ! ls "$wheel_dir"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    if [[ $GGML_BACKEND == cuda ]]; then
        echo "specray: building llama-cpp-python $VERSION with CUDA (one-off, ~6 min on 16 cores, far longer on 2)" >&2
    else
        echo "specray: building llama-cpp-python $VERSION (one-off, ~7-10 min on 2 cores)" >&2
    fi
    echo "specray: CMAKE_ARGS=$CMAKE_ARGS" >&2
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    if [[ -n "${SPECRAY_WHEELHOUSE:-}" ]]; then  # setup.sh --wheelhouse DIR: offline, the sdist from DIR
        sdist="$SPECRAY_WHEELHOUSE/llama_cpp_python-$VERSION.tar.gz"
        [[ -f "$sdist" ]] || { echo "specray: the wheelhouse $SPECRAY_WHEELHOUSE has no $(basename "$sdist")" \
            "(scripts/wheelhouse.sh downloads it)" >&2; exit 2; }
        cp "$sdist" "$work/"
    else
        "$PY" -m pip download --quiet --no-deps --no-binary :all: \
            "llama-cpp-python==$VERSION" -d "$work"
    fi
    tar -xzf "$work"/llama_cpp_python-"$VERSION".tar.gz -C "$work"
    src="$work/llama_cpp_python-$VERSION"
    for p in "${PATCHES[@]}"; do patch -s -p1 -d "$src" < "$p"; done
    mkdir -p "$wheel_dir.tmp"
    CMAKE_ARGS="$CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
        "$PY" -m pip wheel --no-deps --no-cache-dir -w "$wheel_dir.tmp" "$src" >&2
    rm -rf "$wheel_dir" && mv "$wheel_dir.tmp" "$wheel_dir"
fi

"$PY" -m pip install --quiet --no-deps --force-reinstall "$wheel_dir"/llama_cpp_python-*.whl
# A wheel cannot hold symlinks, so llama_cpp/lib has libggml.so, libggml.so.0 and libggml.so.0.25.3 as three
# files. The libraries' DT_NEEDED name the .so.0 (SONAME) files, llama_cpp loads libllama.so and
# llama_cpp._ggml libggml.so by path: two files, two copies of ggml's state in one process. Make every other
# name a symlink to the SONAME file, so each library is one file (native/shared_libs.py checks it at import).
lib_dir=$("$PY" -c 'import importlib.util, os; print(os.path.join(importlib.util.find_spec("llama_cpp").submodule_search_locations[0], "lib"))')
for so in "$lib_dir"/lib*.so.[0-9]*; do
    [[ "$so" =~ \.so\.[0-9]+$ && -f "$so" && ! -L "$so" ]] || continue
    for other in "${so%.so.*}.so" "$so".*; do
        if [[ -f "$other" && ! -L "$other" ]] && cmp -s "$so" "$other"; then
            ln -sf "$(basename "$so")" "$other"
        fi
    done
done
echo "specray: llama-cpp-python $VERSION ($GGML_BACKEND) installed from $wheel_dir" >&2
