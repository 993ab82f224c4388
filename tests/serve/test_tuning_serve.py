"""Online tuning served (ChainConfig.tune): requests name their class in `speculative.tune_class`, /v1/stats
`tuning` shows each speculator's current choice per class, and output is what the `reference` engine (target
only) gives, tuning or not (exact mode)."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import pytest

from .conftest import COMPLETION_PROMPTS, ENGINE, MAX_TOKENS, deploy

pytestmark = [pytest.mark.serve, pytest.mark.model]


@pytest.fixture(scope="module")
def tuned(ray_serve):
    from ray import serve

    engine = ENGINE | {"chain": {"tune": True, "params": {"suffix": {"p_min": 0.9, "min_match": 16}}}}
    base = deploy(ray_serve, "tuned", {"mode": "colocated", "engine": engine})
    try:
        yield base
    finally:
        serve.delete("tuned")


def _complete(base: str, prompt: str, cls: str | None) -> dict:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    if cls:
        body["speculative"] = {"tune_class": cls}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_classes_are_tuned_apart_and_output_is_unchanged(tuned, reference):
    prompts = [(p, "copy") for p in COMPLETION_PROMPTS] * 3 + [(p, None) for p in COMPLETION_PROMPTS]
    with cf.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda pc: _complete(tuned, *pc), prompts))
    for (p, _), out in zip(prompts, outs):
        assert out["choices"][0]["text"] == reference[("completion", p, MAX_TOKENS)][0], p
    st = httpx.get(f"{tuned}/v1/stats", timeout=60).json()
    tuning = st["tuning"]
    assert set(tuning["suffix"]) == {"copy", "default"}, tuning["suffix"].keys()
    copy = tuning["suffix"]["copy"]
    assert copy["choice"]["p_min"] in [s["params"]["p_min"] for s in copy["settings"]]
    assert sum(s["rounds"] for s in copy["settings"]) > 0 and copy["settings"][0]["params"]["p_min"] == 0.9
    # every setting was judged side by side (shadow look-ups), each with a gain per round
    assert copy["judged"] > 0 and copy["shadow_seconds"] > 0, copy
    assert all(s["gain_per_round"] is not None for s in copy["settings"]), copy


def test_a_bad_tune_class_is_a_400(tuned):
    r = httpx.post(f"{tuned}/v1/completions", timeout=60,
                   json={"prompt": "x", "max_tokens": 2, "speculative": {"tune_class": "no spaces allowed"}})
    assert r.status_code == 400 and "tune_class" in r.text, r.text
