"""The agent bench's pure parts (its shared system prompt, percentiles, per-server summary, ratios), its
conversation loop on a stand-in for the HTTP request, and the flag checks of `specray bench --agents`."""

from __future__ import annotations

import doctest
import threading

import pytest

from specray.bench import agents
from specray.cli import main as cli

from ..conftest import SPEC_BENCH


def test_doctests():
    failed, attempted = doctest.testmod(agents)
    assert attempted > 0 and failed == 0


@pytest.mark.parametrize("tokens", [300, 1600, 4000])
def test_system_prompt_is_deterministic_and_roughly_sized(tokens):
    p = agents.system_prompt(tokens)
    assert p == agents.system_prompt(tokens)
    assert abs(agents.approx_tokens(p) - tokens) <= 0.2 * tokens
    assert "# Tools" in p and "# Rules" in p and p.count('"name": ') >= 2


def test_system_prompt_grows_its_catalogue_with_the_size():
    small, large = agents.system_prompt(300), agents.system_prompt(3000)
    names = lambda p: [line.split('"')[3] for line in p.splitlines() if line.startswith('{"name": ')]  # noqa: E731
    assert names(large)[: len(names(small))] == names(small) and len(names(large)) > len(names(small))
    assert len(set(names(agents.system_prompt(20000)))) == len(names(agents.system_prompt(20000)))  # no repeats


def test_percentile_matches_numpy_linear():
    import numpy as np

    vals = [5.0, 1.0, 9.0, 3.0, 7.5, 2.0]
    for q in (0, 10, 50, 90, 100):
        assert agents.percentile(vals, q) == pytest.approx(float(np.percentile(vals, q)), abs=1e-3)


def test_summarize_splits_first_and_later_turns():
    recs = [{"agent": a, "turn": t, "ttft_ms": ttft, "prompt_tokens": p, "cached_tokens": c, "completion_tokens": 5}
            for a, t, ttft, p, c in [(0, 1, 400.0, 1000, 0), (1, 1, 600.0, 1010, 990), (0, 2, 50.0, 1100, 1000),
                                     (1, 2, 70.0, 1120, 1100), (0, 3, None, 1200, 1150)]]
    s = agents.summarize(recs + [{"agent": 1, "turn": 3, "error": "RuntimeError: x"}], 5.0)
    assert (s["requests"], s["errors"], s["completion_tokens"], s["tokens_per_s"]) == (6, 1, 25, 5.0)
    assert s["first"]["requests"] == 2 and s["first"]["ttft_p50_ms"] == 500.0 and s["first"]["ttft_p90_ms"] == 580.0
    later = s["later"]
    assert later["requests"] == 3 and later["ttft_p50_ms"] == 60.0  # the answer without content has no TTFT
    assert later["cached_tokens_median"] == 1100 and later["prompt_tokens_median"] == 1120
    assert later["cached_share"] == round((1000 + 1100 + 1150) / (1100 + 1120 + 1200), 3)
    empty = agents.summarize([], 0.0)
    assert empty["tokens_per_s"] is None and empty["later"]["ttft_p50_ms"] is None


def test_summarize_gives_the_servers_own_split_of_the_time_to_first_token():
    """specray's records carry a queue and a prompt time, llama-server's a prompt time only; a server that
    reports neither gets None, not 0."""
    rec = lambda t, prompt, queue: {"turn": t, "ttft_ms": 900.0, "prompt_tokens": 10, "cached_tokens": 5,  # noqa: E731
                                    "completion_tokens": 1, "server_prompt_ms": prompt, "server_queue_ms": queue}
    later = agents.summarize([rec(2, 600.0, 40.0), rec(2, 800.0, 300.0), rec(3, 700.0, 60.0), rec(1, 5000.0, 1.0)],
                             1.0)["later"]
    assert (later["server_prompt_p50_ms"], later["server_queue_p50_ms"]) == (700.0, 60.0)
    assert later["server_prompt_p90_ms"] == 780.0 and later["server_queue_p90_ms"] == 252.0
    llama = agents.summarize([rec(2, 500.0, None)], 1.0)["later"]
    assert llama["server_prompt_p50_ms"] == 500.0 and llama["server_queue_p50_ms"] is None
    silent = agents.summarize([rec(2, None, None)], 1.0)["later"]
    assert silent["server_prompt_p50_ms"] is None and silent["server_queue_p90_ms"] is None


def test_summarize_without_cached_tokens_reported():
    s = agents.summarize([{"turn": 2, "ttft_ms": 1.0, "prompt_tokens": 10, "cached_tokens": None,
                           "completion_tokens": 1}], 1.0)
    assert s["later"]["cached_share"] is None and s["later"]["cached_tokens_median"] is None


def test_agent_users_distinct_and_error_names_the_flags():
    users = agents.agent_users(str(SPEC_BENCH), 8, 3)
    assert [len(u) for u in users] == [3] * 8 and len({m for u in users for m in u}) == 24
    with pytest.raises(ValueError, match=r"fewer --agents or --turns"):
        agents.agent_users(str(SPEC_BENCH), 60, 3)  # 80 two-turn entries, two a conversation: 40 at most


def test_run_server_sends_history_and_answers_concurrently(monkeypatch):
    """request_turn stood in for: every turn carries the shared system prompt and the conversation's own earlier
    answers; conversations overlap up to the concurrency; a failed request ends its conversation."""
    seen: list[list[dict]] = []
    active, peak = [0], [0]
    lock = threading.Lock()

    def fake_request_turn(server, messages, max_tokens, cache_prompt, extra=None):
        if messages[-1]["content"] == "Say hello.":
            return {"text": "hi"}
        with lock:
            seen.append(messages)
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        threading.Event().wait(0.01)
        with lock:
            active[0] -= 1
        if messages[-1]["content"] == "c2":
            raise RuntimeError("HTTP 500")
        return {"ttft_ms": 1.0, "seconds": 0.01, "prompt_tokens": 10 * len(messages), "completion_tokens": 2,
                "cached_tokens": 0, "server_prompt_ms": None, "text": "ans:" + messages[-1]["content"]}

    monkeypatch.setattr(agents, "request_turn", fake_request_turn)
    users = [["a1", "a2", "a3"], ["b1", "b2", "b3"], ["c1", "c2", "c3"]]
    res = agents.run_server("http://127.0.0.1:1", "SYS", users, 2, 8)
    assert peak[0] == 2
    b3 = next(m for m in seen if m[-1]["content"] == "b3")
    assert [m["content"] for m in b3] == ["SYS", "b1", "ans:b1", "b2", "ans:b2", "b3"]
    assert all(m[0] == {"role": "system", "content": "SYS"} for m in seen)
    assert [(r["agent"], r["turn"], "error" in r) for r in res["records"]] == [
        (0, 1, False), (0, 2, False), (0, 3, False), (1, 1, False), (1, 2, False), (1, 3, False),
        (2, 1, False), (2, 2, True)]
    assert res["summary"]["errors"] == 1 and res["summary"]["requests"] == 8
    assert "text" not in res["records"][0]


@pytest.mark.parametrize("argv, message", [
    (["--agents", "4"], "--agents benches running servers: give --url URL"),
    (["--concurrency", "2", "--url", "http://127.0.0.1:1"], "--concurrency is for the agent bench"),
    (["--system-tokens", "500", "--url", "http://127.0.0.1:1"], "--system-tokens is for the agent bench"),
    (["--url", "http://127.0.0.1:1", "--agents", "--conversations", "2"], "--conversations is for the multi-turn"),
    (["--url", "http://127.0.0.1:1", "--agents", "--streams", "2"], "--streams does not apply to the agent bench"),
    (["--url", "http://127.0.0.1:1", "--agents", "--http"], "--http does not apply to the agent bench"),
])
def test_bench_agents_flag_errors(argv, message, capsys):
    assert cli.main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--agents", "--concurrency", "--system-tokens"])
def test_bench_agents_counts_must_be_positive(flag, capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--url", "http://127.0.0.1:1", "--agents", "2", flag, "0"])
    assert f"{flag} must be >= 1" in capsys.readouterr().err


def test_bench_agents_flag_defaults():
    args = cli.build_parser().parse_args(["bench", "--url", "http://h:1", "--agents"])
    assert (args.agents, args.turns, args.concurrency, args.system_tokens) == (8, None, None, None)
    args = cli.build_parser().parse_args(["bench", "--url", "http://h:1", "--agents", "16", "--turns", "2"])
    assert (args.agents, args.turns) == (16, 2)
