"""Loading llama_cpp once, build facts, and the run-time llamafile switch.

specray's install (scripts/build-llama-cpp.sh) patches ggml-cpu with
`ggml_cpu_set_llamafile(int)`: llamafile's sgemm is fast but a row's result
depends on how many rows share the batch, so exact mode switches it off.
A stock llama-cpp-python build lacks the symbol; exact mode then reports
itself unavailable instead of silently not being exact.

The same install adds `ggml_cpu_set_specray_cols(int)` (x86 AVX2): Q8_0 and
Q4_1 weights times a few batch rows take a kernel that loads each weight block
once for all rows, instead of streaming the matrix once per row, so a short
speculative verify costs less. Its results are bitwise those of the 1-row
kernel; the switch exists to measure it (and SPECRAY_GGML_COLS=0 turns it off).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import threading

import llama_cpp  # noqa: F401  (loads libllama and its ggml libraries)
import llama_cpp._logger as _llama_logger

from .shared_libs import check_one_copy

# one copy of each ggml library, from one folder, or a loud error naming the paths (native/shared_libs.py)
LIBRARIES = check_one_copy()

_init_lock = threading.Lock()
_initialised = False


def set_verbose(verbose: bool) -> None:
    """llama.cpp's own log lines: errors only unless verbose (SPECRAY_LLAMA_VERBOSE=1)."""
    _llama_logger.set_verbose(verbose)


def ensure_backend() -> None:
    """llama_backend_init, once per process."""
    global _initialised
    with _init_lock:
        if not _initialised:
            set_verbose(os.environ.get("SPECRAY_LLAMA_VERBOSE", "") not in ("", "0"))
            llama_cpp.llama_backend_init()
            _initialised = True


@functools.cache
def system_info() -> str:
    ensure_backend()
    return llama_cpp.llama_print_system_info().decode("utf-8", "replace")


def gpu_offload() -> bool:
    """True if this llama.cpp build can offload to a GPU it sees (a CUDA build with a device)."""
    ensure_backend()
    return bool(llama_cpp.llama_supports_gpu_offload())


ALL_LAYERS = 999  # llama.cpp clamps n_gpu_layers to the model's layer count (+1 for the output layer)


def resolve_gpu_layers(n_gpu_layers: int | None) -> int:
    """None: every layer on a machine where llama.cpp offloads to a GPU, none elsewhere; else as given.

    >>> resolve_gpu_layers(12)
    12
    >>> resolve_gpu_layers(None) in (0, ALL_LAYERS)
    True
    """
    if n_gpu_layers is not None:
        return n_gpu_layers
    return ALL_LAYERS if gpu_offload() else 0


def build_has_amx() -> bool:
    """True if the loaded ggml CPU backend was compiled with AMX kernels."""
    return "AMX_INT8 = 1" in system_info()


def _loaded_library_paths(prefix: str) -> list[str]:
    """Paths of already-mapped shared libraries whose file name starts with prefix."""
    paths = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                if os.path.basename(path).startswith(prefix) and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    return paths


@functools.cache
def _ggml_cpu_lib() -> ctypes.CDLL | None:
    # The wheel ships libggml-cpu.so, .so.0 and .so.0.x as separate copies (no
    # symlinks; scripts/build-llama-cpp.sh links them after installing, other
    # installs may not), so the switch must be flipped in the copy llama.cpp
    # actually loaded, or it changes a private duplicate and nothing else.
    ensure_backend()
    lib_dir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    candidates = _loaded_library_paths("libggml-cpu") or sorted(
        glob.glob(os.path.join(lib_dir, "libggml-cpu*.so*"))
    )
    for path in candidates:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "ggml_cpu_set_llamafile"):
            lib.ggml_cpu_set_llamafile.argtypes = [ctypes.c_int]
            lib.ggml_cpu_set_llamafile.restype = None
            lib.ggml_cpu_get_llamafile.argtypes = []
            lib.ggml_cpu_get_llamafile.restype = ctypes.c_int
            if hasattr(lib, "ggml_cpu_set_specray_cols"):
                lib.ggml_cpu_set_specray_cols.argtypes = [ctypes.c_int]
                lib.ggml_cpu_set_specray_cols.restype = None
                lib.ggml_cpu_get_specray_cols.argtypes = []
                lib.ggml_cpu_get_specray_cols.restype = ctypes.c_int
            return lib
    return None


def exact_mode_available() -> tuple[bool, str]:
    """(available, reason). Exact mode needs specray's patched ggml-cpu."""
    if _ggml_cpu_lib() is None:
        return False, (
            "this llama-cpp-python build lacks specray's run-time llamafile switch "
            "(install it with scripts/build-llama-cpp.sh)"
        )
    return True, "ok"


_llamafile_state: bool | None = None


def set_llamafile(enabled: bool) -> None:
    """Switch llamafile sgemm on/off for the whole process (all contexts)."""
    global _llamafile_state
    if _llamafile_state is enabled:
        return
    lib = _ggml_cpu_lib()
    if lib is None:
        if not enabled:
            raise RuntimeError(exact_mode_available()[1])
        return
    lib.ggml_cpu_set_llamafile(1 if enabled else 0)
    _llamafile_state = enabled


def llamafile_enabled() -> bool:
    lib = _ggml_cpu_lib()
    if lib is None:
        return "LLAMAFILE = 1" in system_info()
    return bool(lib.ggml_cpu_get_llamafile())


def verify_cols_available() -> bool:
    """True if this build has specray's few-row Q8_0/Q4_1 kernel (patched ggml-cpu, x86 with AVX2)."""
    lib = _ggml_cpu_lib()
    return lib is not None and hasattr(lib, "ggml_cpu_set_specray_cols") and "AVX2 = 1" in system_info()


def set_verify_cols(enabled: bool) -> None:
    """Switch the few-row Q8_0/Q4_1 kernel on/off for the whole process (results are bitwise the same)."""
    if not verify_cols_available():
        raise RuntimeError("this llama-cpp-python build lacks specray's few-row kernel "
                           "(install it with scripts/build-llama-cpp.sh on an AVX2 machine)")
    _ggml_cpu_lib().ggml_cpu_set_specray_cols(1 if enabled else 0)


def verify_cols_enabled() -> bool:
    return verify_cols_available() and bool(_ggml_cpu_lib().ggml_cpu_get_specray_cols())
