"""One copy of each llama.cpp library per process (native/shared_libs.py): this process, and fake maps listings."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from specray.native import shared_libs

SITE = "/tmp/site/llama_cpp/lib"
BUILD = "/tmp/gpu/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"


def maps(*paths: str) -> str:
    return "".join(f"7f{i:04x}000-7f{i:04x}fff r-xp 00000000 08:01 {100 + i} {p}\n" for i, p in enumerate(paths))


def test_this_process_maps_one_copy_of_each_library_from_one_folder():
    from specray.native import lib

    libs = shared_libs.check_one_copy()
    assert libs == lib.LIBRARIES
    assert {"libllama", "libggml", "libggml-base", "libggml-cpu"} <= set(libs)
    assert all(len(paths) == 1 for paths in libs.values())
    assert len({p.rsplit("/", 1)[0] for paths in libs.values() for p in paths}) == 1


def test_a_library_mapped_from_two_files_is_refused_naming_both():
    # the wheel's libggml.so and libggml.so.0 are separate files: a load by each name maps libggml twice
    listing = maps(f"{SITE}/libllama.so", f"{SITE}/libggml.so.0", f"{SITE}/libggml-base.so.0",
                   f"{SITE}/libggml.so.0", f"{SITE}/libggml.so", "/usr/lib/x86_64-linux-gnu/libc.so.6")
    with pytest.raises(RuntimeError) as e:
        shared_libs.check_one_copy(listing)
    assert f"libggml is mapped twice: {SITE}/libggml.so.0 and {SITE}/libggml.so" in str(e.value)


def test_libraries_from_two_folders_are_refused_naming_both(monkeypatch):
    # the GPU recipe: libllama copied into site-packages, its RUNPATH (the build tree) loading ggml from there
    monkeypatch.delenv("SPECRAY_ALLOW_MIXED_GGML", raising=False)
    listing = maps(f"{SITE}/libllama.so.0.5.0", f"{BUILD}/libggml.so.0.25.3", f"{BUILD}/libggml-cuda.so.0.25.3")
    with pytest.raises(RuntimeError) as e:
        shared_libs.check_one_copy(listing)
    assert f"{SITE} (libllama) and {BUILD} (libggml, libggml-cuda)" in str(e.value)


def test_the_override_warns_instead(monkeypatch, caplog):
    monkeypatch.setenv("SPECRAY_ALLOW_MIXED_GGML", "1")
    listing = maps(f"{SITE}/libllama.so", f"{BUILD}/libggml.so.0")
    with caplog.at_level(logging.WARNING, logger=shared_libs.__name__):
        libs = shared_libs.check_one_copy(listing)
    assert set(libs) == {"libllama", "libggml"} and "two folders" in caplog.text


def test_deleted_files_other_libraries_and_anonymous_maps_are_read_right():
    listing = (maps(f"{SITE}/libggml-cpu.so.0 (deleted)", "/opt/numpy.libs/libscipy_openblas64_-ff651d7f.so",
                    "/usr/lib/libllamafile_not_ours.so", f"{SITE}/libmtmd.so")
               + "7f00-7f01 rw-p 00000000 00:00 0 \n7f02-7f03 rw-p 00000000 00:00 0 [heap]\n")
    assert shared_libs.mapped_llama_libraries(listing) == {"libggml-cpu": [f"{SITE}/libggml-cpu.so.0"],
                                                          "libmtmd": [f"{SITE}/libmtmd.so"]}


def test_loading_a_library_by_another_name_maps_the_same_file():
    # llama_cpp._ggml loads lib/libggml.so by path while libllama's DT_NEEDED loaded libggml.so.0: the install
    # (scripts/build-llama-cpp.sh) makes every name a symlink to the SONAME file, so both are one mapping
    code = ("import numpy.linalg, specray.native.lib, llama_cpp._ggml; from specray.native import shared_libs; "
            "print(sorted(shared_libs.check_one_copy()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-1500:]
    assert "libggml" in out.stdout


def test_doctests():
    import doctest

    failed, attempted = doctest.testmod(shared_libs)
    assert attempted and not failed
