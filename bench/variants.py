"""The bench's parameter axis: a configuration can carry its speculators' parameters, or ask for online tuning.

    CHAIN/NAME.KEY=VALUE/...    CHAIN with those parameters (over --spec-param's), e.g. suffix/suffix.p_min=0.2
    CHAIN+tune                  CHAIN tuning its speculators' look-up parameters online (ChainConfig.tune),
                                starting from --spec-param's
    CHAIN+trees, CHAIN+linear   CHAIN with draft trees on or off (ChainConfig.trees; else its default, off)

`specray bench --tune-sweep` turns each chain into: the chain as configured, `CHAIN+tune`, and one fixed
configuration per point of each speculator's tuning grid (engine/policy/tuning.py), so the tuned run is measured
against the best fixed setting in the same run. Every configuration has its own chain (own tables), as
always in the bench.
"""

from __future__ import annotations

import json
from typing import Any

from specray.engine.config import ChainConfig, parse_chain
from specray.engine.policy.tuning import DEFAULT_GRIDS, settings_of

TUNE = "+tune"
TREE_SUFFIXES = {"+trees": True, "+linear": False}


def _value(text: str) -> Any:
    """A parameter value: JSON where it parses (numbers, true/false, null), else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_params(items: list[str]) -> dict[str, dict[str, Any]]:
    """NAME.KEY=VALUE items -> {NAME: {KEY: VALUE}}; ValueError names a malformed one.

    >>> parse_params(["suffix.p_min=0.2", "suffix.min_match=3", "ngram_mod.n_min=4"])
    {'suffix': {'p_min': 0.2, 'min_match': 3}, 'ngram_mod': {'n_min': 4}}
    >>> parse_params(["p_min=0.2"])
    Traceback (most recent call last):
    ...
    ValueError: parameter 'p_min=0.2': expected SPECULATOR.KEY=VALUE
    """
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, eq, value = item.partition("=")
        name, dot, field = key.partition(".")
        if not (eq and dot and name and field):
            raise ValueError(f"parameter {item!r}: expected SPECULATOR.KEY=VALUE")
        out.setdefault(name.strip(), {})[field.strip()] = _value(value.strip())
    return out


def variant(label: str) -> tuple[str, dict[str, dict[str, Any]], bool]:
    """A configuration's chain label (shape and tree suffixes already split off), its own parameters, and
    whether it tunes.

    >>> variant("ngram_mod,suffix/suffix.p_min=0.2")
    ('ngram_mod,suffix', {'suffix': {'p_min': 0.2}}, False)
    >>> variant("suffix+tune")
    ('suffix', {}, True)
    """
    tune = label.endswith(TUNE)
    if tune:
        label = label[: -len(TUNE)]
    chain, *items = label.split("/")
    return chain, parse_params(items), tune


def tree_mode(label: str) -> tuple[str, bool | None]:
    """(the label without its tree suffix, trees on or off; None: the chain's default).

    >>> tree_mode("ngram_mod,suffix+trees"), tree_mode("suffix+linear"), tree_mode("suffix+tune")
    (('ngram_mod,suffix', True), ('suffix', False), ('suffix+tune', None))
    """
    for suffix, on in TREE_SUFFIXES.items():
        if label.endswith(suffix):
            return label[: -len(suffix)], on
    return label, None


def chain_config(label: str, base: dict[str, dict[str, Any]], policy: str, n_max: int) -> ChainConfig:
    """The ChainConfig of a configuration: its chain, `base` parameters with its own over them, tuning, trees."""
    label, trees = tree_mode(label)
    chain, own, tune = variant(label)
    params = {k: dict(v) for k, v in base.items()}
    for name, p in own.items():
        params.setdefault(name, {}).update(p)
    return ChainConfig(speculators=parse_chain(chain), policy=policy, n_max=n_max, params=params, tune=tune,
                       **({} if trees is None else {"trees": trees}))


def _label(chain: str, name: str, point: dict[str, Any]) -> str:
    return chain + "".join(f"/{name}.{k}={json.dumps(v)}" for k, v in point.items())


def sweep_configs(configs: list[str], base: dict[str, dict[str, Any]], defaults) -> list[str]:
    """--tune-sweep: each chain as configured, tuned, and at every point of its speculators' grids (one
    speculator at a time, the others as configured). `defaults(name)`: a speculator's default parameters.

    >>> sweep_configs(["none", "ngram_cache"], {"ngram_cache": {"n_draft": 4}}, lambda n: {"n_draft": 8})
    ['none', 'ngram_cache', 'ngram_cache+tune', 'ngram_cache/ngram_cache.n_draft=2', 'ngram_cache/ngram_cache.n_draft=8', 'ngram_cache/ngram_cache.n_draft=16']
    """
    out: list[str] = []
    for c in configs:
        chain, own, tune = variant(c)
        names = parse_chain(chain)
        if not names or own or tune:
            out.append(c)
            continue
        out += [c, c + TUNE]
        for name in names:
            configured = defaults(name) | base.get(name, {})
            out += [_label(chain, name, s) for s in settings_of(configured, DEFAULT_GRIDS.get(name, []))[1:]]
    return list(dict.fromkeys(out))


def held_out_winners(speedups: dict[str, list[float]], chain: str) -> list[dict[str, Any]]:
    """--tune-sweep with --repeats >= 2: the tuned chain against the sweep's winner chosen on the *other*
    passes, pass by pass. The best of many fixed settings in one pass is flattered by that pass's noise (the
    same setting on the same texts reads differently from pass to pass); a winner picked on other
    passes is a fair opponent. `speedups`: label -> speedup over `none` per pass.

    >>> sp = {"c+tune": [1.08, 1.00], "c/x=1": [1.23, 0.99], "c/x=2": [0.97, 1.01], "c": [0.95, 0.98]}
    >>> [(w["pass"], w["winner"], w["ratio"]) for w in held_out_winners(sp, "c")]
    [(1, 'c/x=2', 1.113), (2, 'c/x=1', 1.01)]
    """
    tuned, fixed = speedups.get(chain + TUNE), [k for k in speedups if k.startswith(chain + "/")]
    if not tuned or not fixed or len(tuned) < 2:
        return []
    out = []
    for p in range(len(tuned)):
        def others(label: str) -> float:
            return sum(v for q, v in enumerate(speedups[label]) if q != p)

        win = max(fixed, key=others)
        out.append({"pass": p + 1, "winner": win, "winner_speedup": round(speedups[win][p], 3),
                    "tuned_speedup": round(tuned[p], 3), "ratio": round(tuned[p] / speedups[win][p], 3)})
    return out
