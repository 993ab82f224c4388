"""A scripted target for scheduler tests: a greedy "model" that writes script[p] at position p."""

from __future__ import annotations

import numpy as np

from specray.engine.target import StepResult

#: a CPU-like verify curve (seconds per decode of N rows)
COST = {1: 0.010, 2: 0.0105, 4: 0.0115, 8: 0.0135, 16: 0.0175, 64: 0.04}


def script(seed: int, prompt: int, copies_after: int, n: int = 400) -> np.ndarray:
    """What the "target" writes: `prompt` random tokens, then random tokens with, after `copies_after`, some
    copies of earlier stretches (where a suffix draft is right; elsewhere nothing free drafts, as on chat)."""
    rng = np.random.default_rng(seed)
    out = rng.integers(100, 400, prompt).tolist()
    while len(out) < n:
        if len(out) > copies_after and rng.random() < 0.2:
            a = int(rng.integers(0, len(out) - 12))
            out += out[a : a + int(rng.integers(6, 12))]
        else:
            out += rng.integers(100, 400, 4).tolist()
    return np.array(out[:n], np.int32)


def verify(want: np.ndarray, it) -> tuple[StepResult, int]:
    """Greedy verification of a step item against the script: (its result, how many draft tokens it accepted)."""
    p, out = it.pos0 + it.n_commit, []
    for d in it.tokens[it.n_commit:].tolist():
        if d != want[p]:
            break
        out.append(d)
        p += 1
    return StepResult(it.seq_id, np.array(out + [want[p]], np.int32), len(out)), len(out)


class Tok:
    def token_to_piece(self, token, special=False):
        return f"{token},".encode()

    def is_eog(self, token):
        return False
