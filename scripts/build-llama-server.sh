#!/usr/bin/env bash
# Builds (once per machine) llama.cpp's own llama-server from the very llama.cpp
# specray runs on: the one vendored in the llama-cpp-python sdist that
# scripts/build-llama-cpp.sh builds, with the same CPU flags and the same
# native/patches (scripts/cpu-flags.sh holds both, for both scripts). A
# benchmarking tool, to compare `specray serve` with llama-server on equal
# kernels; not part of install or tests.
#
# Usage: bash scripts/build-llama-server.sh [PYTHON]
#   PYTHON (default python3) only runs `pip download` for the sdist.
# Prints the binary's path on stdout (everything else goes to stderr), e.g.
#   LLAMA_SERVER=$(bash scripts/build-llama-server.sh)
#   "$LLAMA_SERVER" -m MODEL.gguf --port 8090 -np 4 -c 4096
# The binary (statically linked against llama.cpp, so it can be copied) is
# cached in $SPECRAY_LLAMA_SERVER_CACHE (default ~/.cache/specray/llama-server)
# keyed like the wheel: version + flags + patches. First build: ~10 minutes on
# 2 cores; CMAKE_BUILD_PARALLEL_LEVEL overrides the job count (default nproc).
set -euo pipefail

PY=${1:-python3}
HERE=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=cpu-flags.sh
source "$HERE/scripts/cpu-flags.sh"   # LLAMA_CPP_VERSION, GGML_CPU_ARGS, SPECRAY_PATCHES, GGML_GPU_ARGS
VERSION=$LLAMA_CPP_VERSION
CACHE=${SPECRAY_LLAMA_SERVER_CACHE:-$HOME/.cache/specray/llama-server}

# Only llama-server and what it links. No network at build time or at run time:
# no curl (-DLLAMA_CURL is deprecated and ignored in this llama.cpp, kept for
# older trees), no OpenSSL (HTTPS model downloads), no Web UI download from
# Hugging Face (the server then runs without its embedded UI; the API is whole).
CMAKE_ARGS="$GGML_CPU_ARGS${GGML_GPU_ARGS:+ $GGML_GPU_ARGS}"
CMAKE_ARGS+=" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF"
CMAKE_ARGS+=" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF"
CMAKE_ARGS+=" -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON"
CMAKE_ARGS+=" -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF"

key=$( (echo "$VERSION llama-server $CMAKE_ARGS"; cat "${SPECRAY_PATCHES[@]}") | sha256sum | cut -c1-16)
bin_dir="$CACHE/$key"

if [[ ! -x "$bin_dir/llama-server" ]]; then
    echo "specray: building llama-server from llama-cpp-python $VERSION's llama.cpp (one-off, ~10 min on 2 cores)" >&2
    echo "specray: CMAKE_ARGS=$CMAKE_ARGS" >&2
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    "$PY" -m pip download --quiet --no-deps --no-binary :all: \
        "llama-cpp-python==$VERSION" -d "$work" >&2
    tar -xzf "$work"/llama_cpp_python-"$VERSION".tar.gz -C "$work"
    src="$work/llama_cpp_python-$VERSION"
    # The patches name vendor/llama.cpp/... paths: -p1 from the sdist's root,
    # exactly as for the wheel; cmake then builds the vendored tree directly.
    for p in "${SPECRAY_PATCHES[@]}"; do patch -s -p1 -d "$src" < "$p"; done
    # shellcheck disable=SC2086  # CMAKE_ARGS is a list of words
    cmake -S "$src/vendor/llama.cpp" -B "$work/build" $CMAKE_ARGS >&2
    cmake --build "$work/build" --target llama-server \
        -j "${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" >&2
    mkdir -p "$bin_dir.tmp"
    cp "$work/build/bin/llama-server" "$bin_dir.tmp/"
    echo "$CMAKE_ARGS" > "$bin_dir.tmp/cmake-args.txt"
    rm -rf "$bin_dir" && mv "$bin_dir.tmp" "$bin_dir"
fi

echo "specray: llama-server from llama-cpp-python $VERSION's llama.cpp: $bin_dir/llama-server" >&2
echo "$bin_dir/llama-server"
