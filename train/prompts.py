"""Training prompts: a JSONL file, categories in or out."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class TrainPrompt:
    category: str
    messages: list[dict] | None = None  # chat
    prompt: str | None = None  # raw text


def read_prompts(path: str, include: list[str] | None = None, exclude: list[str] | tuple = (),
                 skip_first: int = 0) -> list[TrainPrompt]:
    """Prompts of `path` ('prompt' raw, 'messages' chat or Spec-Bench's 'turns', first turn; optional
    'category'), those of `include` only (None: all) and none of `exclude`, less the first `skip_first` of
    each category (the ones `specray bench --per-category N` measures on, for N <= skip_first). ValueError
    naming the categories there are when nothing is left."""
    out, seen = [], set()
    skipped: dict[str, int] = {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e})") from None
            cat = str(obj.get("category", "default"))
            seen.add(cat)
            if (include is not None and cat not in include) or cat in exclude:
                continue
            if skipped.get(cat, 0) < skip_first:
                skipped[cat] = skipped.get(cat, 0) + 1
                continue
            if "prompt" in obj:
                out.append(TrainPrompt(cat, prompt=str(obj["prompt"])))
            elif "messages" in obj:
                out.append(TrainPrompt(cat, messages=list(obj["messages"])))
            elif "turns" in obj:
                out.append(TrainPrompt(cat, messages=[{"role": "user", "content": str(obj["turns"][0])}]))
            else:
                raise ValueError(f"{path}:{lineno}: needs 'prompt', 'messages' or 'turns'")
    unknown = sorted(set(include or ()) - seen) + sorted(set(exclude) - seen)
    if unknown:
        raise ValueError(f"{path} has no category {', '.join(unknown)} (it has: {', '.join(sorted(seen))})")
    if not out:
        raise ValueError(f"no prompts left in {path} (categories there: {', '.join(sorted(seen))})")
    return out
