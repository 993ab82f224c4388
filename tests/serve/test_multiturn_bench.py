"""`specray bench --url URL --turns N` against the served app: conversations whose prompt grows every turn,
each turn with cache_prompt true and false (the field must be accepted), TTFT per request."""

from __future__ import annotations

import json

import httpx
import pytest

from specray.cli import main as cli

from .conftest import API_KEY, AUTH

TURNS = 4
MAX_TOKENS = 12


@pytest.mark.serve
@pytest.mark.model
def test_multiturn_bench_against_the_served_app(rel_server, tmp_path, capsys):
    out = tmp_path / "mt.json"
    before = httpx.get(f"{rel_server}/v1/stats", headers=AUTH, timeout=30).json()["speculators"]["suffix"]
    rc = cli.main(["bench", "--url", rel_server, "--api-key", API_KEY, "--turns", str(TURNS), "--conversations",
                   "1", "--max-tokens", str(MAX_TOKENS), "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    print(printed)
    js = json.loads(out.read_text())
    assert js["kind"] == "specray-multiturn-bench" and js["meta"]["turns"] == TURNS
    (target,) = js["targets"]
    assert target["label"] == "specray colocated" and target["url"] == rel_server
    (conv,) = target["conversations"]
    assert [r["turn"] for r in conv] == list(range(1, TURNS + 1))
    prompt = [r["prompt_tokens"] for r in conv]
    for t, r in enumerate(conv):
        for arm in ("on", "off"):
            a = r[arm]
            assert a["ttft_ms"] > 0 and a["seconds"] * 1000 >= a["ttft_ms"]
            assert a["prompt_tokens"] == prompt[t], "cache on and off send the very same messages"
            assert 0 < a["completion_tokens"] <= MAX_TOKENS and a["text"]
            assert a["cached_tokens"] is None or 0 <= a["cached_tokens"] < prompt[t]
            # the server's own split of the time to first token, from its stages: inside the client's wait
            assert a["server_prompt_ms"] > 0 and a["server_queue_ms"] >= 0
            assert a["server_prompt_ms"] + a["server_queue_ms"] <= a["ttft_ms"]
        if t:  # the history carries the previous answer and a new user message
            assert prompt[t] > prompt[t - 1] + conv[t - 1]["on"]["completion_tokens"] // 2
    rows = target["turns"]
    assert [r["turn"] for r in rows] == list(range(1, TURNS + 1)) and [r["prompt_tokens"] for r in rows] == prompt
    assert all(r["ratio"] > 0 for r in rows)
    assert target["summary"]["last_turn"] == TURNS and target["summary"]["ratio"] == rows[-1]["ratio"]
    assert target["summary"]["requests_per_arm"] == TURNS
    assert f"turn {TURNS}: TTFT cache off / on" in printed
    # every later turn's prompt starts with everything the last turn's suffix trie held (its prompt and answer, as
    # the server tokenised them): the speculator continued that trie instead of inserting the history again
    after = httpx.get(f"{rel_server}/v1/stats", headers=AUTH, timeout=30).json()["speculators"]["suffix"]
    assert after["continued"] - before["continued"] >= TURNS - 1, (before, after)
    assert after["continued_tokens"] - before["continued_tokens"] >= sum(prompt[:-1])
