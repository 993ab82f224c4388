# Sourced (not run) by build-llama-cpp.sh and build-llama-server.sh, so the
# llama-cpp-python wheel and the llama-server binary are built from the same
# llama.cpp with the same CPU features and the same patches and cannot drift.
#
# Sets:
#   LLAMA_CPP_VERSION  the llama-cpp-python release whose sdist vendors llama.cpp
#   GGML_CPU_ARGS      cmake flags: GGML_NATIVE=OFF, llamafile on, AMX off, and
#                      exactly the x86 features /proc/cpuinfo reports on
#                      (-march=native segfaults in ggml_backend_amx_mul_mat at
#                      the first decode on Xeons with AMX)
#   SPECRAY_PATCHES    native/patches/*.patch in name order (apply with -p1 to
#                      the sdist's root)
#   GGML_GPU_ARGS, GGML_BACKEND   from gpu-flags.sh (CUDA or not; SPECRAY_CUDA)
# Needs HERE = the repository root.

LLAMA_CPP_VERSION=0.3.36
SPECRAY_PATCHES=("$HERE"/native/patches/*.patch)

_cpu_flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
_cpu_onoff() { if [[ " $_cpu_flags " == *" $1 "* ]]; then echo ON; else echo OFF; fi; }

GGML_CPU_ARGS="-DGGML_NATIVE=OFF -DGGML_LLAMAFILE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
GGML_CPU_ARGS+=" -DGGML_SSE42=$(_cpu_onoff sse4_2) -DGGML_AVX=$(_cpu_onoff avx) -DGGML_AVX2=$(_cpu_onoff avx2)"
GGML_CPU_ARGS+=" -DGGML_FMA=$(_cpu_onoff fma) -DGGML_F16C=$(_cpu_onoff f16c) -DGGML_BMI2=$(_cpu_onoff bmi2)"
GGML_CPU_ARGS+=" -DGGML_AVX_VNNI=$(_cpu_onoff avx_vnni) -DGGML_AVX512=$(_cpu_onoff avx512f)"
GGML_CPU_ARGS+=" -DGGML_AVX512_VBMI=$(_cpu_onoff avx512vbmi) -DGGML_AVX512_VNNI=$(_cpu_onoff avx512_vnni)"
GGML_CPU_ARGS+=" -DGGML_AVX512_BF16=$(_cpu_onoff avx512_bf16)"
unset -f _cpu_onoff
unset _cpu_flags
# shellcheck source=gpu-flags.sh
source "$HERE/scripts/gpu-flags.sh"
