"""A stand-in target and tokenizer for scheduler tests that need no model: the target emits token 5 for every
sampled row and logs its calls, so a test can see what ran while a decode was in flight (between a launch and
its collect)."""

from __future__ import annotations

import numpy as np

from specray.engine.target import StepOutput, StepResult


class LaunchedTarget:
    """Emits token 5 for every sampled row; records its calls and when its decode was in flight (`log`)."""

    def __init__(self, log: list) -> None:
        self.log, self.items = log, None

    def start(self, seq_id, params, prompt, n_keep=0, copy_from=None, restore=None, share=None):
        self.log.append(("start", seq_id))

    def release(self, seq_id, keep=0):
        self.log.append(("release", seq_id))

    def step(self, items):  # a round without overlap: launch and collect at once
        self.launch(items)
        return self.collect()

    def launch(self, items):
        assert self.items is None, "a launch while another round is in flight"
        self.items = items
        self.log.append(("launch",))

    def collect(self):
        items, self.items = self.items, None
        self.log.append(("collect",))
        results = [StepResult(it.seq_id, np.array([5] if it.sample else [], np.int32)) for it in items]
        return StepOutput(results, 0.001, sum(len(it.tokens) for it in items), 1)


class Tok:
    def token_to_piece(self, token, special=False):
        return b"x"

    def is_eog(self, token):
        return False
