"""The multi-turn bench's pure parts (conversations, turns, cached tokens, per-turn medians, tables), the HTTP
bench's degraded table for servers without /v1/stats, and the flag checks of `specray bench --turns`."""

from __future__ import annotations

import doctest
import importlib.util
import json
from pathlib import Path

import pytest

from specray.bench import http_client, http_compare, multiturn
from specray.cli import main as cli

from ..conftest import SPEC_BENCH

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", [multiturn, http_client])
def test_doctests(module):
    failed, attempted = doctest.testmod(module)
    assert attempted > 0 and failed == 0


def test_spec_bench_prompts_script_doctests_and_output(tmp_path):
    spec = importlib.util.spec_from_file_location("spec_bench_prompts", REPO / "scripts" / "spec-bench-prompts.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    failed, attempted = doctest.testmod(mod)
    assert attempted > 0 and failed == 0
    out = tmp_path / "p.jsonl"
    assert mod.main([str(out), "20", "64", str(SPEC_BENCH)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 20 and all(d["output_tokens_count"] == 64 and d["prompt"] for d in lines)
    assert len({d["category"] for d in lines}) == 13  # round-robin: every Spec-Bench category before a repeat


def test_spec_bench_six_turn_conversations():
    entries = multiturn.load_multiturn(str(SPEC_BENCH))
    assert len(entries) == 80 and all(len(e) == 2 for e in entries)  # MT-bench's 80 two-turn questions
    convs = multiturn.chain_turns(entries, 6, 3)
    assert [len(c) for c in convs] == [6, 6, 6]
    assert convs[0][:2] == entries[0] and convs[0][4:] == entries[2] and convs[1][:2] == entries[3]
    assert len({u for c in convs for u in c}) == 18  # no user message shared between conversations
    with pytest.raises(ValueError, match="ran out"):
        multiturn.chain_turns(entries, 6, 27)  # 80 entries x 2 turns = 26 six-turn conversations


def test_load_multiturn_needs_turns(tmp_path):
    p = tmp_path / "single.jsonl"
    p.write_text('{"prompt": "hi"}\n{"turns": ["only one"]}\n')
    with pytest.raises(ValueError, match="two or more 'turns'"):
        multiturn.load_multiturn(str(p))


def test_turn_messages_history_grows_by_one_exchange():
    users, answers = ["u1", "u2", "u3"], ["a1", "a2"]
    lens = [len(multiturn.turn_messages(users, answers, t)) for t in range(3)]
    assert lens == [1, 3, 5]
    assert [m["role"] for m in multiturn.turn_messages(users, answers, 2)] == [
        "user", "assistant", "user", "assistant", "user"]
    with pytest.raises(ValueError, match="earlier answers"):
        multiturn.turn_messages(users, ["a1"], 2)


def _rec(turn, prompt, on, off, cached):
    return {"turn": turn, "prompt_tokens": prompt, "same_answer": True,
            "on": {"ttft_ms": on, "cached_tokens": cached}, "off": {"ttft_ms": off, "cached_tokens": 0}}


def test_summarize_and_table_per_turn():
    convs = [[_rec(1, 50, 30.0, 31.0, 20), _rec(2, 200, 20.0, 80.0, 180)],
             [_rec(1, 60, 34.0, 35.0, 20), _rec(2, 220, 24.0, 100.0, 200)],
             [_rec(1, 55, 32.0, None, 20)]]  # a turn without a first token (None) drops out of the medians
    rows = multiturn.summarize_turns(convs)
    assert [r["conversations"] for r in rows] == [3, 2]
    assert rows[1] == {"turn": 2, "conversations": 2, "prompt_tokens": 210.0, "ttft_on_ms": 22.0,
                       "ttft_off_ms": 90.0, "ratio": 4.09, "cached_tokens_on": 190.0, "cached_tokens_off": 0.0}
    assert rows[0]["ttft_off_ms"] == 33.0
    text = multiturn.table({"label": "llama-server", "url": "u", "turns": rows})
    assert text.splitlines()[-1].split() == ["2", "210", "22.0", "90.0", "4.09x", "190", "0"]


def _row(label, **extra):
    return {"label": label, "mode": None, "streams": 1, "tokens_per_s": 50.0, "n_errors": 0,
            "vs_colocated": None, "vs_in_process": None, "mean_ttft_ms": 40.0} | extra


def test_http_table_drops_columns_no_server_reports():
    report = {"rows": [_row("llama-server", mean_acceptance_length=None)],
              "summary": http_compare.summarize([_row("llama-server")], [1])}
    header = http_compare.table(report).splitlines()[0].split()
    assert header == ["mode", "streams", "tok/s", "ttft", "ms", "errors"]
    both = {"rows": [_row("llama-server"), _row("colocated", mode="colocated", rounds=12, round_ms=9.5,
                                                 mean_acceptance_length=1.8)],
            "summary": http_compare.summarize([_row("x")], [1])}
    lines = http_compare.table(both).splitlines()
    assert "rounds" in lines[0] and "acc_len" in lines[0] and "hop" not in lines[0]
    assert lines[1].split()[:4] == ["llama-server", "1", "50.0", "-"]  # its missing figures show as "-"


def test_http_table_header_names_no_chain_or_slots_a_server_did_not_report():
    """`specray bench --url LLAMA_SERVER --no-in-process`: the header has what the server said (its model), and
    no chain or slots from an engine config that nothing loaded."""
    rows = [_row("llama-server")]
    meta = {"model": "m.gguf", "chain": None, "slots": None, "prompts": 8, "max_tokens": 128}
    header = http_compare.table({"rows": rows, "summary": http_compare.summarize(rows, [1]), "meta": meta})
    assert header.splitlines()[0] == "HTTP bench: m.gguf, chain the server's own, 8 prompts x 128 max tokens"
    meta |= {"chain": "ngram_mod,suffix", "slots": 4}
    header = http_compare.table({"rows": rows, "summary": http_compare.summarize(rows, [1]), "meta": meta})
    assert header.splitlines()[0] == "HTTP bench: m.gguf, chain ngram_mod,suffix, 8 prompts x 128 max tokens, slots 4"


def test_window_figures_and_aggregate_without_server_figures():
    assert http_client.window_figures(None, None) == {}
    agg = http_client.aggregate([{"seconds": 1.0, "ttft": 0.1, "tokens": 10, "speculative": None}], [], 1.0, 1)
    assert agg["tokens_per_s"] == 10.0 and agg["mean_acceptance_length"] is None and agg["drafted_tokens"] is None


@pytest.mark.parametrize("argv, message", [
    (["--turns", "6"], "give --url URL"),
    (["--conversations", "2"], "give --turns N too"),
    (["--url", "http://127.0.0.1:1", "--turns", "6", "--streams", "2"], "--streams does not apply"),
    (["--url", "http://127.0.0.1:1", "--turns", "6", "--http"], "--http does not apply"),
])
def test_bench_turns_flag_errors(argv, message, capsys):
    assert cli.main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_bench_turns_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--url", "http://127.0.0.1:1", "--turns", "0"])
    assert "--turns must be >= 1" in capsys.readouterr().err


def _sse_server(chunks: list[bytes], gap_s: float):
    """A local HTTP/1.1 server answering one POST with `chunks` as a chunked SSE stream, `gap_s` apart."""
    import http.server
    import threading
    import time

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i, c in enumerate(chunks):
                if i:
                    time.sleep(gap_s)
                self.wfile.write(b"%x\r\n%s\r\n" % (len(c), c))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_stream_times_each_object_by_its_arrival_though_it_parses_after():
    """Server.stream reads first and parses after, yet each object keeps the time its chunk came: a stream
    whose chunks come 0.1 s apart (one split mid-line, as TCP may) gives objects 0.1 s apart, in order."""
    chunks = [b'data: {"i": 0}\n\n', b'data: {"i": 1}\n\ndata: {"i"', b': 2}\n\n', b"data: [DONE]\n\n"]
    srv = _sse_server(chunks, 0.1)
    try:
        server = http_client.Server(f"http://127.0.0.1:{srv.server_address[1]}")
        objs = server.stream("/v1/completions", {"prompt": "x"})
    finally:
        srv.shutdown()
        srv.server_close()
    assert [o for _, o in objs] == [{"i": 0}, {"i": 1}, {"i": 2}]
    t = [t for t, _ in objs]
    assert 0.08 < t[1] - t[0] < 0.5 and 0.08 < t[2] - t[1] < 0.5  # {"i": 2} completed by the third chunk
