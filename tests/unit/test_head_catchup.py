"""A hidden-state head's work while its drafts are not sent, and its catch-up when it is asked again.

The head decodes nothing in rounds it is not asked (process() queues the committed pairs); a draft asked after
rounds unasked decodes the whole lag in one batch, and drafts exactly what a head asked every round drafts.
Under the cost policy a losing head must not be asked to catch up each new sequence's prompt: for a head whose
drafts are rarely sent, that catch-up is nearly its whole cost (catchup_price.py). A stand-in target hands real
HiddenRows records to the real eagle3 speculator over a counting head (no llama.cpp).
"""

from __future__ import annotations

import doctest
import hashlib

import numpy as np

from specray.engine.policy import catchup_price
from specray.engine.chain import Chain
from specray.engine.policy import DraftPolicy, Proposal, SeqDraftRequest
from specray.engine.policy.pricing import Pricing
from specray.engine.config import ChainConfig, EngineConfig
from specray.engine.cost import DecodeCostModel
from specray.engine.hidden_rows import TAP_NEXTN, pack_rows
from specray.engine.request import GenerationRequest
from specray.engine.scheduler import Scheduler
from specray.engine.speculator import DraftRequest
from specray.engine.speculators.draft_base import ModelSpeculator
from specray.engine.speculators.eagle3 import Eagle3Params, Eagle3Speculator
from specray.engine.speculators.registry import make_speculator
from specray.engine.target import StepOutput, StepResult

from ._scripted import COST, Tok, script, verify

W = 4
HEAD_COST = {1: 0.0009, 2: 0.0012, 4: 0.0018, 8: 0.0031, 16: 0.0055, 64: 0.02}  # a trained head's, measured


def test_doctests():
    failed, attempted = doctest.testmod(catchup_price)
    assert attempted > 0 and failed == 0


class HashHead:
    """A head whose prediction hashes every (token, row) pair its cache holds for the sequence, so a draft
    depends on all of them, in order; counts the pairs it decodes."""

    n_batch = 512
    width = W
    taps = (TAP_NEXTN,)

    def __init__(self, wrong: int | None = None, right: float = 0.0) -> None:
        self.kv: dict[int, list[bytes]] = {}
        self.toks: dict[int, list[int]] = {}  # the tokens of those pairs
        self.pairs = 0  # pairs decoded (catch-up, seeds and draft steps)
        self.decodes = 0
        self.wrong = wrong  # if set: predict this token (a head that never drafts right)...
        self.right = right  # ...except this share of the time, when it predicts what the script writes next

    def encode(self, rows):
        return rows * 2.0 + 1.0

    def decode(self, runs):
        self.decodes += 1
        top, prob, hid = [], [], []
        for seq, toks, pos0, rows in runs:
            kv = self.kv.setdefault(seq, [])
            assert pos0 == len(kv)
            for t, r in zip(toks, rows):
                kv.append(np.int32(t).tobytes() + np.asarray(r, np.float32).tobytes())
            self.toks[seq] = self.toks.get(seq, [])[:pos0] + [int(t) for t in toks]
            self.pairs += len(toks)
            h = hashlib.sha256(b"".join(kv)).digest()
            top.append(self.wrong if self.wrong is not None else 100 + h[0] % 50)
            if h[1] < 256 * self.right:
                top[-1] = self.next_token(seq)
            prob.append(0.9)
            hid.append(np.frombuffer(h[: 4 * W], np.uint8).astype(np.float32))
        return np.array(top, np.int32), np.array(prob), np.array(hid, np.float32)

    def next_token(self, seq: int) -> int:
        """What the script writes next: EAGLE-3's pair at q holds x_{q+1} and predicts x_{q+2}."""
        held = self.toks[seq]
        return int(next(s for s in SCRIPTS.values() if s[1:9].tolist() == held[:8])[len(held) + 1])

    def seq_rm(self, seq, p0):
        self.kv[seq] = self.kv.get(seq, [])[:p0]
        self.toks[seq] = self.toks.get(seq, [])[:p0]

    def is_eog(self, t):
        return False

    def decode_costs(self):
        return HEAD_COST


def rows_of(seq: int, pos0: int, tokens) -> np.ndarray:
    r = np.zeros((len(tokens), W), np.float32)
    r[:, 0], r[:, 1], r[:, 2] = seq, np.arange(pos0, pos0 + len(tokens)), tokens
    return r


def commit(spec, round_id: int, seq: int, pos: int, tokens) -> None:
    tokens = np.array(tokens, np.int32)
    spec.take_hidden(pack_rows(round_id, (TAP_NEXTN,), (W,), [(seq, pos, tokens, rows_of(seq, pos, tokens))]))
    spec.process(seq, tokens, pos)


def test_a_lagging_head_catches_up_in_one_decode_and_drafts_as_if_fed_every_round():
    rng = np.random.default_rng(0)
    text = rng.integers(100, 150, 120).astype(np.int32)
    eager, lazy = HashHead(), HashHead()
    e_spec = Eagle3Speculator(Eagle3Params(n_max=3), eager)
    l_spec = Eagle3Speculator(Eagle3Params(n_max=3), lazy)
    for spec in (e_spec, l_spec):
        spec.begin(0, text[:40])
        commit(spec, 0, 0, 0, text[:40])  # the prompt
    pos, rnd = 40, 1
    while pos < 100:  # rounds of 1-3 committed tokens (accepted drafts + the next one)
        n = 1 + rnd % 3
        hist = text[: pos + 1]
        e_draft = e_spec.draft([DraftRequest(0, hist, 3)])[0]
        for spec in (e_spec, l_spec):
            commit(spec, rnd, 0, pos, text[pos : pos + n])
        pos, rnd = pos + n, rnd + 1
        assert len(e_draft) == 3
    assert lazy.pairs == lazy.decodes == 0  # never asked: nothing decoded
    hist = text[: pos + 1]
    (e_draft,) = e_spec.draft([DraftRequest(0, hist, 3)])
    before = lazy.decodes
    (l_draft,) = l_spec.draft([DraftRequest(0, hist, 3)])
    assert lazy.decodes - before == 3  # the whole lag and the seed in one decode, then two draft steps
    assert l_draft.tolist() == e_draft.tolist()
    assert lazy.kv[0] == eager.kv[0]  # the same pairs at the same positions
    assert l_spec.counters.catchup_pairs == pos - 1  # EAGLE-3: pairs 0..pos-2 (x_1..x_{pos-1}), then the seed


# ---- under the cost policy, in a scheduler -------------------------------------------------------------
PROMPT = 60


# random tokens (nothing a free speculator could copy: the head is the only candidate, as on chat), and after
# the first 150 some copies of earlier stretches
SCRIPTS = {k: script(k, PROMPT, 150) for k in range(6)}


class RowTarget:
    """Greedy "model" writing script[p] at position p; hands the committed rows to the head, as the real
    target does (engine/target.py), and reports the cost table's decode time (nothing is slept)."""

    def __init__(self) -> None:
        self.scripts: dict[int, np.ndarray] = {}
        self.rounds = 0

    def start(self, seq_id, params, prompt, n_keep=0, copy_from=None, restore=None, share=None):
        self.scripts[seq_id] = next(s for s in SCRIPTS.values() if np.array_equal(s[:PROMPT], prompt))

    def release(self, seq_id, keep=False):
        pass

    def step(self, items):
        self.rounds += 1
        results, entries = [], []
        for it in items:
            if not it.sample:
                results.append(StepResult(it.seq_id, np.zeros(0, np.int32)))
                committed = it.tokens
            else:
                res, n_ok = verify(self.scripts[it.seq_id], it)
                results.append(res)
                committed = it.tokens[: it.n_commit + n_ok]
            if it.hidden:
                entries.append((it.seq_id, it.pos0, committed, rows_of(it.seq_id, it.pos0, committed)))
        n = sum(len(it.tokens) for it in items)
        out = StepOutput(results, DecodeCostModel(COST, learn=False).cost(n), n, 1, batch_sizes=[n])
        if entries:
            out.hidden = pack_rows(self.rounds, (TAP_NEXTN,), (W,), entries)
        return out


def run(speculators: list[str], head: HashHead, n_seqs: int = 6, model_explore: float = 0.0) -> Scheduler:
    def factory(name, params=None):
        return Eagle3Speculator(Eagle3Params(n_max=3), head) if name == "eagle3" else make_speculator(name, params)

    chain = ChainConfig(speculators=speculators, policy="cost", n_max=8, model_explore=model_explore,
                        params={"suffix": {"min_match": 1, "p_min": 0.01}})
    s = Scheduler(EngineConfig(slots=1, calibrate=False, chain=chain), RowTarget(), Tok(), Chain(chain, factory),
                  n_ctx=4096, cost=DecodeCostModel(COST, learn=False))
    for k in range(n_seqs):
        seq = s.submit(GenerationRequest(SCRIPTS[k][:PROMPT], max_tokens=300, ignore_eos=True))
        while s.has_work():
            s.step()
        assert seq.finished and [int(t) for t in seq.generated] == SCRIPTS[k][PROMPT : PROMPT + 300].tolist()
    return s


class LaggingHead(ModelSpeculator):
    """A head whose cache lags `lag_seconds` of catch-up behind each sequence; drafts 3 tokens."""

    name = "lagging"
    max_steps = 3

    def __init__(self) -> None:
        super().__init__()
        self.lag_seconds: dict[int, float] = {}
        self.asked: list[int] = []

    def draft_seconds(self, n_seqs: int, n_steps: int) -> float:
        return 0.0009 * n_steps

    def catchup_seconds(self, seq_id: int, history) -> float:
        return self.lag_seconds.get(seq_id, 0.0)

    def _draft_one(self, req):
        self.asked.append(req.seq_id)
        return np.array([5, 6, 7], np.int32)


def test_the_catch_up_is_spread_over_the_rounds_a_head_keeps_drafting():
    chain = Chain(ChainConfig(speculators=["lagging"], policy="cost", n_max=8),
                  lambda name, params=None: LaggingHead())
    head = chain.instances["lagging"]
    policy = DraftPolicy(chain)
    pricing = lambda: Pricing(lambda n: 0.010 + 0.0005 * (n - 1), base_tokens=1, n_decoding=1)  # noqa: E731

    def ask(seq_id: int, lag: float) -> bool:
        head.lag_seconds[seq_id] = lag
        before = len(head.asked)
        policy.propose([SeqDraftRequest(seq_id, ("lagging",), np.arange(100, 160, dtype=np.int32), 8,
                                       tokens_left=256)], pricing=pricing())
        return len(head.asked) > before

    # a fresh head is trusted to keep drafting: a long prompt's catch-up (200 ms) is spread over the ~100
    # rounds the sequence has left
    assert ask(0, 0.2)
    # its drafts come out right (the acceptance estimate stays high) but are not sent (say the planner cut
    # them): it is not asked the next round either, and each new draft pays a whole lag again
    for k in range(8):
        policy.accept(Proposal(0, None, asked=("lagging",), drafts={"lagging": np.array([5, 6, 7], np.int32)}),
                     0, 0, np.array([5, 6, 7, 8], np.int32))
    assert not ask(1, 0.2)  # a new sequence's prompt: not worth catching up for this head any more
    assert ask(2, 0.0)  # a sequence it is level with: its drafts still pay
    assert policy.models.steady.share("lagging") < 0.2


def test_a_head_that_drafts_right_still_catches_up_each_new_sequence():
    head = HashHead(wrong=5, right=1.0)
    s = run(["suffix", "eagle3"], head, n_seqs=2)
    spec = s.chain.instances["eagle3"]
    # sent nearly every round from each sequence's start: its prompt catch-ups were paid
    assert spec.stats.drafts_chosen >= 0.95 * s.stats.rounds and spec.stats.tokens_accepted > 400

