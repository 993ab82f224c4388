"""Two models in one app (real Ray, real HTTP, the openai client): SmolLM2 (distributed: its target in its own
actor) and Gemma 3 270M (colocated, autoscaled), routed by each request's `model`.

Each answers exactly as that model served alone (exact mode, the in-process engine's greedy output), aliases
and the default route, an unknown model is a 404, the two models stream at the same time, stats and
Prometheus series are per model, killing one model's target actor leaves the other answering, and load on
one model scales its deployment alone."""

from __future__ import annotations

import re
import threading
import time
import urllib.request

import httpx
import openai
import pytest
import ray

from specray.deployments.actors.launch import ACTOR_NAMESPACE

from .conftest import ENGINE, METRICS_PORT, deployed_app

pytestmark = [pytest.mark.serve, pytest.mark.model]

APP = "multi"
SLOTS = 2
MAX_TOKENS = 24
LONG_TOKENS = 64
SMOL_ENGINE = ENGINE | {"slots": SLOTS, "threads": 1, "n_ctx": 1024, "calibrate": False}
GEMMA_ENGINE = SMOL_ENGINE | {"model": "gemma3-270m", "chain": ENGINE["chain"] | {"speculators": ["ngram_mod"]}}
AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 1, "downscale_delay_s": 600,
               "look_back_period_s": 2, "metrics_interval_s": 0.5}
ARGS = {
    "engine": SMOL_ENGINE,
    "models": [
        {"id": "smol", "aliases": ["small"], "mode": "distributed"},
        {"id": "gemma", "aliases": ["gem"], "engine": {"model": "gemma3-270m", "chain": {"speculators": ["ngram_mod"]}},
         "mode": "colocated", "autoscaling": AUTOSCALING},
    ],
    "default_model": "smol",
}
CHAT = "Name three primary colors."
COMPLETION = "Copy this list exactly: apple, banana, cherry, apple, banana, cherry, apple, banana,"


@pytest.fixture(scope="module")
def refs():
    """Each model served alone: the in-process engine's greedy outputs, with the engine config the app gives
    that model."""
    from specray.deployments.config import ServeConfig
    from specray.deployments.local_engine import LocalEngine
    from specray.deployments.models.config import model_configs

    out = {}
    for mid, mcfg in model_configs(ServeConfig.model_validate(ARGS)).items():
        eng = LocalEngine(mcfg.engine)
        out[mid] = {
            "chat": eng.generate(messages=[{"role": "user", "content": CHAT}], max_tokens=MAX_TOKENS).text,
            "completion": eng.generate(prompt=COMPLETION, max_tokens=MAX_TOKENS).text,
            "long": eng.generate(prompt=COMPLETION, max_tokens=LONG_TOKENS, ignore_eos=True).text,
        }
        eng.close()
    assert out["smol"]["completion"] != out["gemma"]["completion"]  # the test can tell the models apart
    return out


@pytest.fixture(scope="module")
def multi(ray_serve):
    t0 = time.perf_counter()
    with deployed_app(ray_serve, APP, ARGS) as base:
        print(f"\ntwo-model app deployed in {time.perf_counter() - t0:.1f}s")
        yield base


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=300, max_retries=0)


def complete(base: str, model: str | None, prompt: str = COMPLETION, max_tokens: int = MAX_TOKENS) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0} | ({"model": model} if model else {})
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_each_model_answers_as_served_alone_by_id_alias_and_default(multi, refs):
    c = client(multi)
    listed = c.models.list().data
    assert [m.id for m in listed] == ["smol", "gemma"]
    smol, gemma = (m.model_dump() for m in listed)
    assert smol["aliases"] == ["small"] and smol["default"] and smol["placement"]["mode"] == "distributed"
    assert gemma["placement"]["autoscaling"]["max_replicas"] == 2 and gemma["chain"] == "ngram_mod"
    assert smol["memory"]["kind"] == gemma["memory"]["kind"] == "attention"
    for model, mid in (("smol", "smol"), ("small", "smol"), ("gemma", "gemma"), ("gem", "gemma")):
        r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": CHAT}],
                                      max_tokens=MAX_TOKENS, temperature=0)
        assert (r.model, r.choices[0].message.content) == (mid, refs[mid]["chat"]), model
        d = complete(multi, model)
        assert (d["model"], d["choices"][0]["text"]) == (mid, refs[mid]["completion"]), model
    d = complete(multi, None)  # no `model`: the default
    assert (d["model"], d["choices"][0]["text"]) == ("smol", refs["smol"]["completion"])


def test_an_unknown_model_is_a_404_naming_the_models(multi):
    with pytest.raises(openai.NotFoundError) as e:
        client(multi).completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    err = e.value.body
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "smol (small), gemma (gem)" in err["message"]
    r = httpx.post(f"{multi}/v1/chat/completions", timeout=60, json={
        "model": "gpt-9", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_the_two_models_stream_at_the_same_time(multi, refs):
    seen: dict[str, list[float]] = {}
    texts: dict[str, str] = {}

    def stream(model: str) -> None:
        times, parts = [], []
        for ch in client(multi).completions.create(model=model, prompt=COMPLETION, max_tokens=LONG_TOKENS,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True}):
            times.append(time.perf_counter())
            parts.append(ch.choices[0].text if ch.choices else "")
        seen[model], texts[model] = times, "".join(parts)

    threads = [threading.Thread(target=stream, args=(m,)) for m in ("smol", "gemma")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert texts == {"smol": refs["smol"]["long"], "gemma": refs["gemma"]["long"]}
    # each model's stream delivered chunks while the other's was still going: interleaved, not one after the other
    s, g = seen["smol"], seen["gemma"]
    assert s[0] < g[-1] and g[0] < s[-1]
    assert sum(g[0] < t < g[-1] for t in s) >= 3 or sum(s[0] < t < s[-1] for t in g) >= 3


def scrape_requests(app: str) -> dict[str, float]:
    """Ray's Prometheus endpoint: finished requests per `model` label for this app."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("ray_specray_requests_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            if labels.get("application") == app:
                out[labels["model"]] = out.get(labels["model"], 0) + float(line.rsplit(" ", 1)[1])
    return out


def test_stats_and_metrics_are_per_model(multi):
    def counts():
        st = httpx.get(f"{multi}/v1/stats", timeout=60).json()
        return {m: b["arms"]["default"]["requests"] for m, b in st["models"].items()}, st

    before, _ = counts()
    for model in ("smol", "gemma", "gem"):
        complete(multi, model, prompt="The capital of France is", max_tokens=4)
    after, st = counts()
    assert {m: after[m] - before[m] for m in after} == {"smol": 1, "gemma": 2}
    assert st["models"]["gemma"]["aliases"] == ["gem"] and st["models"]["smol"]["default"]
    assert st["models"]["gemma"]["arms"]["default"]["engine"]["chain"] == "ngram_mod"
    deadline = time.time() + 30
    while time.time() < deadline:  # Ray's agent exports what the replicas pushed within a few seconds
        scraped = scrape_requests(APP)
        if scraped.get("smol", 0) >= after["smol"] and scraped.get("gemma", 0) >= after["gemma"]:
            break
        time.sleep(1)
    assert scraped.get("smol") == after["smol"] and scraped.get("gemma") == after["gemma"], scraped


def test_health_covers_every_model_and_one_on_request(multi):
    h = httpx.get(f"{multi}/health", timeout=60)
    assert h.status_code == 200 and set(h.json()["models"]) == {"smol", "gemma"}
    assert all(m["status"] == "ok" for m in h.json()["models"].values())
    one = httpx.get(f"{multi}/health", params={"model": "gem"}, timeout=60).json()
    assert one["model"] == "gemma" and one["status"] == "ok"
    assert httpx.get(f"{multi}/health", params={"model": "nope"}, timeout=60).status_code == 404


def test_killing_one_models_target_leaves_the_other_answering(multi, refs):
    target = httpx.get(f"{multi}/health", params={"model": "smol"}, timeout=60).json()["target"]
    ray.kill(ray.get_actor(target["name"], namespace=ACTOR_NAMESPACE))
    t_kill = time.time()
    smol_down, gemma_answers = [], 0
    while True:
        d = complete(multi, "gemma")  # asserts 200
        assert d["choices"][0]["text"] == refs["gemma"]["completion"]
        gemma_answers += 1
        h = httpx.get(f"{multi}/health", timeout=60)
        per = h.json()["models"]
        smol_down.append((h.status_code, per["smol"]["status"]))
        assert per["gemma"]["status"] == "ok"
        if per["smol"]["status"] == "ok" and per["smol"]["target"]["generation"] == 2:
            break
        assert time.time() - t_kill < 180, smol_down[-3:]
    print(f"\nsmol's target back after {time.time() - t_kill:.1f}s; gemma answered {gemma_answers} times meanwhile; "
          f"health seen {sorted(set(smol_down))}")
    d = complete(multi, "smol")
    assert d["choices"][0]["text"] == refs["smol"]["completion"]


def running(deployment: str) -> int:
    from ray import serve

    app = serve.status().applications.get(APP)
    dep = app.deployments.get(deployment) if app else None
    return dep.replica_states.get("RUNNING", 0) if dep else 0


def test_load_on_one_model_scales_it_alone(multi):
    stop = threading.Event()
    failures: list[str] = []

    def load(k: int) -> None:
        with httpx.Client(timeout=300) as c:
            while not stop.is_set():
                r = c.post(f"{multi}/v1/completions", json={"model": "gemma", "prompt": f"Count to {k}:",
                                                             "max_tokens": 24, "temperature": 0})
                if r.status_code != 200:
                    failures.append(r.text[:200])

    assert running("EngineReplica-gemma") == running("EngineReplica-smol") == 1
    threads = [threading.Thread(target=load, args=(k,), daemon=True) for k in range(4 * SLOTS)]
    for t in threads:
        t.start()
    try:
        deadline = time.time() + 120
        while running("EngineReplica-gemma") < 2:
            assert time.time() < deadline, "gemma never scaled to a second replica under load"
            time.sleep(0.5)
        assert running("EngineReplica-smol") == 1
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=300)
    assert not failures, failures[:3]


def test_a_model_that_cannot_start_leaves_the_others_serving(ray_serve, refs, tmp_path):
    """A model whose replicas fail in their constructor (a file llama.cpp cannot load): the deploy reports the
    failure, the other model answers exactly, /health is 503 and names the failed model, which gets a 503."""
    from ray import serve

    from specray.deployments.app import build_app
    from specray.deployments.config import ServeConfig
    from specray.deployments.models.config import failed_models

    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    args = {"engine": SMOL_ENGINE, "models": [{"id": "smol"}, {"id": "broken", "engine": {"model": str(broken)}}],
            "replica_cpus": 0.1, "ingress_cpus": 0.1, "app_name": "broken", "route_prefix": "/broken"}
    try:
        with pytest.raises(RuntimeError):
            serve.run(build_app(args), name="broken", route_prefix="/broken")
        statuses = {n: str(d.status.value) for n, d in serve.status().applications["broken"].deployments.items()}
        assert failed_models(ServeConfig.model_validate(args), statuses) == ["broken"], statuses
        base = f"{ray_serve}/broken"
        assert complete(base, "smol")["choices"][0]["text"] == refs["smol"]["completion"]
        h = httpx.get(f"{base}/health", timeout=60)
        assert h.status_code == 503 and h.json()["models"]["broken"]["status"] == "failed"
        assert h.json()["models"]["smol"]["status"] == "ok"
        assert httpx.get(f"{base}/health", params={"model": "smol"}, timeout=60).status_code == 200
        r = httpx.post(f"{base}/v1/completions", json={"model": "broken", "prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_unavailable", r.text
    finally:
        serve.delete("broken")
