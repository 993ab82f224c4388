"""The distributed mode with both hops compiled (ServeConfig.companion_hop and target_hop: compiled; real Ray
Compiled Graphs, a real draft model in the companion, real HTTP): greedy output equals the in-process engine's
with several streams at once and drafts accepted; the companion decodes on one thread (its set-up's
calibration included, though its round calls now arrive on Ray's graph thread); an idle replica parks the
companion's polling thread; a killed companion gets a new actor and a new graph, and answers stay exact."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
import ray

from specray.deployments.actors.launch import ACTOR_NAMESPACE

from .conftest import (COMPLETION_PROMPTS, CONCURRENT_MAX_TOKENS, ENGINE, MAX_TOKENS, concurrent_chats,
                       concurrent_prompts, deployed_app)
from .test_compiled_hop import _cpu_seconds

pytestmark = [pytest.mark.serve, pytest.mark.model]

# calibrated: the companion's draft model measures its step costs at start, on its decode thread
DRAFT_ENGINE = ENGINE | {"calibrate": True, "draft": {"model": "smollm2-135m", "threads": 1},
                         "chain": {"speculators": ["draft"], "policy": "first", "n_max": 8}}


@pytest.fixture(scope="module")
def app(ray_serve):
    with deployed_app(ray_serve, "compiled-companion",
                      {"mode": "distributed", "target_hop": "compiled", "companion_hop": "compiled",
                       "engine": DRAFT_ENGINE, "watchdog_interval_s": 0.5, "actor_ping_timeout_s": 5.0}) as base:
        yield base


@pytest.fixture(scope="module")
def http(app):
    with httpx.Client(base_url=app, timeout=300) as c:
        yield c


def _accepted(http) -> int:
    """Draft tokens the target kept so far (/v1/stats speculators.draft)."""
    return http.get("/v1/stats").json()["speculators"]["draft"]["tokens_accepted"]


def test_concurrent_streams_draft_through_the_companion_graph_exactly(app, http, reference):
    prompts = concurrent_prompts()[:4]
    accepted = _accepted(http)
    out = concurrent_chats(app, prompts)
    for i, p in enumerate(prompts):
        assert out.get(i) == reference[("chat", p, CONCURRENT_MAX_TOKENS)][0], f"stream {i}: {out.get(i)!r}"
    assert _accepted(http) > accepted

    st = http.get("/v1/stats").json()
    comp = st["companion"]
    assert comp["hop"]["mode"] == "compiled" and comp["hop"]["compiles"] == 1
    assert comp["rounds"] > 0 and comp["unsynced"] == 0 and comp["client_errors"] == 0
    # set-up (calibration) and every round decoded on the companion's one decode thread
    assert comp["decode_threads"] == 1
    assert st["hop"]["mode"] == "compiled" and st["target"]["decode_threads"] == 1


def test_an_idle_replica_parks_the_companion_graph_thread(app, http):
    client = openai.OpenAI(base_url=f"{app}/v1", api_key="none", timeout=300, max_retries=0)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Count to ten."}],
                                   max_tokens=8, temperature=0)
    st = http.get("/v1/stats").json()
    pid = st["placement"]["companion"]["pid"]
    time.sleep(0.5)  # the round thread has gone idle and parked both graphs
    c0, t0 = _cpu_seconds(pid), time.perf_counter()
    time.sleep(2.0)
    share = (_cpu_seconds(pid) - c0) / (time.perf_counter() - t0)
    # unparked, the graph's thread polls its input channel: a whole core; parked, next to nothing
    assert share < 0.3, f"idle companion actor used {share:.2f} of a core"
    parks = http.get("/v1/stats").json()["companion"]["hop"]["parks"]
    assert parks >= 1
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Name a colour."}],
                                       max_tokens=8, temperature=0)
    assert r.choices[0].message.content


def test_a_killed_companion_gets_a_new_graph_and_answers_stay_exact(app, http, reference):
    st0 = http.get("/v1/stats").json()
    gen0 = st0["companion"]["generation"]
    ray.kill(ray.get_actor(st0["companion"]["name"], namespace=ACTOR_NAMESPACE))
    client = openai.OpenAI(base_url=f"{app}/v1", api_key="none", timeout=300, max_retries=0)
    # while it is down or coming back the answers are exact, without drafts
    for p in COMPLETION_PROMPTS:
        r = client.completions.create(model="m", prompt=p, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == reference[("completion", p, MAX_TOKENS)][0]
    deadline = time.time() + 180
    while time.time() < deadline:
        h = http.get("/health").json()
        if h["status"] == "ok" and h["companion"]["generation"] == gen0 + 1:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the companion actor was not replaced")
    prompts = concurrent_prompts()[:2]
    accepted = _accepted(http)
    out = concurrent_chats(app, prompts)
    for i, p in enumerate(prompts):
        assert out.get(i) == reference[("chat", p, CONCURRENT_MAX_TOKENS)][0], f"stream {i}: {out.get(i)!r}"
    assert _accepted(http) > accepted  # the new companion drafts for the new sequences
    comp = http.get("/v1/stats").json()["companion"]
    assert comp["hop"]["mode"] == "compiled" and comp["hop"]["compiles"] == 2 and comp["decode_threads"] == 1
