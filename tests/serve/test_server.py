"""The app over real HTTP, in both deployment modes, with the official openai client."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from .conftest import (
    CHAT_PROMPTS,
    COMPLETION_PROMPTS,
    CONCURRENT_MAX_TOKENS,
    ENGINE,
    MAX_TOKENS,
    N_CONCURRENT,
    concurrent_prompts,
)

pytestmark = [pytest.mark.serve, pytest.mark.model]

SPEC_KEYS = {"drafts", "drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_acceptance_length",
             "by_speculator"}


@pytest.fixture(scope="module")
def client(server):
    _, base = server
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=300, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    _, base = server
    with httpx.Client(base_url=base, timeout=300) as c:
        yield c


def test_health_models_stats(http, server):
    mode, _ = server
    r = http.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "smollm2-135m"
    st = http.get("/v1/stats").json()
    assert st["mode"] == mode and st["slots"] == ENGINE["slots"] and st["n_ctx"] == ENGINE["n_ctx"]
    assert 0 < st["n_ctx_seq"] <= st["n_ctx"]  # exact mode: one KV stream per slot
    if mode == "distributed":
        # the target and companion actors live in the replica's own (STRICT_PACK) placement group
        pl = st["placement"]
        assert pl["strategy"] == "STRICT_PACK"
        pg = pl["replica"]["placement_group_id"]
        assert pg and pl["target"]["placement_group_id"] == pg == pl["companion"]["placement_group_id"]
        # the bundles carried the GPUs the actors asked for (logical GPUs: llama.cpp offloads nothing here)
        assert len(pl["target"]["gpu_ids"]) == 1 and len(pl["companion"]["gpu_ids"]) == 1
        assert pl["target"]["n_gpu_layers"] == 0 and pl["target"]["gpu_split"]["split_mode"] == "layer"
        assert st["target"]["where"] == "actor"
        assert st["companion"]["calls"] == 0  # model-free chain: the companion is not called per round
        # each serving process froze what its start-up left out of the garbage collector (ServeConfig.freeze_gc)
        assert st["process"]["gc"]["frozen"] > 10_000
        assert st["target"]["gc"]["frozen"] > 10_000 and st["companion"]["gc"]["frozen"] > 10_000
        # calibrated in the target actor (ENGINE there has calibrate on): the batch-size table from 1 to 32
        # rows and what attending a longer context adds, which the verify price of a long sequence needs
        assert {1, 8, 32} <= {int(n) for n in st["cost_table"]} and st["attention_ns_per_token_cell"] > 0


def test_one_thread_does_every_decode(http, client):
    """Set-up (calibration) and rounds decode on one thread of the process that holds the target: with a second
    live thread that once decoded, libgomp throttles its barriers and 2-thread decodes ran at half speed."""
    client.completions.create(model="smollm2-135m", prompt="One thread", max_tokens=4, temperature=0)
    st = http.get("/v1/stats").json()
    assert st["target"]["rounds"] > 0 and st["target"]["decode_threads"] == 1
    assert st["target"]["flash_attn"] is False  # as the context was made: exact mode (ENGINE) keeps it off


@pytest.mark.parametrize("prompt", COMPLETION_PROMPTS)
def test_completion_matches_engine(client, reference, prompt):
    text, n, finish = reference[("completion", prompt, MAX_TOKENS)]
    r = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == text
    assert r.choices[0].finish_reason == finish
    assert r.usage.completion_tokens == n
    assert r.usage.total_tokens == r.usage.prompt_tokens + n
    spec = r.model_extra["speculative"]
    assert SPEC_KEYS <= set(spec)

    chunks = list(client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].choices[0].finish_reason == finish
    assert chunks[-1].usage.completion_tokens == n


@pytest.mark.parametrize("prompt", CHAT_PROMPTS)
def test_chat_matches_engine(client, reference, prompt):
    text, n, finish = reference[("chat", prompt, MAX_TOKENS)]
    msgs = [{"role": "user", "content": prompt}]
    r = client.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == finish
    assert r.usage.completion_tokens == n

    stream = client.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n  # OpenAI's include_usage shape
    assert SPEC_KEYS <= set(chunks[-1].model_extra["speculative"])


def test_speculation_drafts_and_per_request_control(client, reference):
    prompt = COMPLETION_PROMPTS[1]  # repetitive: the n-gram speculators draft and get accepted
    text, n, _ = reference[("completion", prompt, MAX_TOKENS)]
    r = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    spec = r.model_extra["speculative"]
    assert r.choices[0].text == text
    assert spec["drafts"] > 0 and spec["accepted_tokens"] > 0 and spec["mean_acceptance_length"] > 1.0
    assert set(spec["by_speculator"]) <= {"ngram_mod", "suffix"}

    off = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"speculative": {"enabled": False}})
    assert off.choices[0].text == text and off.model_extra["speculative"]["drafts"] == 0

    other = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"speculative": {"chain": "ngram_simple", "n_max": 4}})
    assert other.choices[0].text == text
    assert set(other.model_extra["speculative"]["by_speculator"]) <= {"ngram_simple"}


def test_stats_break_the_round_down_by_stage(http, server):
    # each stage's ms per round, host time per round and per decoding sequence, the speculators' look-up cost,
    # and the host costs the planner prices (engine/round_stages.py, host_cost.py)
    mode, _ = server
    r = http.post("/v1/completions", json={"prompt": COMPLETION_PROMPTS[1], "max_tokens": MAX_TOKENS,
                                            "temperature": 0})
    assert r.status_code == 200
    st = http.get("/v1/stats").json()
    rs, sched = st["round_stages"], st["scheduler"]
    assert set(rs["ms_per_round"]) >= {"admit", "draft", "decode", "verify", "target_rest", "accept", "emit"}
    assert sum(rs["ms_per_round"].values()) == pytest.approx(1e3 * sched["round_seconds"] / sched["rounds"])
    assert 0 < rs["host_ms_per_round"] < sum(rs["ms_per_round"].values())
    assert rs["host_ms_per_seq_round"] > 0 and {"ngram_mod", "suffix"} <= set(rs["speculator_ms_per_ask"])
    if mode == "distributed":  # the hop to the target actor is host time of the round, outside its decode
        assert rs["ms_per_round"]["target_rest"] > 0.3
    assert st["host_cost"]["rounds_seen"] > 0 and st["host_cost"]["ms_per_round"] >= 0


def test_stop_and_seeded_sampling(client):
    r = client.completions.create(model="smollm2-135m", prompt=COMPLETION_PROMPTS[1], max_tokens=MAX_TOKENS,
                                  temperature=0, stop=["banana"])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == " apple, "
    # a seed makes sampling reproducible when the draft path is the same: with speculation off. (With drafts,
    # the uniforms consumed depend on the drafts, and the speculators learn across requests.)
    kw = dict(model="smollm2-135m", prompt="Once upon a time", max_tokens=16, temperature=0.9, top_p=0.95, seed=7,
              extra_body={"speculative": {"enabled": False}})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text and a.usage.completion_tokens > 0
    kw["extra_body"] = {"speculative": {"chain": "ngram_mod,suffix"}}
    c = client.completions.create(**kw)
    assert c.usage.completion_tokens > 0 and c.choices[0].finish_reason in ("stop", "length")


def _stream_chat(base: str, prompt: str, out: dict, key: int) -> None:
    try:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=300, max_retries=0)
        parts, finish = [], None
        for ch in c.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": prompt}],
                                            max_tokens=CONCURRENT_MAX_TOKENS, temperature=0, stream=True):
            if ch.choices:
                parts.append(ch.choices[0].delta.content or "")
                finish = ch.choices[0].finish_reason or finish
        out[key] = ("".join(parts), finish)
    except Exception as e:  # reported by the assertion below
        out[key] = e


def test_concurrent_streams_match_solo_and_share_decodes(server, http, reference):
    _, base = server
    before = http.get("/v1/stats").json()["target"]
    prompts = concurrent_prompts()
    assert len(prompts) == N_CONCURRENT
    out: dict = {}
    threads = [threading.Thread(target=_stream_chat, args=(base, p, out, i)) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    dt = time.perf_counter() - t0
    for i, p in enumerate(prompts):
        res = out.get(i)
        assert not isinstance(res, Exception) and res is not None, res
        text, _, finish = reference[("chat", p, CONCURRENT_MAX_TOKENS)]
        assert res == (text, finish), f"stream {i} differs from its solo output"
    after = http.get("/v1/stats").json()
    tgt = after["target"]
    # the target's batches held several sequences at once (counted in the target actor / runner)
    assert tgt["multi_seq_decodes"] > before["multi_seq_decodes"]
    assert tgt["max_seqs_in_decode"] >= 2
    print(f"\n{after['mode']}: {N_CONCURRENT} streams in {dt:.1f}s; target {tgt}; hop {after.get('hop')}")


BAD = [
    # (path, raw body, expected status, words the message must contain)
    ("/v1/completions", "{not json", 400, "malformed json"),
    ("/v1/chat/completions", '{"messages": [', 400, "malformed json"),
    ("/v1/chat/completions", json.dumps({"model": "x", "max_tokens": 5}), 400, "messages"),
    ("/v1/chat/completions", json.dumps({"messages": []}), 400, "messages"),
    ("/v1/completions", json.dumps({"max_tokens": 5}), 400, "prompt"),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 0}), 400, "max_tokens"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}), 400,
     "max_tokens"),
    ("/v1/completions", json.dumps({"prompt": "hi", "speculative": {"chain": "ngram_mod,warp_drive"}}), 400,
     "unknown speculator"),
    ("/v1/completions", json.dumps({"prompt": "hi", "speculative": {"chain": ["nope"]}, "stream": True}), 400,
     "unknown speculator"),
    ("/v1/completions", json.dumps({"prompt": "hello " * 2100, "max_tokens": 8}), 400, "context"),
    ("/v1/completions", json.dumps({"prompt": "hello " * 1000, "max_tokens": 1500}), 400, "context"),
    ("/v1/completions", json.dumps({"prompt": "hi", "n": 99}), 400, "n must be in"),
    ("/v1/completions", json.dumps({"prompt": "hi", "temperature": "hot"}), 400, "temperature"),
    ("/v1/completions", json.dumps({"prompt": ["a", "b"]}), 400, "one prompt"),
    ("/v1/completions", json.dumps({"prompt": ""}), 400, "empty"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}), 400, "role"),
    ("/v1/nope", "{}", 404, "not found"),
]


def test_bad_requests_get_openai_errors_and_server_keeps_serving(http, client, reference):
    for path, body, status, words in BAD:
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == status, (path, body[:80], r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert words in err["message"].lower(), (body[:80], err)
        assert err["type"] == ("invalid_request_error" if status == 400 else "not_found_error")
    # the official client maps them to its exceptions, message included
    with pytest.raises(openai.BadRequestError, match="unknown speculator"):
        client.completions.create(model="smollm2-135m", prompt="hi", max_tokens=4,
                                  extra_body={"speculative": {"chain": "nope"}})
    # still serving, and still exact
    prompt = COMPLETION_PROMPTS[0]
    text, _, _ = reference[("completion", prompt, MAX_TOKENS)]
    r = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == text
    assert http.get("/health").status_code == 200


def test_client_disconnect_frees_the_slot(server, http):
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 400,
            "temperature": 0, "stream": True, "speculative": {"enabled": False}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i >= 3:
                break  # hang up mid-stream
    deadline = time.time() + 60
    while time.time() < deadline:
        st = http.get("/v1/stats").json()
        if st["active"] == 0 and st["queued"] == 0:
            break
        time.sleep(0.5)
    assert st["active"] == 0 and st["queued"] == 0, st


def _converse(client, turns: list[str], cache_prompt: bool, answers: list[str] | None = None):
    """One chat, turn by turn: [(answer, usage)]; `answers` (another run's) make the history instead."""
    messages: list[dict] = []
    out = []
    for t, user in enumerate(turns):
        messages.append({"role": "user", "content": user})
        r = client.chat.completions.create(model="x", messages=messages, max_tokens=24, temperature=0,
                                           extra_body={"cache_prompt": cache_prompt})
        out.append((r.choices[0].message.content, r.usage))
        messages.append({"role": "assistant", "content": answers[t] if answers else out[-1][0]})
    return out


def test_multi_turn_chat_reuses_the_prompt_cache_with_the_same_output(server, client, http):
    # two conversations at once, three turns each: with the cache (the default) every turn after the first finds
    # the previous turn's prompt in its slot's KV and reports it as usage.prompt_tokens_details.cached_tokens;
    # the answers are the same as with cache_prompt: false (exact mode: token-identical)
    convs = [["Name a fruit.", "What colour is it?", "Say that in French."],
             ["Name a planet.", "How far is it from the sun?", "Say that in one word."]]
    results: dict = {}

    def run(i: int, cache: bool, answers=None):
        results[i, cache] = _converse(client, convs[i], cache, answers)

    for cache in (False, True):
        threads = [threading.Thread(target=run, args=(i, cache, [a for a, _ in results[i, False]] if cache else None))
                   for i in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=600)
    for i in range(2):
        off, on = results[i, False], results[i, True]
        assert [a for a, _ in on] == [a for a, _ in off], f"conversation {i} changed with the prompt cache"
        assert all(u.prompt_tokens_details.cached_tokens == 0 for _, u in off)
        for t in range(1, 3):
            assert on[t][1].prompt_tokens_details.cached_tokens >= on[t - 1][1].prompt_tokens, (i, t, on[t][1])
    pc = http.get("/v1/stats").json()["prompt_cache"]
    assert pc["enabled"] and pc["hits"] >= 4 and pc["reused_tokens"] > 0, pc
    # streamed, the final usage chunk says it too
    stream = client.chat.completions.create(model="x", messages=[{"role": "user", "content": convs[0][0]}],
                                            max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details.cached_tokens > 0, usage
