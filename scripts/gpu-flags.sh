# Sourced (not run) by build-llama-cpp.sh and build-llama-server.sh, after cpu-flags.sh: whether llama.cpp
# is built with CUDA, and for which GPU architecture.
#
# SPECRAY_CUDA (setup.sh --cuda / --cpu set it):
#   auto (default)  CUDA when nvcc is found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin) and nvidia-smi
#                   reports a GPU; the CPU build otherwise (a CI runner with nvcc but no GPU stays on CPU)
#   on              CUDA; fails, saying why, without nvcc or without an architecture
#   off             the CPU build
# SPECRAY_CUDA_ARCH: compute capability to build for, e.g. 90 (H100) or "80;90"; default: the local GPU's
#   (nvidia-smi), which is what a build without a GPU (an image built for a GPU node) must be told.
# Sets:
#   GGML_GPU_ARGS   cmake flags (empty for the CPU build, so the CPU wheel's cache key is unchanged)
#   GGML_BACKEND    cpu | cuda (printed, and part of the cache key through the flags)
# Test hooks: SPECRAY_NVCC and SPECRAY_GPU_COMPUTE_CAP stand in for the nvcc path and nvidia-smi's answer
# ("none": no GPU), so tests/unit/test_gpu_flags.py checks the logic on machines without either.

_specray_nvcc() {
    if [[ -n "${SPECRAY_NVCC+x}" ]]; then echo "$SPECRAY_NVCC"; return; fi
    command -v nvcc 2>/dev/null && return
    for d in "${CUDA_HOME:-}" /usr/local/cuda; do
        [[ -n "$d" && -x "$d/bin/nvcc" ]] && { echo "$d/bin/nvcc"; return; }
    done
    true
}

_specray_compute_cap() {  # e.g. 90 for the first GPU nvidia-smi lists; empty without one
    if [[ -n "${SPECRAY_GPU_COMPUTE_CAP+x}" ]]; then
        [[ "$SPECRAY_GPU_COMPUTE_CAP" == none ]] || echo "$SPECRAY_GPU_COMPUTE_CAP"
        return
    fi
    command -v nvidia-smi >/dev/null 2>&1 || return 0
    nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .'
}

GGML_GPU_ARGS=""
GGML_BACKEND=cpu
_mode=${SPECRAY_CUDA:-auto}
case "$_mode" in
    auto|on|off) ;;
    *) echo "specray: SPECRAY_CUDA must be auto, on or off, got '$_mode'" >&2; return 2 ;;
esac
if [[ "$_mode" != off ]]; then
    _nvcc=$(_specray_nvcc)
    _arch=${SPECRAY_CUDA_ARCH:-$(_specray_compute_cap)}
    if [[ "$_mode" == on && -z "$_nvcc" ]]; then
        echo "specray: --cuda: nvcc not found (PATH, \$CUDA_HOME/bin, /usr/local/cuda/bin); install the CUDA toolkit" >&2
        return 2
    fi
    if [[ "$_mode" == on && -z "$_arch" ]]; then
        echo "specray: --cuda: no GPU visible to nvidia-smi; set SPECRAY_CUDA_ARCH (e.g. 90 for an H100)" >&2
        return 2
    fi
    if [[ -n "$_nvcc" && -n "$_arch" ]]; then
        GGML_BACKEND=cuda
        GGML_GPU_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_COMPILER=$_nvcc -DCMAKE_CUDA_ARCHITECTURES=$_arch"
    fi
fi
unset -f _specray_nvcc _specray_compute_cap
unset _mode _nvcc _arch
