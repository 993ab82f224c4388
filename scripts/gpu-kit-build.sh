#!/usr/bin/env bash
# Builds, on this machine and once, llama.cpp with CUDA for a GPU this machine does not have: the shared
# libraries llama-cpp-python loads and llama-server linked against those same libraries, from the sdist the
# project pins, with native/patches applied, for one GPU architecture (default 90-real: H100 / H200). nvcc must be
# here (CUDA 13 on these machines, the same as the GPU machine's). The result is cached like the CPU wheel,
# keyed by version + flags + patches, so scripts/gpu-kit.sh packs it without rebuilding.
#
#   bash scripts/gpu-kit-build.sh            # prints the cache folder (lib/ and bin/llama-server) on stdout
#   SPECRAY_CUDA_ARCH=80-real bash scripts/gpu-kit-build.sh      # an A100; "90" adds PTX for newer GPUs
#
# The CPU side is built for a portable x86 baseline (AVX2, FMA, F16C; no AVX-512, no AMX), not for this
# machine's CPU: the libraries run on the GPU machine's host, which is another CPU. One compile serves both
# the Python package and llama-server (the anchor), so the two cannot drift. On 2 cores the CUDA kernels take
# tens of minutes: run it in the background; it prints progress to stderr.
set -euo pipefail

HERE=$(cd "$(dirname "$0")/.." && pwd)
VERSION=$(sed -n 's/^LLAMA_CPP_VERSION=\([0-9.]*\)$/\1/p' "$HERE/scripts/cpu-flags.sh")
# 90-real: machine code for sm_90 only, no PTX for later GPUs to compile (a kit is built for the GPU it is lent);
# with --compress-mode=size, the smallest libggml-cuda, which decides how many parts the kit takes
ARCH=${SPECRAY_CUDA_ARCH:-90-real}
CACHE=${SPECRAY_CUDA_CACHE:-$HOME/.cache/specray/cuda}
PATCHES=("$HERE"/native/patches/*.patch)
NVCC=${SPECRAY_NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
[[ -x "$NVCC" ]] || { echo "gpu-kit-build.sh: nvcc not found (PATH or /usr/local/cuda/bin): install the CUDA toolkit" >&2; exit 2; }
[[ "$ARCH" =~ ^[0-9]+a?(-real|-virtual)?(\;[0-9]+a?(-real|-virtual)?)*$ ]] || { echo "gpu-kit-build.sh: SPECRAY_CUDA_ARCH must be like 90-real, 90 or '80-real;90-real', got '$ARCH'" >&2; exit 2; }
# cuBLAS: these machines' CUDA toolkit has no cuBLAS; NVIDIA's wheel (the same major version) gives its headers
# and libraries to link against. The GPU machine's own libcublas.so.13 is loaded at run time.
CUBLAS=${SPECRAY_CUBLAS:-$CACHE/cublas}
if [[ ! -f "$CUBLAS/include/cublas_v2.h" ]] && ! [[ -f "$(dirname "$(dirname "$NVCC")")/include/cublas_v2.h" ]]; then
    tmp=$(mktemp -d)
    python3 -m pip download --quiet --no-deps "nvidia-cublas==${SPECRAY_CUBLAS_VERSION:-13.0.0.19}" -d "$tmp" >&2
    (cd "$tmp" && python3 -m zipfile -e nvidia_cublas-*.whl x >&2)
    rm -rf "$CUBLAS" && mkdir -p "$CUBLAS/lib" && cp -r "$tmp"/x/nvidia/cu*/include "$CUBLAS/"
    for l in cublas cublasLt; do cp "$tmp"/x/nvidia/cu*/lib/lib$l.so.* "$CUBLAS/lib/"; ln -sf "$(cd "$CUBLAS/lib" && ls lib$l.so.* | head -1)" "$CUBLAS/lib/lib$l.so"; done
    rm -rf "$tmp"
fi

# GGML_CUDA_NO_VMM: no link to the driver library (libcuda.so), which a machine without a GPU lacks; the pool
# is then cudaMalloc'd in blocks instead of mapped virtual memory (cudart still loads the driver at run time)
ARGS="-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$ARCH -DGGML_CUDA_NO_VMM=ON"
ARGS+=" -DGGML_NATIVE=OFF -DGGML_LLAMAFILE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
ARGS+=" -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF"
ARGS+=" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON"
ARGS+=" -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF"
key=$( (echo "$VERSION cuda-kit $ARGS --compress-mode=size $("$NVCC" --version | tail -1)"; cat "${PATCHES[@]}") | sha256sum | cut -c1-16)
out="$CACHE/$key"

if [[ ! -x "$out/bin/llama-server" ]]; then
    t0=$(date +%s)
    echo "gpu-kit-build.sh: building llama.cpp $VERSION with CUDA (sm_$ARCH) into $out (a one-off compile: minutes on many cores, tens of minutes on 2)" >&2
    work=${SPECRAY_KIT_WORK:-$(mktemp -d)}
    mkdir -p "$work"
    sdist=${SPECRAY_WHEELHOUSE:+$SPECRAY_WHEELHOUSE/llama_cpp_python-$VERSION.tar.gz}
    if [[ -z "$sdist" || ! -f "$sdist" ]]; then
        [[ -f "$work/llama_cpp_python-$VERSION.tar.gz" ]] || python3 -m pip download --quiet --no-deps \
            --no-binary :all: "llama-cpp-python==$VERSION" -d "$work" >&2
        sdist="$work/llama_cpp_python-$VERSION.tar.gz"
    fi
    src="$work/llama_cpp_python-$VERSION"
    if [[ ! -f "$src/.specray-patched" ]]; then
        rm -rf "$src" && tar -xzf "$sdist" -C "$work"
        for p in "${PATCHES[@]}"; do patch -s -p1 -d "$src" < "$p"; done
        touch "$src/.specray-patched"
    fi
    # $ORIGIN: llama-server finds the libraries beside it wherever the kit unpacks them
    cmake -S "$src/vendor/llama.cpp" -B "$work/build" -G Ninja $ARGS -DCMAKE_CUDA_COMPILER="$NVCC" \
        -DCMAKE_BUILD_RPATH='$ORIGIN' -DCMAKE_LIBRARY_PATH="$CUBLAS/lib" -DCMAKE_CUDA_FLAGS="-I$CUBLAS/include --compress-mode=size" >&2
    nice cmake --build "$work/build" --target llama llama-server -j "${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" >&2
    rm -rf "$out.tmp" && mkdir -p "$out.tmp/lib" "$out.tmp/bin"
    cp -P "$work"/build/bin/lib*.so* "$out.tmp/lib/"
    cp "$work/build/bin/llama-server" "$out.tmp/bin/"
    strip --strip-unneeded "$out.tmp"/lib/*.so* "$out.tmp/bin/llama-server" 2>/dev/null || true
    printf 'llama-cpp-python %s\ncuda arch %s\nnvcc %s\ncmake %s\nbuilt %s in %s s\n' "$VERSION" "$ARCH" \
        "$("$NVCC" --version | tail -1)" "$ARGS" "$(date -u +%FT%TZ)" "$(( $(date +%s) - t0 ))" > "$out.tmp/BUILD"
    rm -rf "$out" && mv "$out.tmp" "$out"
    [[ -n "${SPECRAY_KIT_WORK:-}" ]] || rm -rf "$work"
    echo "gpu-kit-build.sh: built in $(( $(date +%s) - t0 )) s" >&2
fi
echo "$out"
