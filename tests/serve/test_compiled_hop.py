"""The distributed mode with a compiled target hop (ServeConfig.target_hop: compiled; real Ray Compiled Graph,
real HTTP): greedy output equals the in-process engine's, with several streams at once; calibration and rounds
decode on one thread (the graph's); an idle replica parks the actor's polling thread; a killed target actor
is replaced and a new graph compiled, with requests answered exactly again."""

from __future__ import annotations

import os
import time

import httpx
import openai
import pytest
import ray

from specray.deployments.actors.launch import ACTOR_NAMESPACE

from .conftest import (COMPLETION_PROMPTS, CONCURRENT_MAX_TOKENS, ENGINE, MAX_TOKENS, concurrent_chats,
                       concurrent_prompts, deployed_app)

pytestmark = [pytest.mark.serve, pytest.mark.model]


@pytest.fixture(scope="module")
def app(ray_serve):
    # calibrated: the cost table is measured through the graph, on the thread that then decodes every round
    with deployed_app(ray_serve, "compiled", {"mode": "distributed", "target_hop": "compiled",
                                              "engine": ENGINE | {"calibrate": True}, "watchdog_interval_s": 0.5,
                                              "actor_ping_timeout_s": 5.0}) as base:
        yield base


@pytest.fixture(scope="module")
def http(app):
    with httpx.Client(base_url=app, timeout=300) as c:
        yield c


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_concurrent_streams_are_exact_through_the_graph(app, http, reference):
    prompts = concurrent_prompts()
    out = concurrent_chats(app, prompts)
    for i, p in enumerate(prompts):
        assert out.get(i) == reference[("chat", p, CONCURRENT_MAX_TOKENS)][0], f"stream {i}: {out.get(i)!r}"

    st = http.get("/v1/stats").json()
    hop = st["hop"]
    assert hop["mode"] == "compiled" and hop["calls"] >= st["target"]["rounds"] > 0
    # the router slept through most of each decode instead of polling the channel beside llama.cpp's threads
    assert hop["slept_ms"] > 0
    assert st["target"]["decode_threads"] == 1 and st["target"]["max_seqs_in_decode"] >= 2
    assert {1, 8} <= {int(n) for n in st["cost_table"]}  # calibrated through the graph


def test_an_idle_replica_parks_the_graph_thread(app, http):
    client = openai.OpenAI(base_url=f"{app}/v1", api_key="none", timeout=300, max_retries=0)
    client.completions.create(model="m", prompt=COMPLETION_PROMPTS[0], max_tokens=4, temperature=0)
    time.sleep(0.5)  # the round thread has gone idle and parked
    st = http.get("/v1/stats").json()
    parks = st["hop"]["parks"]
    pid = st["placement"]["target"]["pid"]
    c0, t0 = _cpu_seconds(pid), time.perf_counter()
    time.sleep(2.0)
    share = (_cpu_seconds(pid) - c0) / (time.perf_counter() - t0)
    # unparked, the graph's thread polls its input channel: a whole core (measured 1.0); parked, next to nothing
    assert share < 0.3, f"idle target actor used {share:.2f} of a core"
    assert parks >= 1
    # the next request wakes it and is served; idle again, the router parks it again (after the answer went
    # out, so the count is polled)
    r = client.completions.create(model="m", prompt=COMPLETION_PROMPTS[1], max_tokens=4, temperature=0)
    assert r.choices[0].text
    deadline = time.perf_counter() + 10.0
    while http.get("/v1/stats").json()["hop"]["parks"] <= parks:
        assert time.perf_counter() < deadline, "the idle router did not park the graph thread again"
        time.sleep(0.1)


def test_a_killed_target_gets_a_new_graph_and_exact_answers(app, http, reference):
    st0 = http.get("/v1/stats").json()
    gen0 = st0["target"]["generation"]
    ray.kill(ray.get_actor(st0["target"]["name"], namespace=ACTOR_NAMESPACE))

    deadline = time.time() + 180
    while time.time() < deadline:
        h = http.get("/health")
        if h.status_code == 200 and h.json()["target"]["generation"] == gen0 + 1:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the target actor was not replaced")
    client = openai.OpenAI(base_url=f"{app}/v1", api_key="none", timeout=300, max_retries=0)
    for p in COMPLETION_PROMPTS:
        r = client.completions.create(model="m", prompt=p, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == reference[("completion", p, MAX_TOKENS)][0]
    st = http.get("/v1/stats").json()
    assert st["hop"]["mode"] == "compiled" and st["target"]["decode_threads"] == 1
