"""A/B arms: config, --arm flags, weighted sticky assignment, per-arm stats aggregation (no Ray, no model)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from pydantic import ValidationError

from specray.deployments.app import arm_serve_config, build_app, replica_options
from specray.deployments.ab.stats import ArmRecords, aggregate_replicas, merge_snapshots
from specray.deployments.ab.arms import (
    ArmConfig,
    ArmTable,
    autoscaling_config,
    choose_arm,
    parse_arm_flag,
    resolve_arms,
    sticky_point,
)
from specray.cli.main import build_parser
from specray.cli.serve import config_from_args
from specray.deployments.config import load_serve_config
from specray.engine.config import ChainConfig


def test_choose_arm_slices_unit_interval_by_weight_and_skips_zero_weights():
    names, w = ["a", "b", "c"], [1.0, 0.0, 3.0]
    assert choose_arm(names, w, 0.0) == "a"
    assert choose_arm(names, w, 0.2499) == "a"
    assert choose_arm(names, w, 0.25) == "c"  # b has no slice
    assert choose_arm(names, w, 0.999999) == "c"
    with pytest.raises(ValueError):
        choose_arm(names, [0, 0, 0], 0.5)


def test_sticky_keys_split_close_to_weights_and_always_land_on_the_same_arm():
    t = ArmTable([ArmConfig(name="base", weight=1), ArmConfig(name="fast", weight=3)], salt="exp1")
    users = [f"user-{i}" for i in range(20000)]
    first = {u: t.pick(key=u) for u in users}
    share = Counter(first.values())["fast"] / len(users)
    assert abs(share - 0.75) < 0.015
    assert all(t.pick(key=u) == arm for u, arm in list(first.items())[:500])
    # another table (another process) with the same salt agrees; another salt reshuffles
    t2 = ArmTable([ArmConfig(name="base", weight=1), ArmConfig(name="fast", weight=3)], salt="exp1")
    assert all(t2.pick(key=u) == first[u] for u in users[:500])
    t3 = ArmTable([ArmConfig(name="base", weight=1), ArmConfig(name="fast", weight=3)], salt="exp2")
    assert sum(t3.pick(key=u) != first[u] for u in users[:2000]) > 300


def test_unkeyed_requests_follow_weights_forced_arm_wins_and_unknown_is_an_error():
    t = ArmTable([ArmConfig(name="a", weight=1), ArmConfig(name="b", weight=1), ArmConfig(name="off", weight=0)],
                 rng=random.Random(3))
    c = Counter(t.pick() for _ in range(4000))
    assert c["off"] == 0 and abs(c["a"] - 2000) < 150
    assert t.pick(forced="off", key="u1") == "off"  # the header reaches a weight-0 arm
    with pytest.raises(ValueError, match="unknown arm 'zzz'.*a, b, off"):
        t.pick(forced="zzz")


def test_weight_change_moves_only_the_users_at_the_border():
    t = ArmTable([ArmConfig(name="a", weight=1), ArmConfig(name="b", weight=1)], salt="s")
    users = [f"u{i}" for i in range(5000)]
    before = {u: t.pick(key=u) for u in users}
    t.set_weights({"a": 3})  # a: 0.5 -> 0.75
    after = {u: t.pick(key=u) for u in users}
    moved = [u for u in users if before[u] != after[u]]
    assert all(before[u] == "b" and after[u] == "a" for u in moved)
    assert abs(len(moved) / len(users) - 0.25) < 0.03
    with pytest.raises(ValueError, match="unknown arm"):
        t.set_weights({"c": 1})
    with pytest.raises(ValueError, match="positive"):
        t.set_weights({"a": 0, "b": 0})
    assert t.weights == [3.0, 1.0]  # a refused update changes nothing


def test_sticky_point_is_uniform_enough():
    pts = [sticky_point(f"k{i}", "salt") for i in range(10000)]
    assert 0 <= min(pts) and max(pts) < 1
    hist = Counter(int(p * 10) for p in pts)
    assert all(900 < hist[b] < 1100 for b in range(10))


def test_arm_flag_parsing():
    a = parse_arm_flag("fast=ngram_mod,suffix@2.5")
    assert (a.name, a.chain, a.weight) == ("fast", ["ngram_mod", "suffix"], 2.5)
    b = parse_arm_flag("base=none")
    assert (b.chain, b.weight) == ([], 1.0)
    for bad, words in (("fast", "NAME=CHAIN"), ("=none@1", "NAME=CHAIN"), ("x=none@lots", "not a number"),
                       ("x=none@-1", "greater than or equal"), ("bad name=none", "arm name"),
                       ("x=none,suffix", "none")):
        with pytest.raises(ValueError, match=words):
            parse_arm_flag(bad)


def test_arm_chain_is_the_engine_chain_with_overrides():
    base = ChainConfig(speculators=["ngram_mod", "suffix"], params={"suffix": {"min_match": 3, "p_min": 0.2}},
                       n_max=12, policy="first")
    arm = ArmConfig(name="x", chain="suffix", params={"suffix": {"p_min": 0.05}}, n_max=4)
    c = arm.chain_config(base)
    assert c.speculators == ["suffix"] and c.n_max == 4 and c.policy == "first"
    assert c.params["suffix"] == {"min_match": 3, "p_min": 0.05}
    assert ArmConfig(name="y").chain_config(base) == base


def test_config_without_arms_is_one_default_arm_deployed_as_before():
    cfg = load_serve_config({})
    arms = resolve_arms(cfg)
    assert [a.name for a in arms] == ["default"] and arm_serve_config(cfg, arms[0]).engine == cfg.engine
    # the ingress's {model: {arm: engine deployment}}
    (engines,) = build_app({"layout": "split"})._bound_deployment.init_args[0].values()
    assert {k: v._bound_deployment.name for k, v in engines.items()} == {"default": "EngineReplica"}
    with pytest.raises(ValidationError, match="unique"):
        load_serve_config({"arms": [{"name": "a"}, {"name": "a"}]})
    with pytest.raises(ValidationError, match="positive weight"):
        load_serve_config({"arms": [{"name": "a", "weight": 0}]})


def test_arm_deployments_get_their_chain_scaling_and_user_config():
    cfg = load_serve_config({"engine": {"slots": 8}, "autoscaling": {"min_replicas": 1, "max_replicas": 4},
                             "arms": [{"name": "base", "chain": "none"},
                                      {"name": "fast", "chain": "ngram_mod,suffix", "weight": 3,
                                       "autoscaling": {"min_replicas": 2, "max_replicas": 6,
                                                       "target_ongoing_requests": 5}}]})
    base, fast = (arm_serve_config(cfg, a) for a in cfg.arms)
    assert base.engine.chain.speculators == [] and fast.engine.chain.speculators == ["ngram_mod", "suffix"]
    # the LLM default: ongoing requests per replica against its slots; an explicit target wins
    assert replica_options(base)["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4,
                                                           "target_ongoing_requests": 8}
    assert replica_options(fast)["autoscaling_config"]["target_ongoing_requests"] == 5
    assert autoscaling_config(None, 8) is None
    ingress = build_app(cfg.model_dump())._bound_deployment
    assert ingress.user_config == {"weights": {"base": 1.0, "fast": 3.0}}
    (arms,) = ingress.init_args[0].values()
    engines = {k: v._bound_deployment for k, v in arms.items()}
    assert {k: d.name for k, d in engines.items()} == {"base": "EngineReplica-base", "fast": "EngineReplica-fast"}
    assert engines["fast"].user_config["chain"]["speculators"] == ["ngram_mod", "suffix"]
    assert engines["fast"].init_args[1] == "fast"  # the arm name: metrics label, /v1/stats


def test_serve_arm_flags_over_the_config_file(tmp_path):
    f = tmp_path / "ab.yaml"
    f.write_text("arms:\n  - {name: fast, chain: suffix, params: {suffix: {min_match: 2}}, "
                 "autoscaling: {max_replicas: 3}}\n  - {name: old, chain: ngram_mod}\n")
    p = build_parser()
    cfg = config_from_args(p.parse_args(["serve", "--config", str(f), "--arm", "base=none@1",
                                         "--arm", "fast=ngram_mod,suffix@2"]))
    assert [(a.name, a.chain, a.weight) for a in cfg.arms] == [("base", [], 1.0),
                                                              ("fast", ["ngram_mod", "suffix"], 2.0)]
    fast = cfg.arms[1]
    assert fast.params == {"suffix": {"min_match": 2}} and fast.autoscaling == {"max_replicas": 3}
    assert [a.name for a in config_from_args(p.parse_args(["serve", "--config", str(f)])).arms] == ["fast", "old"]
    with pytest.raises(ValueError, match="unique"):
        config_from_args(p.parse_args(["serve", "--arm", "a=none", "--arm", "a=suffix"]))


def _end(tokens: int, drafts: int, drafted: int, accepted: int, itl: float = 0.02) -> dict:
    return {"type": "end", "finish_reason": "length",
            "usage": {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": tokens + 5},
            "speculative": {"drafts": drafts, "drafted_tokens": drafted, "accepted_tokens": accepted},
            "timing": {"ttft_s": 0.1, "itl_s": itl, "e2e_s": 0.1 + itl * (tokens - 1)}}


def test_arm_records_totals_caps_and_merge_across_ingress_replicas():
    a, b = ArmRecords(max_records=3), ArmRecords(max_records=3)
    for i in range(5):
        a.add(_end(10, 2, 8, 4))
    a.add_error(503)
    b.add(_end(20, 1, 4, 4))
    m = merge_snapshots([a.snapshot(), b.snapshot()])
    assert m["requests"] == 6 and m["errors"] == 1 and m["error_statuses"] == {"503": 1}
    assert m["completion_tokens"] == 70 and m["drafts"] == 11 and m["accepted_tokens"] == 24
    assert len(m["records"]["completion_tokens"]) == 4  # 3 kept by a (capped) + 1 by b
    assert m["mean_acceptance_length"] == pytest.approx(1 + 24 / 11)
    assert m["acceptance_rate"] == pytest.approx(24 / 44)


def test_stage_means_merge_across_ingress_replicas():
    a, b = ArmRecords(max_records=3), ArmRecords(max_records=3)
    a.add_stages({"ingress_parse_ms": 1.0, "handle_ms": 2.0, "decode_ms": 100.0, "proxy_ms": 9.0})
    a.add_stages({"ingress_parse_ms": 3.0, "handle_ms": 4.0, "decode_ms": 200.0})
    b.add_stages({"ingress_parse_ms": 5.0, "handle_ms": None, "decode_ms": 300.0})
    st = merge_snapshots([a.snapshot(), b.snapshot()])["stages_ms"]
    assert st["requests"] == 3 and st["ingress_parse_ms"] == 3.0 and st["decode_ms"] == 200.0
    assert st["handle_ms"] == 2.0  # a missing figure counts as 0 (every stream reports all of them)
    assert "proxy_ms" not in st  # only the client can see the proxy leg
    assert merge_snapshots([ArmRecords(3).snapshot()])["stages_ms"] == {"requests": 0}


def test_replica_stats_are_summed_per_arm():
    spec = {"drafts_chosen": 3, "tokens_generated": 12, "tokens_accepted": 5, "accepted_per_pos": [3, 2]}
    r1 = {"slots": 4, "active": 1, "queued": 0, "free_slots": 3, "scheduler": {"rounds": 10},
          "speculators": {"ngram_mod": spec, "suffix": spec | {"accepted_per_pos": [1]}},
          "process": {"pid": 11}, "replica_id": "r1", "chain": "ngram_mod,suffix", "mode": "colocated"}
    r2 = r1 | {"active": 2, "free_slots": 2, "process": {"pid": 12}, "replica_id": "r2", "speculators": {}}
    agg = aggregate_replicas([r1, r2, RuntimeError("gone")])
    assert agg["replicas"] == 2 and agg["pids"] == [11, 12] and agg["slots"] == 8 and agg["active"] == 3
    assert agg["scheduler"]["rounds"] == 20 and "RuntimeError: gone" in agg["errors"][0]
    assert agg["speculators"]["drafts"] == 6 and agg["speculators"]["accepted_per_pos"] == [4, 2]
