"""Which of `specray bench`'s prompts fit a sequence's share of the context, checked before anything runs.

In exact mode each slot has a KV stream of its own, so `--slots 4` leaves a sequence a quarter of --n-ctx;
a long prompt that the scheduler refuses midway would stop the whole run after minutes of it. The bench
asks admission_plan (the scheduler's own arithmetic) what each prompt needs under each configuration,
skips those that cannot fit, says which, and what --n-ctx would fit them all (native.context.n_ctx_for_seq).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from specray.engine.config import ChainConfig
from specray.engine.request import GenerationRequest, admission_plan
from specray.engine.sampling import SamplingParams
from specray.native.context import n_ctx_for_seq

from .shapes import chain_of

#: skipped prompts named in the line that reports them; the JSON names every one
NAMED_MAX = 12


def bench_request(tokens: np.ndarray, max_tokens: int, config: str, grammar: str | None = None) -> GenerationRequest:
    """The request a configuration's run submits for a prompt (`grammar`: GBNF its output follows)."""
    return GenerationRequest(prompt_tokens=tokens, max_tokens=max_tokens, chain=tuple(chain_of(config)),
                             sampling=SamplingParams(grammar=grammar))


def cells_needed(n_prompt: int, max_tokens: int, configs: list[str], chain: ChainConfig) -> int:
    """KV cells a prompt of `n_prompt` tokens needs in the most demanding configuration (a speculating one
    reserves room for a full draft).

    >>> cells_needed(926, 128, ["none", "suffix"], ChainConfig(speculators=[], n_max=16))
    1071
    >>> cells_needed(926, 128, ["none"], ChainConfig(speculators=[], n_max=16))
    1055
    """
    toks = np.zeros(n_prompt, dtype=np.int32)
    return max(admission_plan(bench_request(toks, max_tokens, c), chain, None)[2] for c in configs)


@dataclass
class ContextFit:
    """The prompts split by whether they fit: indices into the prompt list, in order."""

    n_ctx_seq: int  # cells one sequence may use
    cells: list[int]  # what each prompt needs
    kept: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    n_ctx_all: int = 0  # the --n-ctx that fits every prompt


def fit_prompts(cells: list[int], n_ctx_seq: int, slots: int, kv_unified: bool) -> ContextFit:
    """Split prompts needing `cells` KV cells each by whether they fit `n_ctx_seq`.

    >>> f = fit_prompts([300, 1100, 500], n_ctx_seq=512, slots=2, kv_unified=False)
    >>> f.kept, f.skipped, f.n_ctx_all
    ([0, 2], [1], 2560)
    """
    fit = ContextFit(n_ctx_seq, list(cells), n_ctx_all=n_ctx_for_seq(max(cells), slots, kv_unified))
    for i, c in enumerate(cells):
        (fit.kept if c <= n_ctx_seq else fit.skipped).append(i)
    return fit


def prompt_labels(ids: list[str | None], categories: list[str]) -> list[str]:
    """How a report names each prompt: category/id, or category#n (n-th of its category) without an id.

    >>> prompt_labels(["95", None, None], ["summarization", "qa", "qa"])
    ['summarization/95', 'qa#1', 'qa#2']
    """
    seen: dict[str, int] = {}
    out = []
    for pid, cat in zip(ids, categories):
        seen[cat] = seen.get(cat, 0) + 1
        out.append(f"{cat}/{pid}" if pid is not None else f"{cat}#{seen[cat]}")
    return out


def context_text(n_ctx_seq: int, n_ctx: int, slots: int, kv_unified: bool) -> str:
    """Where a sequence's share of the context comes from, in the flags' words.

    >>> context_text(1024, 4096, 4, kv_unified=False)
    '1024 cells per sequence: --n-ctx 4096 split over 4 slots, one KV stream each (--exact)'
    >>> context_text(4096, 4096, 4, kv_unified=True)
    '4096 cells per sequence (--n-ctx 4096)'
    """
    if kv_unified or slots == 1:
        return f"{n_ctx_seq} cells per sequence (--n-ctx {n_ctx})"
    return f"{n_ctx_seq} cells per sequence: --n-ctx {n_ctx} split over {slots} slots, one KV stream each (--exact)"


def skip_message(fit: ContextFit, labels: list[str], context: str) -> str:
    """The line that reports skipped prompts (or, when none is left, the error).

    >>> f = fit_prompts([300, 1100, 500], n_ctx_seq=512, slots=2, kv_unified=False)
    >>> print(skip_message(f, ["a#1", "a#2", "b#1"], "512 cells per sequence"))  # doctest: +NORMALIZE_WHITESPACE
    skipping 1 of 3 prompts too long for the context (512 cells per sequence): a#2 (1100 cells); --n-ctx 2560
    fits them all
    >>> one = skip_message(fit_prompts([900], 512, 2, False), ["a#1"], "512 cells per sequence")
    >>> print(one)  # doctest: +NORMALIZE_WHITESPACE
    every prompt (1) is too long for the context (512 cells per sequence): a#1 (900 cells); --n-ctx 2048
    fits them all
    """
    named = ", ".join(f"{labels[i]} ({fit.cells[i]} cells)" for i in fit.skipped[:NAMED_MAX])
    if len(fit.skipped) > NAMED_MAX:
        named += f" and {len(fit.skipped) - NAMED_MAX} more"
    n = len(fit.cells)
    head = (f"every prompt ({n}) is too long" if not fit.kept else
            f"skipping {len(fit.skipped)} of {n} prompts too long")
    return f"{head} for the context ({context}): {named}; --n-ctx {fit.n_ctx_all} fits them all"


def check_prompts(engine, prompts: list, configs: list[str], max_tokens: int) -> tuple[ContextFit, list[str], str]:
    """(the split, each prompt's label, the report line or '') for the bench's prompts on `engine` (a
    LocalEngine: its chat template tokenizes them as the run will, its context sets the room)."""
    chain = engine.scheduler.config.chain
    cells = [cells_needed(len(engine.prompt_tokens(p.prompt, p.messages)), max_tokens, configs, chain)
             for p in prompts]
    slots, unified = engine.config.slots, engine.ctx.kv_unified
    fit = fit_prompts(cells, engine.parts.n_ctx_seq, slots, unified)
    labels = prompt_labels([p.id for p in prompts], [p.category for p in prompts])
    context = context_text(engine.parts.n_ctx_seq, engine.config.n_ctx, slots, unified)
    return fit, labels, skip_message(fit, labels, context) if fit.skipped else ""
