"""Training prompts the target writes itself (Magpie: Xu et al. 2024, "Alignment Data Synthesis from Scratch by
Prompting Aligned LLMs with Nothing").

An instruct model given its chat template up to where a user's first message
goes writes a user message: the kind of request its own fine-tuning data held
(for SmolLM2: stories, emails, code, advice, explanations). Sampled, those are
as many distinct chat prompts as there is time for, with no data set and none
of the prompts the bench measures on: the head then learns on answers to chat like the
chat it will serve, where a few hundred Spec-Bench questions of other
categories (question answering, translation, maths) teach it other text.

The prompts are written once per work dir (`self_prompts.jsonl` beside the
shards) and read back on resume, so the answer jobs, which index them, stay
the same across runs.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from .prompts import TrainPrompt

CATEGORY = "self"
_SENTINEL = "\x00specray-user-message\x00"


def query_prefix(model) -> str:
    """The chat template's text up to where a user's first message goes (its default system prompt included).
    ValueError for a template that does not place the message's text verbatim."""
    text = model.apply_chat_template([{"role": "user", "content": _SENTINEL}], add_generation_prompt=False)
    at = text.find(_SENTINEL)
    if at <= 0:
        raise ValueError(f"the chat template of {model.name} does not show where a user message goes; "
                         "--self-prompts needs one that does")
    return text[:at]


def clean_query(text: str, finished: bool, min_chars: int = 16) -> str | None:
    """A written user message worth answering: stripped, None if cut off by the token limit (`finished`
    False), too short, or not printable text.

    >>> clean_query("  How do I bake rye bread at home?  ", True)
    'How do I bake rye bread at home?'
    >>> clean_query("Hi!", True) is None, clean_query("Write a poem about the sea and", False) is None
    (True, True)
    """
    text = text.strip()
    if not finished or len(text) < min_chars or "\ufffd" in text or "<|" in text:
        return None
    return text


def read_self_prompts(path: str) -> list[TrainPrompt]:
    with open(path) as f:
        return [TrainPrompt(CATEGORY, messages=[{"role": "user", "content": json.loads(line)["content"]}])
                for line in f if line.strip()]


def write_self_prompts(eng, n: int, path: str, *, seed: int, temperature: float, max_tokens: int = 96,
                       deadline: float | None = None, progress=print) -> list[TrainPrompt]:
    """`n` user messages written by `eng`'s target (sampled at `temperature`, seeded), saved to `path` (JSONL)
    and returned; fewer if time.monotonic() passes `deadline` first. An existing `path` is read back instead
    (resume)."""
    from specray.engine.sampling import SamplingParams

    if os.path.exists(path):
        return read_self_prompts(path)
    model = eng.model
    prefix = query_prefix(model)
    tokens = model.template_tokens(prefix)
    out: list[str] = []
    seen: set[str] = set()
    t0, k, tries = time.monotonic(), 0, 0
    shown = t0
    while len(out) < n:
        if deadline is not None and time.monotonic() > deadline:
            progress(f"data: the generating budget ran out after {len(out)} of {n} prompts of the target's own")
            break
        if tries > 4 * n + 64:
            raise ValueError(f"the target wrote only {len(out)} usable user messages in {tries} tries")
        batch = max(eng.config.slots, 1) * 2
        reqs = []
        for _ in range(batch):
            req = eng.request(prefix, max_tokens=max_tokens,
                              sampling=SamplingParams(temperature=temperature, seed=seed * 7919 + k))
            req.prompt_tokens = np.asarray(tokens, dtype=np.int32)
            reqs.append(req)
            k += 1
        for seq in eng.run(reqs):
            tries += 1
            text = clean_query(model.detokenize(seq.generated), seq.finish_reason == "stop")
            if text is not None and text not in seen and len(out) < n:
                seen.add(text)
                out.append(text)
        if time.monotonic() - shown > 10 or len(out) >= n:
            shown = time.monotonic()
            progress(f"data: the target wrote {len(out)}/{n} prompts of its own ({tries} tried, "
                     f"{shown - t0:.0f} s)")
    tmp = path + ".part"
    with open(tmp, "w") as f:
        f.writelines(json.dumps({"category": CATEGORY, "content": t}) + "\n" for t in out)
    os.replace(tmp, path)
    return read_self_prompts(path)
