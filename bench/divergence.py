"""Greedy output of a configuration against `none`'s: identical, a divergence at a near-tie (the kernels are
not batch-invariant, so a near-tie may flip), or a mismatch (a real difference: a bug, at temperature 0)."""

from __future__ import annotations

from .report import ConfigResult


def divergence_margin(base_tokens: list[int], tokens: list[int], base_margins: list[float]) -> float | None:
    """The `none` run's top-2 logit margin where `tokens` first differs from `base_tokens` (None: identical;
    if one stopped early, EOS vs a different token, the stop position decides; inf: no margin recorded).

    >>> divergence_margin([5, 6, 7], [5, 9, 7], [3.0, 0.2, 4.0])
    0.2
    >>> divergence_margin([5, 6, 7], [5, 6], [3.0, 0.2, 4.0])   # stopped early: the stop position decides
    4.0
    >>> divergence_margin([5, 6], [5, 6], [3.0, 0.2]) is None
    True
    """
    n = min(len(base_tokens), len(tokens))
    i = next((i for i in range(n) if base_tokens[i] != tokens[i]), None)
    if i is None:
        if len(base_tokens) == len(tokens):
            return None
        i = n
    return float(base_margins[i]) if i < len(base_margins) else float("inf")


def classify_divergence(base_tokens: list[int], tokens: list[int], base_margins: list[float],
                        tie_bound: float) -> str:
    """'identical', 'tie_divergence' or 'mismatch' (first differing position decides).

    >>> classify_divergence([5, 6, 7], [5, 9, 1], [3.0, 0.2, 4.0], tie_bound=0.5)
    'tie_divergence'
    """
    margin = divergence_margin(base_tokens, tokens, base_margins)
    if margin is None:
        return "identical"
    return "tie_divergence" if margin <= tie_bound else "mismatch"


def compare_runs(r: ConfigResult, base_seqs: list, seqs: list, tie_bound: float) -> None:
    """Count each sequence of `seqs` as identical to, tie-diverging from or mismatching `none`'s."""
    for b, s in zip(base_seqs, seqs):
        kind = classify_divergence(b.generated, s.generated, b.margins, tie_bound)
        r.compared += 1
        if kind == "identical":
            r.identical += 1
        elif kind == "mismatch":
            r.mismatches += 1
            r.mismatch_margins.append(divergence_margin(b.generated, s.generated, b.margins))
        else:
            r.tie_divergences += 1
