"""On a GPU (a CUDA build of llama.cpp with a device): offload, the import-order crash, lossless speculation.

Skipped where llama.cpp cannot offload (CI, the CPU machines). On the GPU machine, after the offline recipe
(../shared/gpu/README.md): `SPECRAY_TEST_MODEL=/path/SmolLM2.gguf python3 -m pytest -q -m gpu tests/gpu`
(SPECRAY_TEST_MODEL where the packaged alias is not installed; the prompts are the shipped Spec-Bench).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specray.native import lib

from ..conftest import spec_bench_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not lib.gpu_offload(), reason="llama.cpp sees no GPU here")]

MODEL = os.environ.get("SPECRAY_TEST_MODEL", "smollm2-135m")


@pytest.fixture(scope="module")
def model():
    from specray.native.model import Model

    return Model(MODEL)


def test_every_layer_is_offloaded_by_default(model):
    assert model.n_gpu_layers == lib.ALL_LAYERS


def test_a_model_loads_after_numpy_linalg_was_imported():
    # on the GPU image, numpy.linalg (scipy-openblas) imported before llama.cpp's CUDA libraries crashed
    # llama_model_load_from_file with a segfault; specray's own imports must not depend on that order
    code = f"import numpy.linalg; from specray.native.model import Model; print(Model({MODEL!r}).n_gpu_layers)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])


def test_numpy_first_still_maps_one_copy_of_each_ggml_library_cuda_included_from_one_folder():
    # the suspected cause of the import-order crash: llama_cpp/lib's libllama with its ggml libraries loaded
    # through a RUNPATH into another folder (native/shared_libs.py refuses that at import, naming the paths)
    code = ("import numpy.linalg; from specray.native import lib; "
            "print(sorted((k, v[0]) for k, v in lib.LIBRARIES.items()))")
    env = {k: v for k, v in os.environ.items() if k != "SPECRAY_ALLOW_MIXED_GGML"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    print("\n" + out.stdout)
    assert "libggml-cuda" in out.stdout


@pytest.mark.parametrize("shape", ["exact", "bucketed"])
def test_greedy_speculation_on_the_gpu_diverges_only_at_near_ties(model, shape):
    # CUDA kernels are not batch-invariant either: held to the near-tie rule, like fast mode on a CPU
    from specray.bench.divergence import classify_divergence
    from specray.bench.run import measure_batch_variance, measure_layout_variance
    from specray.deployments.local_engine import LocalEngine
    from specray.engine.config import ChainConfig, EngineConfig

    cfg = EngineConfig(model=MODEL, slots=4, n_ctx=4096, record_margins=True, calibrate=False, verify_shape=shape,
                       chain=ChainConfig(speculators=[], policy="first", n_max=8))
    eng = LocalEngine(cfg, model=model)
    try:
        prompts = spec_bench_prompts(8)
        prefix = eng.prompt_tokens(messages=[{"role": "user", "content": prompts[0]}])
        tie_bound = 2.0 * max(measure_batch_variance(eng, prefix), measure_layout_variance(eng, prefix))

        def run(chain):
            return eng.run([eng.request(messages=[{"role": "user", "content": p}], max_tokens=64, chain=chain)
                            for p in prompts])

        base, spec = run(()), run(("ngram_mod", "suffix", "ngram_cache"))
        assert sum(s.spec_total.accepted for s in spec) > 0
        kinds = [classify_divergence(b.generated, s.generated, b.margins, tie_bound) for b, s in zip(base, spec)]
        print(f"\nGPU, {shape} shapes: tie bound {tie_bound:.3f}, outcomes {kinds}")
        assert "mismatch" not in kinds
    finally:
        eng.close()
