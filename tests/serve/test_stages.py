"""The per-stage timing of a streamed request (X-Specray-Timing: 1), against the served app, both modes.

The stages must all be there, be non-negative and add up to what this client
measured. `handle` and `proxy` are remainders of durations taken inside one
process each; on this one host they are checked against time.time() stamps of
the processes on either side, which tells whether each stage covers the span
it claims (a stamp in the wrong place shows up as a negative leg or a gap).
"""

from __future__ import annotations

import http.client
import json
import time
from urllib.parse import urlsplit

import pytest

from specray.bench.stages import STAGES, request_stages
from specray.deployments.http.timing import SERVER_STAGES

from .conftest import COMPLETION_PROMPTS

pytestmark = [pytest.mark.serve, pytest.mark.model]

#: the repetitive prompt: its copies are drafted and accepted, several tokens a round
PROMPT = COMPLETION_PROMPTS[1]
#: per-stage values are rounded to 1 us; 9 of them summed
ROUND_TOL_MS = 0.01
#: time.time() against perf_counter over one request (~1 s here): the two clocks run at the same rate
#: but NTP may slew the wall clock by up to 500 ppm (0.5 ms a second), and each wall stamp sits a
#: statement away from the perf_counter one it stands for, where a loaded 2-core box can preempt the
#: process for a time slice (~1 ms): 4 such pairs enter each comparison. A stamp in the wrong place
#: (a stage measured from after an await instead of before it) is off by a whole hop: several ms.
WALL_TOL_MS = 3.0


def stream(base: str, body: dict, timing: bool) -> tuple[list[dict], dict]:
    """POST a streamed request; returns (every data object before [DONE], the client's own stamps)."""
    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    headers = {"Content-Type": "application/json"} | ({"X-Specray-Timing": "1"} if timing else {})
    objs: list[dict] = []
    stamps: dict = {"wall0": time.time(), "t0": time.perf_counter()}
    conn.request("POST", parts.path + "/v1/completions", body=json.dumps(body), headers=headers)
    r = conn.getresponse()
    assert r.status == 200, r.read()
    while True:
        line = r.readline()
        assert line, "the stream ended before [DONE]"
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        if line == b"data: [DONE]":
            break
        objs.append(json.loads(line[6:]))
        if "specray_timing" in objs[-1]:
            stamps["t1"], stamps["wall1"] = time.perf_counter(), time.time()
    conn.close()
    return objs, stamps


def test_stages_present_non_negative_and_add_up_to_the_client_time(server):
    mode, base = server
    body = {"prompt": PROMPT, "max_tokens": 32, "temperature": 0, "stream": True}
    objs, c = stream(base, body, timing=True)
    *deltas, last = objs
    assert all("specray_timing" not in o for o in deltas), "only the final chunk carries the timing"
    t = last["specray_timing"]
    client_ms = 1000 * (c["t1"] - c["t0"])

    # every stage there and >= 0; the server's add up to the ingress's total (rounding only: each one is a
    # difference of the same process's stamps, `handle` the ingress's wait minus the replica's total)
    for k in SERVER_STAGES:
        assert t[k + "_ms"] >= 0, (k, t)
    assert sum(t[k + "_ms"] for k in SERVER_STAGES) == pytest.approx(t["ingress_ms"], abs=ROUND_TOL_MS)
    replica = ("tokenize", "admission", "prefill", "decode", "emit_tail")
    assert sum(t[k + "_ms"] for k in replica) == pytest.approx(t["replica_ms"], abs=ROUND_TOL_MS)
    s = request_stages(t, client_ms)
    assert set(STAGES) <= set(s) and all(s[k] >= 0 for k in STAGES), s
    assert sum(s[k] for k in STAGES) == pytest.approx(client_ms, abs=ROUND_TOL_MS)
    assert t["decode_ms"] > 0 and t["prefill_ms"] > 0  # the model's work is where the rounds are

    # the remainders, against the wall clock of the processes on either side (one host)
    w = t["wall"]
    proxy_in = 1000 * (w["ingress_arrival"] - c["wall0"])
    proxy_out = 1000 * (c["wall1"] - w["ingress_final"])
    assert proxy_in > 0 and proxy_out > 0, (proxy_in, proxy_out)
    assert proxy_in + proxy_out == pytest.approx(s["proxy"], abs=WALL_TOL_MS)
    leg_out = 1000 * (w["replica_start"] - w["ingress_call"])
    leg_back = 1000 * (w["ingress_end_recv"] - w["replica_end"])
    assert leg_out > 0 and leg_back > 0, (leg_out, leg_back)
    assert leg_out + leg_back == pytest.approx(t["handle_ms"], abs=WALL_TOL_MS)

    # one chunk per round at most: the deltas the client got, each one a chunk the replica emitted
    texts = [o["choices"][0]["text"] for o in deltas]
    assert all(texts) and t["emit_chunks"] == t["sse_chunks"] == len(texts)
    usage, spec = last["usage"], last["speculative"]
    assert len(texts) <= spec["rounds"] + 1  # + the prompt's last batch, which yields the first token
    assert spec["accepted_tokens"] > 0  # the copy prompt gets drafts accepted: several tokens in one chunk
    assert len(texts) < usage["completion_tokens"]
    assert t["emit_mean_ms"] >= 0 and t["sse_mean_ms"] >= 0 and t["handle_first_ms"] >= 0

    # without the header: the same stream, no timing anywhere
    plain, _ = stream(base, body, timing=False)
    assert all("specray_timing" not in o for o in plain)
    assert "".join(o["choices"][0]["text"] for o in plain) == "".join(texts)

    # /v1/stats: the means over the streams this arm served (both of them measured, header or not)
    conn = http.client.HTTPConnection(urlsplit(base).hostname, urlsplit(base).port, timeout=60)
    conn.request("GET", urlsplit(base).path + "/v1/stats")
    st = json.loads(conn.getresponse().read())["arms"]["default"]["stages_ms"]
    conn.close()
    assert st["requests"] >= 2 and all(st[k + "_ms"] >= 0 for k in SERVER_STAGES)
