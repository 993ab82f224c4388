"""A model speculator whose drafts lose must not price the chain's free drafts out (a weak trained head).

A head pays a long catch-up (tens of ms: a whole prompt) on the round of its
first draft, a few rows sent on its fresh estimate. Left in the host time the round
pricer learns from (host = a + b x sequences + c x draft rows + ...), that
catch-up made every draft row look ms dear, and the default chain + eagle3
sent 4 n-gram drafts where the chain alone sent 167. Here a stand-in head
sleeps 30 ms a draft and is never right; the chain with it must send about
as many suffix drafts as the chain without it (counts, not timings).
"""

from __future__ import annotations

import time

import numpy as np

from specray.engine.chain import Chain
from specray.engine.config import ChainConfig, EngineConfig
from specray.engine.cost import DecodeCostModel
from specray.engine.request import GenerationRequest
from specray.engine.scheduler import Scheduler
from specray.engine.speculator import TOKEN_DTYPE
from specray.engine.speculators.draft_base import ModelSpeculator
from specray.engine.speculators.registry import make_speculator
from specray.engine.target import StepOutput, StepResult

from ._scripted import COST, Tok, script, verify

PROMPT = 40


class ScriptTarget:
    """Greedy "model" whose token at position p is script[p]; reports the cost table's decode time (nothing
    is slept)."""

    def __init__(self) -> None:
        self.scripts: dict[int, np.ndarray] = {}

    def start(self, seq_id, params, prompt, n_keep=0, copy_from=None, restore=None, share=None):
        self.scripts[seq_id] = SCRIPTS[tuple(prompt[:8].tolist())]

    def release(self, seq_id, keep=False):
        pass

    def step(self, items):
        results = []
        for it in items:
            if not it.sample:
                results.append(StepResult(it.seq_id, np.zeros(0, np.int32)))
                continue
            results.append(verify(self.scripts[it.seq_id], it)[0])
        n = sum(len(it.tokens) for it in items)
        return StepOutput(results, DecodeCostModel(COST, learn=False).cost(n), n, 1, batch_sizes=[n])


# after the first 120 tokens some copies of earlier stretches, where a suffix draft is right
SCRIPTS = {tuple(s[:8].tolist()): s for s in (script(k, PROMPT, 120) for k in range(3))}


class LosingHead(ModelSpeculator):
    """A head priced as cheap that takes 30 ms a draft (a catch-up) and always drafts a wrong token."""

    name = "losing_head"
    max_steps = 1

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0

    def draft_seconds(self, n_seqs: int, n_steps: int) -> float:
        return 0.0005

    def _draft_one(self, req):
        self.asked += 1
        time.sleep(0.03)
        return np.array([5], dtype=TOKEN_DTYPE)  # the script never writes it


def factory(name, params=None):
    return LosingHead() if name == "losing_head" else make_speculator(name, params)


def run(speculators: list[str]) -> Scheduler:
    chain = ChainConfig(speculators=speculators, policy="cost", n_max=8, model_explore=0.2,
                        params={"suffix": {"min_match": 1, "p_min": 0.01}})
    s = Scheduler(EngineConfig(slots=1, calibrate=False, chain=chain), ScriptTarget(), Tok(), Chain(chain, factory),
                  n_ctx=4096, cost=DecodeCostModel(COST, learn=False))
    for k in range(3):
        seq = s.submit(GenerationRequest(script(k, PROMPT, 120)[:PROMPT], max_tokens=300, ignore_eos=True))
        while s.has_work():
            s.step()
        assert seq.finished
    return s


def test_a_losing_model_speculator_leaves_the_free_drafts_as_they_were():
    alone = run(["suffix"])
    with_head = run(["suffix", "losing_head"])
    head = with_head.chain.instances["losing_head"]
    assert head.asked > 0  # it was asked (and sent now and then): the case at hand
    sent_alone = alone.chain.stats()["suffix"].drafts_chosen
    sent_with = with_head.chain.stats()["suffix"].drafts_chosen
    assert sent_alone > 20
    assert sent_with >= 0.8 * sent_alone, (sent_with, sent_alone, with_head.policy.pricer.host.to_dict())
    # what the pricer learnt a draft row costs the host: microseconds, not the head's 30 ms
    assert with_head.policy.pricer.host.coefficients()[2] < 0.001
