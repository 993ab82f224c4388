"""Plain text for the head to learn on: files cut into training sequences, rows only (no answers).

A prefill with every position's rows and logits is much faster than an
answer with its rows pass, so text the target did not write buys the head
more positions per minute. Its labels are still the target's: its top tokens
(and their probabilities, with `gen.soft_labels`) after each position of the
text. It is for a corpus that looks like the traffic to serve (the head
recipes tried: docs/experiments.md).
"""

from __future__ import annotations

import glob
import os


def text_files(patterns: list[str]) -> list[str]:
    """The files the patterns name (globs, `**` recursive), sorted and without repeats; ValueError naming a
    pattern that matches no file."""
    out: dict[str, None] = {}
    for pat in patterns:
        found = sorted(p for p in glob.glob(os.path.expanduser(pat), recursive=True) if os.path.isfile(p))
        if not found:
            raise ValueError(f"--text {pat!r}: no such file")
        out.update(dict.fromkeys(found))
    return list(out)


def chunks(n_tokens: int, length: int, min_len: int = 32) -> list[tuple[int, int]]:
    """(start, end) of consecutive pieces of at most `length` tokens covering n_tokens; a last piece shorter
    than `min_len` is dropped (too little context to teach anything).

    >>> chunks(10, 4, min_len=2)
    [(0, 4), (4, 8), (8, 10)]
    >>> chunks(9, 4, min_len=2)
    [(0, 4), (4, 8)]
    """
    out = [(a, min(a + length, n_tokens)) for a in range(0, n_tokens, length)]
    return [(a, b) for a, b in out if b - a >= min_len]


def read_text(path: str) -> str:
    """The file as text (undecodable bytes replaced: a corpus is rarely all clean UTF-8)."""
    with open(path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")
