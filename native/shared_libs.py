"""One copy of each llama.cpp shared library per process, all from one folder: checked at import.

ggml keeps process-wide state in its libraries (the backend registry in
libggml, the CUDA device table and pools in libggml-cuda, logging and the
fp16 tables in libggml-base). Two copies of a library mean two copies of that
state, and a tensor or backend made by one copy and used through the other.
That is what an install can produce when the libraries llama_cpp loads by path
(`llama_cpp/lib/libllama.so`) are not the ones their RUNPATH points at: the
offline GPU recipe (../shared/gpu/gpu-setup.sh) copies a CMake build tree's
libraries into site-packages, and a build tree's RUNPATH is the absolute build
folder, so libllama comes from site-packages while its ggml libraries come from
the build tree; a later load by path (llama_cpp._ggml, a ctypes.CDLL of a file
in llama_cpp/lib) then maps a second libggml beside the first. Which copy a
symbol binds to then depends on what was loaded before (numpy's OpenBLAS
included), which fits the import-order segfault seen on that machine
(docs/troubleshooting.md). specray's own install builds the wheel with scikit-build-core
(RUNPATH `$ORIGIN`: one folder), so every library resolves to llama_cpp/lib.

`check_one_copy()` reads /proc/self/maps after llama_cpp is loaded and
refuses a process that maps a library twice or from two folders, naming the
paths. SPECRAY_ALLOW_MIXED_GGML=1 turns the refusal into a warning (to run
an old install while measuring what it does).
"""

from __future__ import annotations

import logging
import os
import re

log = logging.getLogger(__name__)

#: the library's stem: libggml-base.so.0.25.3 -> libggml-base
_LIB = re.compile(r"^(lib(?:ggml[\w-]*|llama|mtmd|llava))\.so(?:\.[\d.]+)?$")
_DELETED = " (deleted)"


def mapped_llama_libraries(maps: str) -> dict[str, list[str]]:
    """llama.cpp's libraries in a /proc/PID/maps text: stem -> distinct file paths, in first-mapped order.

    >>> maps = ('7f1-7f2 r-xp 0 08:01 12 /site/llama_cpp/lib/libllama.so\\n'
    ...         '7f3-7f4 r--p 0 08:01 13 /site/llama_cpp/lib/libggml.so.0\\n'
    ...         '7f5-7f6 r-xp 0 08:01 13 /site/llama_cpp/lib/libggml.so.0\\n'
    ...         '7f7-7f8 r-xp 0 08:01 14 /usr/lib/libc.so.6\\n')
    >>> mapped_llama_libraries(maps)
    {'libllama': ['/site/llama_cpp/lib/libllama.so'], 'libggml': ['/site/llama_cpp/lib/libggml.so.0']}
    """
    out: dict[str, list[str]] = {}
    for line in maps.splitlines():
        fields = line.split(None, 5)
        if len(fields) < 6 or not fields[5].startswith("/"):
            continue
        path = fields[5].removesuffix(_DELETED)
        m = _LIB.match(os.path.basename(path))
        if m and path not in out.setdefault(m.group(1), []):
            out[m.group(1)].append(path)
    return out


def copy_problems(libs: dict[str, list[str]]) -> list[str]:
    """What is wrong with `mapped_llama_libraries`' answer: a library mapped from two files, or from two folders.

    >>> copy_problems({'libllama': ['/a/libllama.so'], 'libggml': ['/a/libggml.so.0']})
    []
    >>> copy_problems({'libggml': ['/a/libggml.so.0', '/a/libggml.so']})
    ['libggml is mapped twice: /a/libggml.so.0 and /a/libggml.so']
    >>> copy_problems({'libllama': ['/site/libllama.so'], 'libggml': ['/build/bin/libggml.so.0']})
    ['llama.cpp libraries come from two folders: /site (libllama) and /build/bin (libggml)']
    """
    problems = [f"{stem} is mapped twice: {' and '.join(paths)}" for stem, paths in libs.items() if len(paths) > 1]
    folders: dict[str, list[str]] = {}
    for stem, paths in libs.items():
        for p in paths:
            folders.setdefault(os.path.dirname(p), []).append(stem)
    if len(folders) > 1:
        problems.append("llama.cpp libraries come from two folders: "
                        + " and ".join(f"{d} ({', '.join(stems)})" for d, stems in folders.items()))
    return problems


def check_one_copy(maps: str | None = None) -> dict[str, list[str]]:
    """Raise RuntimeError if this process (or the given maps text) maps a llama.cpp library twice or from two
    folders; returns the libraries found. Where /proc is missing (not Linux) there is nothing to check."""
    if maps is None:
        try:
            with open("/proc/self/maps") as f:
                maps = f.read()
        except OSError:
            return {}
    libs = mapped_llama_libraries(maps)
    problems = copy_problems(libs)
    if problems:
        msg = ("specray: llama.cpp's shared libraries are not one file each from one folder, so ggml's "
               "process-wide state can exist twice (suspected in the import-order segfault on GPU images): "
               + "; ".join(problems)
               + ". Install llama-cpp-python with scripts/setup.sh (one folder, RUNPATH $ORIGIN)")
        if os.environ.get("SPECRAY_ALLOW_MIXED_GGML", "") not in ("", "0"):
            log.warning("%s (SPECRAY_ALLOW_MIXED_GGML set: going on)", msg)
        else:
            raise RuntimeError(msg + ", or set SPECRAY_ALLOW_MIXED_GGML=1 to go on anyway.")
    return libs
