"""A/B arms over real Ray + HTTP: sticky weighted assignment, per-arm stats and Prometheus metrics that add
up, ab-report on the recorded run, weights and chain parameters changed without restarting replicas.

The app is deployed the way `serve deploy cluster/serve-ab.yaml` does it (a declarative Serve config
applied by the controller), so the runtime change goes through the documented path: `user_config`
overrides under `deployments`.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import time
import urllib.request
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from .conftest import CHAT_PROMPTS, COMPLETION_PROMPTS, ENGINE, METRICS_PORT, concurrent_prompts

pytestmark = [pytest.mark.serve, pytest.mark.model]

REPO = Path(__file__).resolve().parents[2]
APP = "ab"
N_USERS, PER_USER, MAX_TOKENS = 8, 5, 16


def serve_doc(deployments: list[dict] | None = None) -> dict:
    """cluster/serve-ab.yaml with the test engine (exact, small), small CPU shares and two ingress replicas
    (so /v1/stats must merge what both saw)."""
    doc = yaml.safe_load((REPO / "cluster" / "serve-ab.yaml").read_text())
    app = doc["applications"][0]
    app["name"], app["route_prefix"] = APP, f"/{APP}"
    args = app["args"]
    args["engine"] = copy.deepcopy(ENGINE)
    args.pop("autoscaling")  # autoscaling has its own test (test_autoscaling.py)
    args |= {"replica_cpus": 0.2, "ingress_cpus": 0.05, "ingress_replicas": 2, "app_name": APP,
             "route_prefix": f"/{APP}"}
    args["arms"] = [{"name": "base", "chain": "none", "weight": 0.5},
                    {"name": "fast", "chain": "ngram_mod,suffix", "weight": 0.5}]
    if deployments:
        app["deployments"] = deployments
    return doc


def apply(doc: dict) -> None:
    """What `serve deploy FILE` does: the controller applies the declarative config."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(doc), _blocking=True)


@pytest.fixture(scope="module")
def ab(ray_serve):
    from ray import serve

    t0 = time.perf_counter()
    apply(serve_doc())
    print(f"\nab: deployed in {time.perf_counter() - t0:.1f}s")
    base = f"{ray_serve}/{APP}"
    with httpx.Client(base_url=base, timeout=300) as c:
        yield c
    serve.delete(APP)


def ask(http: httpx.Client, i: int, user: str | None = None, headers: dict | None = None,
        max_tokens: int = MAX_TOKENS) -> dict:
    """Request i: chat or completion, streamed or not (a mix); returns arm (header and body), text, usage,
    speculative."""
    prompts = PROMPTS or PROMPTS.extend(concurrent_prompts() + CHAT_PROMPTS) or PROMPTS
    chat, stream = i % 2 == 0, i % 3 == 0
    body: dict = {"max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if user:
        body["user"] = user
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompts[i % len(prompts)]}]
    else:
        path, body["prompt"] = "/v1/completions", COMPLETION_PROMPTS[i % len(COMPLETION_PROMPTS)]
    if stream:
        body["stream_options"] = {"include_usage": True}
        with http.stream("POST", path, json=body, headers=headers or {}) as r:
            assert r.status_code == 200, r.read()
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            header = r.headers["x-specray-arm"]
        arms = {c["arm"] for c in chunks}
        assert len(arms) == 1, arms  # every chunk names the arm
        text = "".join((c["choices"][0]["delta"].get("content") or "") if chat else c["choices"][0]["text"]
                       for c in chunks if c["choices"])
        last = chunks[-1]
        return {"arm": arms.pop(), "header": header, "text": text, "usage": last["usage"],
                "speculative": last["speculative"]}
    r = http.post(path, json=body, headers=headers or {})
    assert r.status_code == 200, r.text
    d = r.json()
    text = d["choices"][0]["message"]["content"] if chat else d["choices"][0]["text"]
    return {"arm": d["arm"], "header": r.headers["x-specray-arm"], "text": text, "usage": d["usage"],
            "speculative": d["speculative"]}


def scrape(app: str) -> dict[tuple[str, str], float]:
    """Ray's Prometheus endpoint: {(metric, arm): value summed over replicas} for this app's specray series."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).read().decode()
    out: dict[tuple[str, str], float] = defaultdict(float)
    for line in text.splitlines():
        if not line.startswith("ray_specray_"):
            continue
        m = re.match(r'^(\w+)\{(.*)\} (\S+)$', line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        if labels.get("application") != app:
            continue
        out[(m.group(1), labels.get("arm", ""))] += float(m.group(3))
    return out


PROMPTS: list[str] = []
SERVED: dict[str, list[dict]] = {}  # user -> responses (shared with the later tests of this module)


def test_users_stick_to_their_arm_split_by_weight_and_the_counts_add_up(ab):
    users = [f"user-{k}" for k in range(N_USERS)]

    def run_user(k: int) -> list[dict]:
        with httpx.Client(base_url=str(ab.base_url), timeout=300) as c:
            return [ask(c, k * PER_USER + j, user=users[k]) for j in range(PER_USER)]

    with ThreadPoolExecutor(N_USERS) as ex:
        for user, res in zip(users, ex.map(run_user, range(N_USERS))):
            SERVED[user] = res
    responses = [r for res in SERVED.values() for r in res]
    assert len(responses) == N_USERS * PER_USER
    for user, res in SERVED.items():
        assert len({r["arm"] for r in res}) == 1, (user, [r["arm"] for r in res])  # sticky
        assert all(r["header"] == r["arm"] for r in res)
    per_arm = Counter(r["arm"] for r in responses)
    users_per_arm = Counter(res[0]["arm"] for res in SERVED.values())
    # assignment is per user (sticky), so the split moves in steps of 5 requests; at 0.5/0.5 both arms
    # get users and neither gets more than 6 of 8 (the 10000-user split is checked in tests/unit/test_arms.py)
    assert set(per_arm) == {"base", "fast"} and max(users_per_arm.values()) <= 6, users_per_arm

    expect = {}
    for arm in ("base", "fast"):
        rs = [r for r in responses if r["arm"] == arm]
        expect[arm] = {"requests": len(rs), "tokens": sum(r["usage"]["completion_tokens"] for r in rs),
                       "prompt_tokens": sum(r["usage"]["prompt_tokens"] for r in rs),
                       "drafts": sum(r["speculative"]["drafts"] for r in rs),
                       "accepted": sum(r["speculative"]["accepted_tokens"] for r in rs)}
    assert expect["base"]["drafts"] == 0 and expect["fast"]["drafts"] > 0  # the arms really run their chains

    st = ab.get("/v1/stats").json()
    assert st["ingress"]["replicas"] == 2  # both ingress replicas' records are merged
    for arm, e in expect.items():
        a = st["arms"][arm]
        assert (a["requests"], a["completion_tokens"], a["prompt_tokens"]) == (e["requests"], e["tokens"],
                                                                              e["prompt_tokens"])
        assert (a["drafts"], a["accepted_tokens"], a["errors"]) == (e["drafts"], e["accepted"], 0)
        assert len(a["records"]["ttft_s"]) == e["requests"] and all(t > 0 for t in a["records"]["ttft_s"])
        # the engine side, summed over the arm's replicas, counted the same verdicts
        assert a["engine"]["replicas"] == 1 and a["engine"]["speculators"]["drafts"] == e["drafts"]
        assert a["engine"]["speculators"]["accepted_tokens"] == e["accepted"]
        assert a["share"] == 0.5
    assert st["arms"]["fast"]["chain"] == "ngram_mod,suffix" and st["arms"]["base"]["chain"] == "none"

    # Prometheus, through Ray's metrics agent (pushed every second in tests): the same figures per arm
    deadline, got = time.time() + 30, {}
    want = {(f"ray_specray_{m}", arm): v for arm, e in expect.items() for m, v in (
        ("requests_total", e["requests"]), ("generation_tokens_total", e["tokens"]),
        ("prompt_tokens_total", e["prompt_tokens"]), ("spec_decode_num_drafts_total", e["drafts"]),
        ("spec_decode_num_accepted_tokens_total", e["accepted"]),
        ("time_to_first_token_seconds_count", e["requests"]), ("inter_token_latency_seconds_count", e["requests"]),
        # per position i: drafts with at least i+1 tokens accepted; summed over the positions (scrape sums
        # the position series), every accepted token. Waited for like the others: each position is its own
        # series, and the metrics agent can export a new series one push after the rest.
        ("spec_decode_num_accepted_tokens_per_pos_total", e["accepted"]),
    )}
    want = {k: v for k, v in want.items() if v or "spec_decode" not in k[0]}  # base has no spec series at all
    while time.time() < deadline:
        got = scrape(APP)
        if all(got.get(k) == v for k, v in want.items()):
            break
        time.sleep(1)
    assert {k: got.get(k) for k in want} == want
    assert got[("ray_specray_slots_total", "fast")] == ENGINE["slots"]
    assert got.get(("ray_specray_slot_occupancy", "fast")) == 0  # idle now


def test_forced_arm_identical_greedy_output_and_unknown_arm(ab):
    i = 4  # a chat prompt, not streamed
    by_arm = {arm: ask(ab, i, headers={"X-Specray-Arm": arm}, max_tokens=32) for arm in ("base", "fast")}
    assert {a: r["header"] for a, r in by_arm.items()} == {"base": "base", "fast": "fast"}
    # lossless in exact mode: speculation changes the speed, never the text
    assert by_arm["base"]["text"] == by_arm["fast"]["text"] and by_arm["fast"]["speculative"]["drafts"] > 0
    user = next(iter(SERVED))  # the header beats the user's sticky arm
    other = "base" if SERVED[user][0]["arm"] == "fast" else "fast"
    assert ask(ab, 1, user=user, headers={"X-Specray-Arm": other})["arm"] == other
    r = ab.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"X-Specray-Arm": "turbo"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "unknown_arm" and "base, fast" in err["message"]
    models = ab.get("/v1/models").json()["data"][0]
    assert [a["name"] for a in models["arms"]] == ["base", "fast"]
    h = ab.get("/health")
    assert h.status_code == 200 and set(h.json()["arms"]) == {"base", "fast"}


def test_ab_report_on_the_recorded_run(ab, tmp_path):
    url = str(ab.base_url).rstrip("/")
    saved, png = tmp_path / "run.json", tmp_path / "ab.png"
    cli = [sys.executable, "-m", "specray.cli.main", "ab-report"]
    live = subprocess.run(cli + ["--url", url, "--save-stats", str(saved), "--plot", str(png), "--bootstrap",
                                 "500"], capture_output=True, text=True, timeout=120)
    assert live.returncode == 0, live.stderr
    for words in ("base", "fast", "none", "ngram_mod,suffix", "95%", "tok/s per request", "TTFT p50"):
        assert words in live.stdout, (words, live.stdout)
    rows = [line for line in live.stdout.splitlines() if line.startswith(("base ", "fast "))]
    assert len(rows) == 2 and all("[" in row for row in rows)  # values with their intervals
    assert "winner" in live.stdout
    assert png.stat().st_size > 10_000
    again = subprocess.run(cli + ["--from", str(saved), "--bootstrap", "500"], capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0 and again.stdout.splitlines()[1:] == live.stdout.splitlines()[1:]


#: the user_config changes test_weights_and_chain_params_change_without_restarting_replicas applies (later
#: applies keep them: a declarative config replaces every deployment's user_config)
RUNTIME_UPDATES = [
    {"name": "Ingress", "user_config": {"weights": {"base": 0}}},
    {"name": "EngineReplica-fast", "user_config": {"chain": {"params": {"ngram_mod": {"n_max": 3}}}}},
]


def test_weights_and_chain_params_change_without_restarting_replicas(ab):
    before = ab.get("/v1/stats").json()
    pids = {arm: a["engine"]["pids"] for arm, a in before["arms"].items()}
    ingress_pids = sorted(before["ingress"]["pids"])
    assert before["arms"]["fast"]["engine"]["chain_config"]["params"]["ngram_mod"]["n_max"] == 8
    apply(serve_doc(deployments=RUNTIME_UPDATES))
    deadline = time.time() + 60
    while time.time() < deadline:
        st = ab.get("/v1/stats").json()
        fast = st["arms"]["fast"]["engine"].get("chain_config") or {}
        # both ingress replicas must have the new weights (each reports its own)
        if all(w["base"] == 0 for w in st["ingress"]["weights"]) and len(st["ingress"]["weights"]) == 2 \
                and fast.get("params", {}).get("ngram_mod", {}).get("n_max") == 3:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"the user_config change did not arrive: {st['arms']['base']['weight']}, {fast}")
    assert {arm: a["engine"]["pids"] for arm, a in st["arms"].items()} == pids  # same processes
    assert sorted(st["ingress"]["pids"]) == ingress_pids
    # the rest of the arm's chain is what it was: only the named parameter moved
    assert fast["speculators"] == ["ngram_mod", "suffix"] and fast["params"]["suffix"] == ENGINE["chain"][
        "params"]["suffix"]
    for _ in range(4):  # every ingress replica now sends new users to fast only
        assert {ask(ab, 1, user=f"new-user-{k}")["arm"] for k in range(6)} == {"fast"}
    # the rebuilt speculator drafts at most 3 tokens now, and the output is still the plain-decoding text
    r = ask(ab, 4, headers={"X-Specray-Arm": "fast"}, max_tokens=32)
    assert r["text"] == ask(ab, 4, headers={"X-Specray-Arm": "base"}, max_tokens=32)["text"]
    assert r["speculative"]["drafts"] > 0


def test_a_speculator_added_through_user_config_drafts_on_the_next_requests(ab):
    """The issue: a speculator added to a running chain by user_config never drafted (its first draft raised
    in every round, swallowed by the scheduler). Here the base arm (no speculation) gets suffix."""
    before = ab.get("/v1/stats").json()["arms"]["base"]["engine"]
    assert before["chain"] == "none" and before["speculators"]["drafts"] == 0
    pids = before["pids"]
    apply(serve_doc(deployments=RUNTIME_UPDATES + [
        {"name": "EngineReplica-base", "user_config": {"chain": {"speculators": ["suffix"]}}}]))
    deadline = time.time() + 60
    while time.time() < deadline:
        base = ab.get("/v1/stats").json()["arms"]["base"]["engine"]
        if base["chain"] == "suffix":
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"the user_config change did not arrive: {base['chain']}")
    assert base["pids"] == pids  # the same process: a live change, not a restart
    r = ask(ab, 1, headers={"X-Specray-Arm": "base"}, max_tokens=32)  # the repetitive completion prompt
    assert r["speculative"]["by_speculator"]["suffix"]["accepted_tokens"] > 0, r["speculative"]
    base = ab.get("/v1/stats").json()["arms"]["base"]["engine"]
    # the arm's engine drafted with nothing but suffix: its counters are suffix's, and nothing failed
    assert base["speculators"]["accepted_tokens"] == r["speculative"]["accepted_tokens"] > 0
    assert base["scheduler"]["speculator_failures"] == 0
