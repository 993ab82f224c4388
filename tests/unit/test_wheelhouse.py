"""The offline install: scripts/wheelhouse.sh's options, setup.sh --wheelhouse's checks, and a real wheelhouse of
this Python resolving the project's requirements with no index (skipped where PyPI is unreachable)."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WHEELHOUSE = ROOT / "scripts" / "wheelhouse.sh"
PYVER = "%d.%d" % sys.version_info[:2]


def run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *args], capture_output=True, text=True, env=os.environ | env, timeout=600)


def test_the_plan_downloads_binary_wheels_for_the_given_python_and_platform_and_the_llama_sdist():
    out = run(str(WHEELHOUSE), "/x/wh", "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64",
              "--dev", "--dry-run")
    assert out.returncode == 0, out.stderr
    reqs, sdist, wheels = out.stdout.splitlines()
    assert sdist.endswith("pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /x/wh")
    assert "pip download --only-binary :all: --python-version 3.12 --platform manylinux_2_28_x86_64 " in wheels
    # pip takes only the tags it is given: a glibc 2.28 system also runs every older manylinux wheel
    assert "--platform manylinux_2_17_x86_64 " in wheels and "--platform manylinux2014_x86_64 " in wheels
    assert "--platform manylinux1_x86_64 --find-links /x/wh/.resolve -d /x/wh -r /x/wh/requirements.txt" in wheels
    assert "manylinux_2_29" not in wheels
    names = reqs.removeprefix("requirements: ").split()
    assert "ray[serve]>=2.60,<2.61" in names and "pytest>=8" in names and "scikit-build-core>=0.9.2" in names
    assert not any(n.startswith("llama-cpp-python") for n in names)  # built from the sdist, not downloaded
    assert not any(n.startswith("torch") for n in names)  # --train only


def test_the_extras_are_what_was_asked_for():
    plain = run(str(WHEELHOUSE), "/x", "--dry-run").stdout
    train = run(str(WHEELHOUSE), "/x", "--train", "--dry-run").stdout
    assert "pytest" not in plain and "torch" not in plain and "--python-version" not in plain
    assert "torch>=2.4" in train and "gguf>=0.10" in train


@pytest.mark.parametrize("args, says", [
    (["--bogus"], "unknown option '--bogus'"),
    ([], "DIR missing"),
    (["/x", "/y"], "one DIR only"),
    (["/x", "--python-version"], "--python-version needs a value"),
    (["/x", "--platform", "--dev"], "--platform needs a value"),
    (["/x", "--python-version", "312"], "MAJOR.MINOR"),
])
def test_wheelhouse_sh_names_a_bad_flag(args, says):
    out = run(str(WHEELHOUSE), *args, "--dry-run")
    assert out.returncode == 2 and says in out.stderr


def source_env(wheelhouse: Path | str, extra: str, then: str = ":") -> subprocess.CompletedProcess:
    """setup.sh's wheelhouse step alone: source scripts/wheelhouse-env.sh, then `then`, print the extras."""
    script = f'set -euo pipefail; cd "$1"; wheelhouse="$2"; extra="$3"; source scripts/wheelhouse-env.sh; {then}; ' \
             'echo "extra=$extra index=$PIP_NO_INDEX links=$PIP_FIND_LINKS"'
    return subprocess.run(["bash", "-c", script, "bash", str(ROOT), str(wheelhouse), extra],
                          capture_output=True, text=True, timeout=600)


def manifest(d: Path, pyver: str = PYVER, extras: str = "dev") -> Path:
    (d / "MANIFEST").write_text(f"# specray wheelhouse\npython-version: {pyver}\nextras: {extras}\nfiles:\n")
    return d


def test_setup_sh_names_a_missing_or_unwritten_wheelhouse(tmp_path):
    out = run(str(ROOT / "scripts" / "setup.sh"), "--wheelhouse")
    assert out.returncode == 2 and "--wheelhouse needs a DIR" in out.stderr
    out = source_env(tmp_path / "nowhere", "")
    assert out.returncode == 2 and "no such directory" in out.stderr
    # a relative DIR is the caller's, not the checkout's (setup.sh changes to the checkout first)
    out = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), "--wheelhouse", "rel"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and f"--wheelhouse {tmp_path}/rel: no such directory" in out.stderr
    out = source_env(tmp_path, "")
    assert out.returncode == 2 and "no MANIFEST" in out.stderr and "scripts/wheelhouse.sh" in out.stderr


def test_setup_sh_goes_offline_and_takes_the_extras_the_wheelhouse_has(tmp_path):
    out = source_env(manifest(tmp_path, extras="dev"), "[dev,train]")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"extra=[dev] index=1 links={tmp_path}"  # no torch there: no train extra
    assert "no train extra" in out.stderr
    out = source_env(manifest(tmp_path, extras="none"), "[dev,train]")
    assert out.returncode == 2 and "--dev needs the dev extra" in out.stderr


def test_the_preflight_refuses_a_wheelhouse_for_another_python(tmp_path):
    out = source_env(manifest(tmp_path, pyver="3.99"), "", then=f"wheelhouse_preflight {sys.executable}")
    assert out.returncode == 2 and f"wheels are for Python 3.99, this venv's is {PYVER}" in out.stderr


def pypi_reachable() -> bool:
    try:
        urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=5).close()
        return True
    except OSError:
        return False


def test_a_wheelhouse_of_this_python_resolves_the_install_with_no_index():
    """Real: writes (once; later runs only re-resolve) a wheelhouse of the runtime and dev requirements under
    ~/.cache/specray/wheelhouse-test (about 600 MB, ~60 s the first time), then runs setup.sh's preflight on it:
    `pip install --dry-run --no-index` of the project from that folder alone."""
    if not pypi_reachable():
        pytest.skip("PyPI is unreachable: no wheelhouse can be written here")
    d = Path.home() / ".cache" / "specray" / "wheelhouse-test" / PYVER
    out = run(str(WHEELHOUSE), str(d), "--dev", PYTHON=sys.executable)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (d / "llama_cpp_python-0.3.36.tar.gz").is_file() and not list(d.glob("llama_cpp_python-*.whl"))
    listed = (d / "MANIFEST").read_text()
    assert f"python-version: {PYVER}" in listed and "ray-" in listed and "scikit_build_core-" in listed
    out = source_env(d, "[dev]", then=f"wheelhouse_preflight {sys.executable}")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "installing offline" in out.stderr
