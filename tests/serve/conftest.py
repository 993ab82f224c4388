"""Serve tests: ONE Ray session + Serve instance per pytest run, one app per deployment mode.

The reference outputs come from the in-process engine (LocalEngine) with the
same engine config; exact=True on both sides makes the target batch-invariant,
so greedy text must be identical, solo or with 8 concurrent streams.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time

import pytest

from ..conftest import spec_bench_prompts


# aggressive parameters: short answers still get drafts, and some get rejected
SPEC_PARAMS = {
    "ngram_mod": {"n_match": 3, "n_min": 1, "n_max": 8, "pool_size": 1 << 16},
    "suffix": {"min_match": 1, "p_min": 0.01},
}
ENGINE = {
    "model": "smollm2-135m",
    "n_ctx": 2048,
    "slots": 4,
    "threads": 2,
    "exact": True,
    "calibrate": False,
    "chain": {"speculators": ["ngram_mod", "suffix"], "params": SPEC_PARAMS, "policy": "first", "n_max": 8},
}
MAX_TOKENS = 32
CONCURRENT_MAX_TOKENS = 32
N_CONCURRENT = 8

COMPLETION_PROMPTS = [
    "The capital of France is",
    "Copy this list exactly: apple, banana, cherry, apple, banana, cherry, apple, banana, cherry,",
]
CHAT_PROMPTS = [
    "Write a Python function that adds two numbers.",
    "Name three primary colors.",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kv_is_only_the_cache(st: dict) -> bool:
    """/v1/stats: every slot's KV cells are what the prompt cache records for it (0 for a slot it has nothing of):
    no cells leaked by a finished, cancelled or failed sequence, none lost from a cached one."""
    return st["target"]["kv_cells"] == st["prompt_cache"]["cached_cells"]


def concurrent_prompts() -> list[str]:
    return spec_bench_prompts(N_CONCURRENT)


def concurrent_chats(base: str, prompts: list[str], max_tokens: int = CONCURRENT_MAX_TOKENS) -> dict[int, object]:
    """Stream each prompt as a greedy chat request, all at once (the official openai client, a thread each):
    {i: the streamed text, or the exception that request raised}."""
    import threading

    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=300, max_retries=0)
    out: dict[int, object] = {}

    def run(i: int, p: str) -> None:
        try:
            chunks = client.chat.completions.create(model="m", messages=[{"role": "user", "content": p}],
                                                    max_tokens=max_tokens, temperature=0, stream=True)
            out[i] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        except Exception as e:  # noqa: BLE001 - the caller's assertion reports it
            out[i] = e

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    return out


#: Ray's Prometheus endpoint of this node (http://127.0.0.1:METRICS_PORT/metrics; tests/serve/test_ab.py
#: scrapes it); workers push their metrics every second instead of every 10 s
METRICS_PORT = int(os.environ.get("SPECRAY_TEST_METRICS_PORT", 0)) or _free_port()
os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")


@pytest.fixture(scope="session")
def ray_serve():
    """One local Ray + Serve for the whole run; yields the HTTP base URL (no route prefix)."""
    import ray
    from ray import serve

    # address="local": a new cluster even where `ray start` left one running (it would refuse num_cpus)
    # num_gpus: logical GPUs (no hardware), so GPU bundles and actors' GPU requests are placed for real here
    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False,
             namespace="specray-tests", _metrics_export_port=METRICS_PORT)
    port = int(os.environ.get("SPECRAY_TEST_PORT", 0)) or _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="session")
def reference():
    """Solo greedy outputs of the in-process engine for every prompt the tests send."""
    from specray.deployments.local_engine import LocalEngine
    from specray.engine.config import EngineConfig

    eng = LocalEngine(EngineConfig.model_validate(ENGINE))
    ref: dict[tuple, tuple[str, int]] = {}

    def run(key, **kw):
        seq = eng.generate(**kw)
        ref[key] = (seq.text, len(seq.generated), seq.finish_reason)

    t0 = time.perf_counter()
    for p in COMPLETION_PROMPTS:
        run(("completion", p, MAX_TOKENS), prompt=p, max_tokens=MAX_TOKENS)
    for p in CHAT_PROMPTS:
        run(("chat", p, MAX_TOKENS), messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS)
    for p in concurrent_prompts():
        run(("chat", p, CONCURRENT_MAX_TOKENS), messages=[{"role": "user", "content": p}],
            max_tokens=CONCURRENT_MAX_TOKENS)
    print(f"\nreference outputs: {len(ref)} prompts in {time.perf_counter() - t0:.1f}s")
    eng.close()
    return ref


@pytest.fixture(scope="module", params=["colocated", "distributed"])
def server(request, ray_serve):
    """One app per deployment mode (one alive at a time); yields (mode, base URL with route prefix)."""
    from ray import serve

    from specray.deployments.app import build_app

    mode = request.param
    # calibrated in both modes: set-up decodes as well as rounds (test_one_thread_does_every_decode)
    args = {"mode": mode, "engine": ENGINE | {"calibrate": True}, "replica_cpus": 0.2, "target_cpus": 0.4, "companion_cpus": 0.1,
            "ingress_cpus": 0.1, "app_name": f"specray-{mode}", "route_prefix": f"/{mode}"}
    if mode == "distributed":
        # the GPU cluster shape on the session's logical GPUs: the target actor holds one, the companion a share
        args |= {"target_gpus": 1, "companion_gpus": 0.5}
    t0 = time.perf_counter()
    serve.run(build_app(args), name=f"specray-{mode}", route_prefix=f"/{mode}")
    print(f"\n{mode}: deployed in {time.perf_counter() - t0:.1f}s")
    try:
        yield mode, f"{ray_serve}/{mode}"
    finally:
        serve.delete(f"specray-{mode}")


# ---- reliability apps (tests/serve/test_reliability*.py, test_load.py, test_fuzz.py) -----------------------
API_KEY = "sk-specray-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
#: same engine as ENGINE (so `reference` outputs apply), with a queue limit the overload test can reach
REL_ENGINE = ENGINE | {"max_queue": 24}
REL_MAX_BODY = 64 * 1024


@contextlib.contextmanager
def deployed_app(ray_serve: str, name: str, args: dict):
    """deploy() for a module's fixture: yields the base URL, deletes the app afterwards."""
    from ray import serve

    base = deploy(ray_serve, name, args)
    try:
        yield base
    finally:
        serve.delete(name)


def deploy(ray_serve: str, name: str, args: dict) -> str:
    """Deploy build_app(args) as app `name` at route /name; returns its base URL."""
    from ray import serve

    from specray.deployments.app import build_app

    args = {"replica_cpus": 0.2, "target_cpus": 0.4, "companion_cpus": 0.1, "ingress_cpus": 0.1,
            "app_name": name, "route_prefix": f"/{name}"} | args
    t0 = time.perf_counter()
    serve.run(build_app(args), name=name, route_prefix=f"/{name}")
    print(f"\n{name}: deployed in {time.perf_counter() - t0:.1f}s")
    return f"{ray_serve}/{name}"


@pytest.fixture(scope="session")
def rel_server(ray_serve):
    """Colocated app with an API key, a 64 KiB body limit and slots + queue = 4 + 24, shared by the
    reliability, fuzz and load tests; yields its base URL (send AUTH with every request)."""
    from ray import serve

    base = deploy(ray_serve, "rel", {"mode": "colocated", "engine": REL_ENGINE, "api_key": API_KEY,
                                     "max_body_bytes": REL_MAX_BODY, "retry_after_s": 2})
    try:
        yield base
    finally:
        serve.delete("rel")
