"""The fused layout (one arm: the engine replica deployment is the HTTP ingress) against the split one (an
Ingress deployment in front of the engine deployment): same answers, same /v1/stats and /health shape, one
deployment instead of two. The other serve tests run the default layout; this file deploys both side by side."""

from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import CHAT_PROMPTS, ENGINE, MAX_TOKENS, deploy

pytestmark = [pytest.mark.serve, pytest.mark.model]

LAYOUTS = ("fused", "split")


@pytest.fixture(scope="module")
def apps(ray_serve):
    """{layout: base URL}: one colocated app per layout, same engine."""
    from ray import serve

    urls = {}
    try:
        for layout in LAYOUTS:
            urls[layout] = deploy(ray_serve, f"lay-{layout}", {"mode": "colocated", "engine": ENGINE,
                                                               "layout": layout})
        yield urls
    finally:
        for layout in urls:
            serve.delete(f"lay-{layout}")


def _deployments(app: str) -> set[str]:
    from ray import serve

    return set(serve.status().applications[app].deployments)


def _keys(d: dict) -> set[str]:
    return set(d)


def test_fused_is_one_deployment_and_split_two(apps):
    assert _deployments("lay-fused") == {"EngineReplica"}
    assert _deployments("lay-split") == {"Ingress", "EngineReplica"}


def test_fused_streams_a_chat_completion_to_the_openai_client(apps, reference):
    prompt = CHAT_PROMPTS[0]
    c = openai.OpenAI(base_url=f"{apps['fused']}/v1", api_key="none", timeout=300, max_retries=0)
    stream = c.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": prompt}],
                                       max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    text, n_tokens, ref_finish = reference[("chat", prompt, MAX_TOKENS)]
    assert "".join(parts) == text and finish == ref_finish
    assert usage is not None and usage.completion_tokens == n_tokens


def test_stats_and_health_have_the_split_layouts_shape(apps, reference):
    body = {"messages": [{"role": "user", "content": CHAT_PROMPTS[1]}], "max_tokens": MAX_TOKENS,
            "temperature": 0}
    got = {}
    for layout, base in apps.items():
        with httpx.Client(base_url=base, timeout=300) as h:
            before = h.get("/v1/stats").json()["arms"]["default"]["requests"]
            r = h.post("/v1/chat/completions", json=body)
            assert r.status_code == 200 and r.headers["X-Specray-Arm"] == "default"
            assert r.json()["choices"][0]["message"]["content"] == reference[("chat", CHAT_PROMPTS[1], MAX_TOKENS)][0]
            got[layout] = {"stats": h.get("/v1/stats").json(), "health": h.get("/health"),
                           "models": h.get("/v1/models").json(), "before": before}
    fused, split = got["fused"], got["split"]
    assert _keys(fused["stats"]) == _keys(split["stats"])
    assert _keys(fused["stats"]["arms"]["default"]) == _keys(split["stats"]["arms"]["default"])
    assert _keys(fused["stats"]["arms"]["default"]["engine"]) == _keys(split["stats"]["arms"]["default"]["engine"])
    assert _keys(fused["stats"]["ingress"]) == _keys(split["stats"]["ingress"])
    assert fused["stats"]["ingress"]["layout"] == "fused" and split["stats"]["ingress"]["layout"] == "split"
    # ServeConfig.user_code_loop's default reached the serving process (Serve read the variable at import)
    assert fused["stats"]["ingress"]["user_code_loop"] == split["stats"]["ingress"]["user_code_loop"] == "shared"
    # the fused ingress is the engine replica itself: same process
    assert fused["stats"]["ingress"]["pids"] == fused["stats"]["arms"]["default"]["engine"]["pids"]
    assert split["stats"]["ingress"]["pids"] != split["stats"]["arms"]["default"]["engine"]["pids"]
    for g in (fused, split):
        assert g["stats"]["arms"]["default"]["requests"] == g["before"] + 1  # counted once, by the ingress
    assert fused["health"].status_code == split["health"].status_code == 200
    assert fused["health"].json() == split["health"].json()
    assert fused["models"]["data"][0] | {"created": 0} == split["models"]["data"][0] | {"created": 0}
