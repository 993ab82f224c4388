"""The GPU kit's CPU dry run: the same scripts a lent GPU machine runs (scripts/gpu-kit.sh packs here,
scripts/gpu-kit-setup.sh unpacks there, scripts/gpu-measure.sh measures), with this machine's CPU build of
llama.cpp, SmolLM2 and small counts, so the kit cannot rot between lent machines. The CUDA build itself
(scripts/gpu-kit-build.sh) is not run here: it takes over an hour on two cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specray.engine.cores import cores_in_use

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[2]
MIB = 1024 * 1024


def sh(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *args], cwd=ROOT, env=(os.environ | (env or {})), capture_output=True,
                          text=True, timeout=timeout)


def tracked_bytes() -> int:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / f.decode()).stat().st_size for f in files if f and (ROOT / f.decode()).is_file())


@pytest.fixture(scope="module")
def kit(tmp_path_factory) -> dict:
    """The dry run's kit packed, its parts set up (the last one first), and its env.sh read."""
    base = tmp_path_factory.mktemp("gpu-kit")
    parts, home = base / "parts", base / "kit"
    env = {"PY": sys.executable, "SPECRAY_KIT": str(home)}
    packed = sh("scripts/gpu-kit.sh", "--cpu", "--fast", "--no-wheels", "--out", str(parts), env=env)
    assert packed.returncode == 0, packed.stderr
    folders = sorted(parts.iterdir())
    early = sh("scripts/gpu-kit-setup.sh", str(folders[-1]), env=env)  # a part alone: the others are awaited
    setups = [sh("scripts/gpu-kit-setup.sh", str(f), env=env) for f in folders[:-1]]
    # the environment a shell has after `source env.sh`, as the device call's command has it
    sourced = subprocess.run(["bash", "-c", 'source "$1" && env -0', "bash", str(home / "env.sh")],
                             capture_output=True, check=True).stdout.decode()
    kit_env = dict(item.split("=", 1) for item in sourced.split("\0") if "=" in item)
    return {"parts": folders, "packed": packed, "early": early, "setups": setups, "home": home, "env": kit_env,
            "base": base}


def test_parts_fit_a_device_call_beside_the_checkout(kit):
    budget = min(60 * MIB, 64 * MIB - tracked_bytes() - MIB)
    assert 2 <= len(kit["parts"]) <= 3  # SmolLM2 alone is more than one part
    for folder in kit["parts"]:
        piece = next(folder.glob("core.tar.xz.*"))
        assert piece.stat().st_size <= budget
        group, count, digest = (folder / "KIT").read_text().split()
        assert (group, int(count), len(digest)) == ("core", len(kit["parts"]), 64)
    assert "part(s) in" in kit["packed"].stderr and "gpu-kit-setup.sh" in kit["packed"].stderr


def test_setup_waits_for_every_part_then_lays_out_one_library_folder(kit):
    assert kit["early"].returncode == 3 and "send the others" in kit["early"].stderr
    assert [s.returncode for s in kit["setups"]] == [0] * len(kit["setups"]), kit["setups"][-1].stderr
    env = kit["env"]
    assert Path(env["SPECRAY_GPU_MODELS"], "SmolLM2-135M-Instruct.Q4_1.gguf").is_file()
    probe = ("import llama_cpp, specray.engine, specray.native.lib as lib; "
             "print(llama_cpp.__file__); print(specray.engine.__file__); "
             "print(sorted({p.rsplit('/', 1)[0] for ps in lib.LIBRARIES.values() for p in ps}))")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    pkg, engine, lib_dirs = out.stdout.splitlines()
    site = kit["home"] / "site"
    # the kit's llama_cpp (not the venv's), the checkout's code, every llama.cpp library from the kit's one folder
    assert pkg == str(site / "llama_cpp" / "__init__.py")
    assert engine == str(kit["home"] / "pkg" / "specray" / "engine" / "__init__.py")
    assert json.loads(lib_dirs.replace("'", '"')) == [str(site / "llama_cpp" / "lib")]
    # the engine's compiled cores, built there for the kit's Python
    assert "built engine/speculators/_suffix_core.c" in kit["setups"][-1].stderr
    assert "built engine/speculators/_ngram_core.c" in kit["setups"][-1].stderr
    assert "built engine/speculators/_ngram_mod_core.c" in kit["setups"][-1].stderr
    assert "built engine/policy/_estimate_core.c" in kit["setups"][-1].stderr


def test_measure_script_runs_every_step_with_small_counts(kit):
    out = kit["base"] / "out"
    env = kit["env"] | {"OUT": str(out), "MAX_TOKENS": "8", "CATS": "qa", "PER_MAX": "1", "THREADS": "2",
                        "SYNTH_PARAMS": "20M", "SYNTH_DIR": str(kit["base"] / "synth"), "SAMPLING_REPS": "3",
                        "SKIP": "hidden hop", "MEASURE_BUDGET_S": "900"}
    run = sh("scripts/gpu-measure.sh", env=env, timeout=1000)
    progress = (out / "progress.txt").read_text()
    assert run.returncode == 0, progress + run.stderr[-2000:]
    assert progress.rstrip().endswith("done")
    for name in ("s1", "s4", "s8", "s4_overlap", "s1_profile"):
        assert f"bench {name}: rc 0" in progress, name
    assert "synth: bench slots 1: rc 0" in progress and "synth: bench slots 4: rc 0" in progress
    for name in ("s1", "s4", "s8", "s1_profile", "synth_bench_s1", "synth_bench_s4"):
        assert json.loads((out / f"{name}.json").read_text())["configs"], name
    assert "synth: cost curve (SYNTHETIC) rc 0" in progress
    assert "backend sampling: rc 0" in progress
    assert "import order, numpy_first: rc=0" in progress
    assert "hidden: skipped (SKIP=hidden)" in progress
    overlap = json.loads((out / "s4_overlap.json").read_text())["configs"]
    assert {"none@overlap", "ngram_mod,suffix,ngram_cache@overlap"} <= set(overlap), overlap
    s1 = json.loads((out / "s1.json").read_text())
    assert {"none", "ngram_mod", "ngram_mod,suffix,ngram_cache"} <= set(s1["configs"])
    assert s1["meta"]["compiled_cores"] == dict.fromkeys(cores_in_use(), True)  # every core, built there
    assert (out / "results.tgz").stat().st_size > 0


def test_measure_script_skips_what_its_budget_cannot_hold(kit):
    out = kit["base"] / "out-budget"
    run = sh("scripts/gpu-measure.sh", env=kit["env"] | {"OUT": str(out), "MEASURE_BUDGET_S": "0"}, timeout=120)
    progress = (out / "progress.txt").read_text()
    assert run.returncode == 0
    assert " rc " not in progress and "rc=" not in progress  # nothing ran
    for step in ("imports", "s1", "s4", "s8", "sampling", "synth"):
        assert f"{step}: skipped, " in progress and "left of the run's budget" in progress, step


def test_pack_names_a_bad_flag_and_empties_no_folder_but_its_own(tmp_path):
    bad = sh("scripts/gpu-kit.sh", "--gpus")
    assert bad.returncode == 2 and "unknown option '--gpus'" in bad.stderr
    keep = tmp_path / "notes.txt"
    keep.write_text("mine")
    refused = sh("scripts/gpu-kit.sh", "--cpu", "--out", str(tmp_path))
    assert refused.returncode == 2 and "name a new folder" in refused.stderr and keep.read_text() == "mine"
