"""`specray bench`'s prompts: a JSONL file (Spec-Bench's questions by default), by category."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"  # shipped with the package (pyproject's package-data)
SPEC_BENCH = DATA_DIR / "spec_bench.jsonl"


def bundled_prompts(name: str) -> str:
    """Path of a prompt file shipped in the package's data folder, found from this module's own directory
    so that it resolves the same from a clone, an editable install or a wheel.

    >>> Path(bundled_prompts("json_extraction.jsonl")).name
    'json_extraction.jsonl'
    """
    path = DATA_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such prompt file in the package (is the install complete?)")
    return str(path)


def default_prompts_path() -> str:
    """The prompts `specray bench` and `specray train-head` read without --prompts: $SPECRAY_SPEC_BENCH when
    set, else Spec-Bench's 480 questions shipped in the package (bench/data/spec_bench.jsonl).

    >>> path = default_prompts_path()
    >>> path == os.environ.get("SPECRAY_SPEC_BENCH") or path == str(SPEC_BENCH)
    True
    """
    override = os.environ.get("SPECRAY_SPEC_BENCH")
    if override:
        if not os.path.isfile(override):
            raise FileNotFoundError(f"SPECRAY_SPEC_BENCH={override}: no such file")
        return override
    return bundled_prompts(SPEC_BENCH.name)


@dataclass
class BenchPrompt:
    category: str
    prompt: str | None = None
    messages: list[dict] | None = None
    id: str | None = None  # the file's `question_id` or `id`, to name the prompt in reports
    json_schema: dict | None = None  # the output must follow this JSON schema (structured outputs)
    grammar: str | None = None  # or this GBNF grammar


def prompt_grammar(bp: BenchPrompt) -> str | None:
    """The GBNF a prompt's output must follow (its grammar, or its JSON schema's), None for free text."""
    if bp.grammar is not None:
        return bp.grammar
    if bp.json_schema is None:
        return None
    from specray.native.grammar import schema_to_gbnf

    return schema_to_gbnf(bp.json_schema)


def read_jsonl(path: str):
    """(line number, object) of each non-blank line of a JSONL file; ValueError naming the line that is not JSON."""
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e})") from None


def load_prompts(path: str, categories: list[str] | None, per_category: int | None) -> list[BenchPrompt]:
    """JSONL with `prompt` (raw text) or `messages` (chat), or Spec-Bench's `turns`; optional `category`,
    `question_id` or `id` (names the prompt in reports), and `json_schema` (a JSON schema) or `grammar` (GBNF)
    the output must follow (bench/data/json_extraction.jsonl)."""
    out: list[BenchPrompt] = []
    counts: dict[str, int] = defaultdict(int)
    for lineno, obj in read_jsonl(path):
        cat = str(obj.get("category", "default"))
        if categories and cat not in categories:
            continue
        if per_category is not None and counts[cat] >= per_category:
            continue
        if "prompt" in obj:
            bp = BenchPrompt(cat, prompt=str(obj["prompt"]))
        elif "messages" in obj:
            bp = BenchPrompt(cat, messages=list(obj["messages"]))
        elif "turns" in obj:
            bp = BenchPrompt(cat, messages=[{"role": "user", "content": obj["turns"][0]}])
        else:
            raise ValueError(f"{path}:{lineno}: needs 'prompt', 'messages' or 'turns'")
        pid = obj.get("question_id", obj.get("id"))
        bp.id = None if pid is None else str(pid)
        if obj.get("json_schema") is not None and not isinstance(obj["json_schema"], dict):
            raise ValueError(f"{path}:{lineno}: json_schema must be a JSON object")
        bp.json_schema, bp.grammar = obj.get("json_schema"), obj.get("grammar")
        counts[cat] += 1
        out.append(bp)
    if not out:
        raise ValueError(f"no prompts selected from {path} (categories={categories})")
    return out
