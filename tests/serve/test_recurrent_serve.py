"""A hybrid (recurrent + attention) target served over HTTP with speculation on.

The synthetic LFM2 model (native/synthetic_gguf.py) in the distributed layout, 4 slots: the target actor rolls
rejected drafts back by checkpoint (save, restore, replay; engine/rollback.py). Completions through the
`openai` client, several at once, must equal the same requests with `speculative: {"enabled": false}`, and the
counters must show that rollbacks happened.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from .conftest import deploy

pytestmark = [pytest.mark.serve]

PROMPTS = ["one two three one two three one two three one two",
           "red green blue red green blue red green",
           "def f(x): return x\ndef g(x): return x\ndef h(x):",
           "The capital of France is"]
MAX_TOKENS = 40
ENGINE = {"n_ctx": 2048, "slots": 4, "threads": 2, "calibrate": False,
          "chain": {"speculators": ["ngram_simple", "suffix"], "policy": "first", "n_max": 8,
                    "params": {"ngram_simple": {"size_n": 2, "size_m": 8}, "suffix": {"min_match": 1, "p_min": 0.01}}}}


@pytest.fixture(scope="module")
def hybrid(ray_serve, tmp_path_factory):
    from ray import serve

    from specray.native.synthetic_gguf import write_hybrid_target

    path = write_hybrid_target(str(tmp_path_factory.mktemp("hybrid") / "lfm2.gguf"))
    base = deploy(ray_serve, "hybrid", {"mode": "distributed", "engine": ENGINE | {"model": path},
                                        "served_model_name": "lfm2-synthetic"})
    try:
        yield base
    finally:
        serve.delete("hybrid")


def test_hybrid_target_serves_speculation_identical_to_plain(hybrid):
    client = openai.OpenAI(base_url=f"{hybrid}/v1", api_key="none", max_retries=0, timeout=120)

    def complete(prompt: str, spec: bool):
        extra = {"ignore_eos": True} | ({} if spec else {"speculative": {"enabled": False}})
        return client.completions.create(model="lfm2-synthetic", prompt=prompt, max_tokens=MAX_TOKENS,
                                         temperature=0, extra_body=extra)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # several sequences share the target's rounds
        plain = list(pool.map(lambda p: complete(p, False), PROMPTS))
        spec = list(pool.map(lambda p: complete(p, True), PROMPTS))
    for p, a, b in zip(PROMPTS, plain, spec):
        assert b.choices[0].text == a.choices[0].text, p
        assert b.usage.completion_tokens == MAX_TOKENS
        assert a.model_extra["speculative"]["drafts"] == 0
    assert sum(r.model_extra["speculative"]["drafts"] for r in spec) > 0

    with httpx.Client(base_url=hybrid, timeout=30) as http:
        stats = http.get("/v1/stats").json()
        models = http.get("/v1/models").json()
        health = http.get("/health").json()
    # no context shift; no branch ids, as a recurrent state cannot hold a draft tree; no attention tile pads, whose
    # cells are dropped after the decode (a recurrent state cannot drop rows)
    memory = {"kind": "hybrid", "rollback": "checkpoint", "n_rs_seq": 0, "can_shift": False, "tree_seqs": 0,
              "attention_tile": 0}
    assert models["data"][0]["memory"] == memory
    assert health["target_memory"] == memory
    rb = stats["scheduler"]["rollback"]
    assert rb["rollbacks"] > 0 and rb["restores"] == rb["rollbacks"] and rb["replay_rows"] > 0
    assert stats["scheduler"]["failed_sequences"] == 0
    assert stats["target_memory"]["rollback_price"]["mode"] == "checkpoint"
