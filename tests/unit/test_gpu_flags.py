"""The CUDA build-flag logic (scripts/gpu-flags.sh), with nvcc and nvidia-smi stood in for: no GPU needed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def flags(**env: str) -> tuple[int, str, str]:
    """(exit status, "BACKEND|ARGS", stderr) of sourcing cpu-flags.sh (which sources gpu-flags.sh) with `env`."""
    script = 'set -euo pipefail; HERE="$1"; source "$HERE/scripts/cpu-flags.sh"; echo "$GGML_BACKEND|$GGML_GPU_ARGS"'
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SPECRAY_CUDA", "SPECRAY_NVCC", "SPECRAY_GPU"))}
    out = subprocess.run(["bash", "-c", script, "bash", str(ROOT)], env=base | env, capture_output=True, text=True)
    return out.returncode, out.stdout.strip(), out.stderr


def test_auto_builds_for_the_local_gpu_where_nvcc_and_a_gpu_are_found():
    rc, out, _ = flags(SPECRAY_NVCC="/opt/cuda/bin/nvcc", SPECRAY_GPU_COMPUTE_CAP="90")
    assert rc == 0
    assert out == "cuda|-DGGML_CUDA=ON -DCMAKE_CUDA_COMPILER=/opt/cuda/bin/nvcc -DCMAKE_CUDA_ARCHITECTURES=90"


@pytest.mark.parametrize("env", [
    {"SPECRAY_NVCC": "/opt/cuda/bin/nvcc", "SPECRAY_GPU_COMPUTE_CAP": "none"},  # a CI runner with nvcc, no GPU
    {"SPECRAY_NVCC": "", "SPECRAY_GPU_COMPUTE_CAP": "90"},                      # a GPU but no toolkit
    {"SPECRAY_CUDA": "off", "SPECRAY_NVCC": "/opt/cuda/bin/nvcc", "SPECRAY_GPU_COMPUTE_CAP": "90"},
], ids=["no-gpu", "no-nvcc", "off"])
def test_the_cpu_build_keeps_its_flags_and_so_its_cached_wheel(env):
    rc, out, _ = flags(**env)
    assert (rc, out) == (0, "cpu|")


def test_cuda_on_names_what_is_missing_and_takes_an_architecture_without_a_gpu():
    rc, _, err = flags(SPECRAY_CUDA="on", SPECRAY_NVCC="", SPECRAY_GPU_COMPUTE_CAP="90")
    assert rc == 2 and "nvcc not found" in err
    rc, _, err = flags(SPECRAY_CUDA="on", SPECRAY_NVCC="/opt/cuda/bin/nvcc", SPECRAY_GPU_COMPUTE_CAP="none")
    assert rc == 2 and "SPECRAY_CUDA_ARCH" in err
    # an image built for GPU nodes on a machine without one
    rc, out, _ = flags(SPECRAY_CUDA="on", SPECRAY_NVCC="/opt/cuda/bin/nvcc", SPECRAY_GPU_COMPUTE_CAP="none",
                       SPECRAY_CUDA_ARCH="80;90")
    assert rc == 0 and out.endswith("-DCMAKE_CUDA_ARCHITECTURES=80;90")
    rc, _, err = flags(SPECRAY_CUDA="maybe")
    assert rc == 2 and "auto, on or off" in err


def test_setup_sh_takes_cuda_and_cpu_and_names_a_bad_option():
    out = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), "--gpu"], capture_output=True, text=True)
    assert out.returncode == 2 and "unknown option '--gpu'" in out.stderr and "--cuda" in out.stderr


def kit_build(**env: str) -> subprocess.CompletedProcess:
    """scripts/gpu-kit-build.sh with `env`; the checks below fail before any download or compile."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SPECRAY_CUDA", "SPECRAY_NVCC"))}
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu-kit-build.sh")], env=base | env, capture_output=True,
                          text=True, timeout=60)


def test_kit_build_names_a_missing_nvcc_and_a_bad_architecture(tmp_path):
    missing = kit_build(SPECRAY_NVCC=str(tmp_path / "nvcc"))
    assert missing.returncode == 2 and "nvcc not found" in missing.stderr
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0'\n")
    fake.chmod(0o755)
    bad = kit_build(SPECRAY_NVCC=str(fake), SPECRAY_CUDA_ARCH="sm90", SPECRAY_CUDA_CACHE=str(tmp_path / "cache"))
    assert bad.returncode == 2 and "SPECRAY_CUDA_ARCH must be like 90-real" in bad.stderr and "'sm90'" in bad.stderr
    assert not (tmp_path / "cache").exists()  # nothing was fetched
