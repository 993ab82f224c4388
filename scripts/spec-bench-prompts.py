#!/usr/bin/env python3
"""Writes N chat prompts from Spec-Bench as a JSONL for outside benchmark clients (guidellm).

Usage: python3 scripts/spec-bench-prompts.py OUT.jsonl [N] [OUTPUT_TOKENS] [QUESTION.jsonl]
  N              prompts (default 20), taken round-robin over the categories,
                 each a question's first turn
  OUTPUT_TOKENS  tokens to generate per prompt (default 128); guidellm reads
                 `output_tokens_count` and sends it as max_completion_tokens
                 with ignore_eos, so every server generates exactly that many
  QUESTION.jsonl default: $SPECRAY_SPEC_BENCH, else the repository's
                 bench/data/spec_bench.jsonl (Spec-Bench's 480 questions)

A line: {"prompt": TEXT, "output_tokens_count": 128, "category": CAT}; guidellm
sends `prompt` as the user message of a chat completion. Standard library
only, so any Python runs it (the guidellm venv included).
"""

from __future__ import annotations

import json
import os
import sys
from collections import OrderedDict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def default_questions() -> str:
    # the same default as specray.bench.prompts.default_prompts_path, found from the checkout rather than the
    # package: this script runs under any Python (the guidellm venv has no specray)
    for p in (os.environ.get("SPECRAY_SPEC_BENCH", ""), str(REPO / "bench" / "data" / "spec_bench.jsonl")):
        if p and os.path.isfile(p):
            return p
    sys.exit("spec-bench-prompts: Spec-Bench questions not found; pass them as the 4th argument "
             "or set SPECRAY_SPEC_BENCH")


def round_robin(entries: list[dict], n: int) -> list[dict]:
    """n entries, one category after another (Spec-Bench is sorted by category).

    >>> es = [{"category": c, "i": i} for c, i in [("a", 0), ("a", 1), ("b", 2), ("c", 3)]]
    >>> [e["i"] for e in round_robin(es, 3)], [e["i"] for e in round_robin(es, 9)]
    ([0, 2, 3], [0, 2, 3, 1])
    """
    by_cat: OrderedDict[str, list[dict]] = OrderedDict()
    for e in entries:
        by_cat.setdefault(e.get("category", "default"), []).append(e)
    out: list[dict] = []
    while len(out) < n and any(by_cat.values()):
        for items in by_cat.values():
            if items and len(out) < n:
                out.append(items.pop(0))
    return out


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 4:
        print(__doc__, file=sys.stderr)
        return 2
    out = argv[0]
    n = int(argv[1]) if len(argv) > 1 else 20
    tokens = int(argv[2]) if len(argv) > 2 else 128
    src = argv[3] if len(argv) > 3 else default_questions()
    if n < 1 or tokens < 1:
        sys.exit("spec-bench-prompts: N and OUTPUT_TOKENS must be >= 1")
    with open(src) as f:
        entries = [json.loads(line) for line in f if line.strip()]
    picked = round_robin(entries, n)
    with open(out, "w") as f:
        for e in picked:
            f.write(json.dumps({"prompt": e["turns"][0], "output_tokens_count": tokens,
                                "category": e.get("category", "default")}) + "\n")
    print(f"wrote {len(picked)} prompts x {tokens} output tokens to {out} (from {src})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
