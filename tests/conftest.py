"""Shared fixtures: one loaded model per process, engines built on it."""

from __future__ import annotations

import json

import pytest

from specray.bench.prompts import SPEC_BENCH, default_prompts_path  # noqa: F401  (SPEC_BENCH: the shipped file)


def spec_bench_questions() -> list[dict]:
    """The questions `specray bench` reads by default: $SPECRAY_SPEC_BENCH, else the shipped Spec-Bench."""
    with open(default_prompts_path()) as f:
        return [json.loads(line) for line in f if line.strip()]


def spec_bench_prompts(n: int, per_category: int = 1) -> list[str]:
    """n first-turn questions, spread over categories (per_category each, in file order)."""
    seen: dict[str, int] = {}
    out = []
    for q in spec_bench_questions():
        cat = q.get("category", "")
        if seen.get(cat, 0) >= per_category:
            continue
        seen[cat] = seen.get(cat, 0) + 1
        out.append(q["turns"][0])
        if len(out) == n:
            break
    return out


@pytest.fixture(scope="session")
def smollm2():
    from specray.native.model import Model

    return Model("smollm2-135m", use_extra_bufts=False)  # exact-mode capable


@pytest.fixture(scope="session")
def gemma3():
    from specray.native.model import Model

    return Model("gemma3-270m", use_extra_bufts=False)  # exact-mode capable
