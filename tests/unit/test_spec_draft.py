"""The draft speculator's pure logic over a scripted draft backend (no llama.cpp).

The backend keeps each sequence's cache as a token list and refuses a decode
that is not at the next free position, so every test also checks that the
speculator's KV bookkeeping (catch-up, rollback, draft rows) stays exact.
The real-model tests are in tests/integration/test_draft.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from specray.engine.cost import DecodeCostModel
from specray.engine.speculator import DraftRequest
from specray.engine.speculators.draft import DraftSpeculator, common_prefix
from specray.engine.speculators.draft_base import DraftParams
from specray.engine.speculators.draft_text import CharVocab

from .test_spec_draft_text import WordVocab

EOG = 2


class ScriptedBackend:
    """A 'draft model' that continues a known script: after a cache equal to script[:n] it proposes
    script[n] with probability probs[n] (default 0.9); off-script it proposes 0 with probability 0.05."""

    n_batch = 512

    def __init__(self, script, probs=None, vocab=None, prefix=()):
        self.script = [int(t) for t in script]
        self.probs = probs or {}
        self.vocab = vocab or CharVocab()
        self.prefix = tuple(prefix)
        self.kv: dict[int, list[int]] = {}
        self.decodes = 0
        self.rows = 0
        self.rows_per_decode: list[int] = []

    def decode(self, runs):
        self.decodes += 1
        n = sum(len(t) for _, t, _ in runs)
        self.rows += n
        self.rows_per_decode.append(n)
        top, prob = [], []
        for seq, toks, pos0 in runs:
            kv = self.kv.setdefault(seq, [])
            assert pos0 == len(kv), f"seq {seq}: decode at {pos0} but the cache holds {len(kv)}"
            kv.extend(int(t) for t in toks)
            k = len(kv)
            if kv == self.script[:k] and k < len(self.script):
                top.append(self.script[k])
                prob.append(self.probs.get(k, 0.9))
            else:
                top.append(0)
                prob.append(0.05)
        return np.array(top, dtype=np.int32), np.array(prob)

    def seq_rm(self, seq_id, p0):
        kv = self.kv.setdefault(seq_id, [])
        del kv[p0:]

    def is_eog(self, token):
        return token == EOG

    def decode_costs(self):
        return {1: 0.004, 2: 0.005, 4: 0.006, 8: 0.008}


SCRIPT = list(range(10, 60))


def spec(params=None, backend=None, **kw):
    b = backend or ScriptedBackend(SCRIPT)
    return DraftSpeculator(DraftParams(**(params or {})), b, **kw), b


def req(seq, history, n_max=16):
    return DraftRequest(seq, np.asarray(history, dtype=np.int32), n_max)


def test_common_prefix():
    assert common_prefix(np.array([1, 2, 3]), np.array([1, 2, 3])) == 3
    assert common_prefix(np.array([], dtype=np.int32), np.array([1])) == 0
    assert common_prefix(np.array([5, 2]), np.array([1, 2])) == 0


def test_n_max_default_3_and_request_cap():
    s, b = spec()
    s.begin(0, np.array(SCRIPT[:5]))
    (d,) = s.draft([req(0, SCRIPT[:5])])
    assert d.tolist() == SCRIPT[5:8]  # llama.cpp's default n_max 3
    s2, _ = spec({"n_max": 8})
    s2.begin(0, np.array(SCRIPT[:5]))
    (d,) = s2.draft([req(0, SCRIPT[:5], n_max=2)])
    assert d.tolist() == SCRIPT[5:7]


def test_p_min_stops_and_n_min_drops():
    probs = {7: 0.3}  # the third drafted token is uncertain
    s, b = spec({"n_max": 6, "p_min": 0.5}, ScriptedBackend(SCRIPT, probs))
    (d,) = s.draft([req(0, SCRIPT[:5])])
    assert d.tolist() == SCRIPT[5:7]
    s, b = spec({"n_max": 6, "p_min": 0.5, "n_min": 3}, ScriptedBackend(SCRIPT, probs))
    (d,) = s.draft([req(0, SCRIPT[:5])])
    assert len(d) == 0  # 2 < n_min


def test_end_of_generation_ends_the_draft():
    script = [10, 11, 12, EOG, 13, 14]
    s, b = spec({"n_max": 5}, ScriptedBackend(script))
    (d,) = s.draft([req(0, script[:2])])
    assert d.tolist() == [12, EOG]  # same vocabulary: the target may well end there too


def test_all_sequences_draft_in_one_decode_per_step():
    s, b = spec({"n_max": 4})
    hists = [SCRIPT[:5], SCRIPT[:9], SCRIPT[:3], [99, 98]]  # the last one is off-script
    for i, h in enumerate(hists):
        s.begin(i, np.array(h))
    drafts = s.draft([req(i, h) for i, h in enumerate(hists)])
    assert [d.tolist() for d in drafts[:3]] == [SCRIPT[5:9], SCRIPT[9:13], SCRIPT[3:7]]
    assert drafts[3].tolist() == [0, 0, 0, 0]  # p_min 0: even a poor guess is a draft (llama.cpp default)
    # step 1 decodes every history (catch-up) + ... steps 2..4 one row per sequence
    assert b.decodes == 4
    assert b.rows_per_decode == [5 + 9 + 3 + 2, 4, 4, 4]
    assert s.counters.steps == 4


def test_process_rolls_back_the_rejected_tail_and_catches_up_lazily():
    s, b = spec({"n_max": 4})
    prompt = SCRIPT[:6]
    s.begin(0, np.array(prompt))
    s.process(0, np.array(prompt[:4]), 0)  # the target's prompt chunks
    s.process(0, np.array(prompt[4:5]), 4)
    h = prompt + [SCRIPT[6]]  # prompt's last token was decoded with... and the target sampled SCRIPT[6]
    s.process(0, np.array(prompt[5:6]), 5)
    (d,) = s.draft([req(0, h)])
    assert d.tolist() == SCRIPT[7:11]
    # cache: history + the first 3 drafted tokens (the 4th was never decoded)
    assert b.kv[0] == SCRIPT[:10]
    # the target verified [last + draft], accepted 1 of 4, sampled something else (77)
    committed = np.array([SCRIPT[6], SCRIPT[7]])
    s.process(0, committed, 6)
    assert b.kv[0] == SCRIPT[:8] == s.kv_tokens(0).tolist()  # no rejected token stays cached
    assert s.committed(0).tolist() == SCRIPT[:8]
    h = SCRIPT[:8] + [77]
    (d,) = s.draft([req(0, h)])
    assert b.rows_per_decode[-1] == 1  # off-script now: ... one row per step
    assert b.kv[0][:9] == h and s.counters.unsynced == 0
    # all accepted: the last draft token was never decoded; it is caught up with the next step
    s.process(0, np.array([77] + d.tolist()), 8)
    assert b.kv[0] == h + d.tolist()[:-1]
    s.sync([0])
    assert b.kv[0] == h + d.tolist() == s.committed(0).tolist()


def test_history_without_process_resyncs_and_counts_it():
    s, b = spec()
    (d,) = s.draft([req(0, SCRIPT[:5])])
    assert d.tolist() == SCRIPT[5:8]
    assert s.counters.unsynced == 1
    # a different sequence reuses the slot without begin: the cache is rebuilt from the shared prefix
    (d,) = s.draft([req(0, SCRIPT[:3] + [5, 6])])
    assert b.kv[0][:5] == SCRIPT[:3] + [5, 6]
    assert s.counters.rolled_back >= 4


def test_begin_and_end_clear_the_slot():
    s, b = spec()
    s.draft([req(3, SCRIPT[:5])])
    assert b.kv[3]
    s.end(3)
    assert b.kv[3] == [] and 3 not in s.seqs
    s.draft([req(3, SCRIPT[:5])])
    s.begin(3, np.array([1, 2]))
    assert b.kv[3] == []


def test_failed_decode_gives_no_drafts_and_forgets_the_caches():
    class Failing(ScriptedBackend):
        fail = True

        def decode(self, runs):
            if self.fail:
                self.fail = False
                for seq, toks, pos0 in runs:  # a partial decode: the cache state is unknown
                    self.kv.setdefault(seq, []).extend(int(t) for t in toks)
                raise RuntimeError("llama_decode failed: no KV cache slot")
            return super().decode(runs)

    b = Failing(SCRIPT)
    s, _ = spec(backend=b)
    assert s.draft([req(0, SCRIPT[:5]), req(1, SCRIPT[:4])])[0].tolist() == []
    assert s.counters.failures == 1 and b.kv[0] == [] and b.kv[1] == []
    assert s.draft([req(0, SCRIPT[:5])])[0].tolist() == SCRIPT[5:8]


def test_pending_rows_price_the_catch_up():
    s, b = spec()
    h = np.array(SCRIPT[:20], dtype=np.int32)
    assert s.pending_rows(0, h) == 20  # never drafted: the whole history
    s.process(0, h[:-1], 0)  # the prompt's prefill round
    s.draft([req(0, h)])
    s.process(0, np.array([SCRIPT[19], SCRIPT[20]]), 19)  # last token + 1 accepted draft token
    h2 = np.array(SCRIPT[:22], dtype=np.int32)
    assert s.pending_rows(0, h2) == 1  # steady state: only the new token
    assert s.catchup_seconds(0, h2) == 0.0
    long = np.array(SCRIPT[:22] + [5] * 200, dtype=np.int32)
    # (the scripted backend decodes in microseconds: price with a real-looking table)
    s.step_cost = DecodeCostModel({1: 0.004, 2: 0.005, 4: 0.006, 8: 0.008, 16: 0.012})
    assert s.pending_rows(0, long) == 201 and s.catchup_seconds(0, long) > 0.0
    assert s.catchup_seconds(0, long) > s.catchup_seconds(0, long[:40]) > 0.0


def test_stats_and_cost():
    s, b = spec()
    s.draft([req(0, SCRIPT[:5]), req(1, SCRIPT[:5], n_max=0)])
    assert s.stats.calls == 2 and s.stats.drafts_generated == 1
    # the first step also decodes the catch-up rows: learnt from sequences drafted in a recent round only
    # (a first draft's whole-history catch-up is priced apart, by catchup_seconds)
    assert s.catchup_per_seq == 2.0
    s.draft([req(0, SCRIPT[:8])])  # 3 tokens later: the draft matched, one row to decode before drafting
    assert 1.0 < s.catchup_per_seq < 2.0
    c = s.step_cost.cost
    first = c(round(s.catchup_per_seq))
    assert s.draft_seconds(1, 3) == pytest.approx(s.overhead_seconds + first + 2 * c(1))
    assert s.draft_seconds(4, 2) > s.draft_seconds(1, 2) > s.draft_seconds(1, 1)


# ---- cross-vocabulary --------------------------------------------------------------------------------

TARGET_TEXT = b"The quick brown fox jumps over the lazy dog. Then it sleeps."


def cross_setup(params=None, target=None):
    """Target: word tokens; draft: one token per byte, a 'model' that knows TARGET_TEXT by heart."""
    target = target or WordVocab()
    draft_vocab = CharVocab()
    script = [1] + list(TARGET_TEXT)  # draft BOS = 1, then bytes
    b = ScriptedBackend(script, vocab=draft_vocab, prefix=(1,))

    class Tr:
        pass

    tr = Tr()
    tr.target = target
    tr.skip = frozenset({target.id(b"<bos>")})
    s = DraftSpeculator(DraftParams(**({"keep_last": None} | (params or {"n_max": 8}))), b, tr)
    return s, b, target


def test_cross_vocab_drafts_target_tokens_whose_text_aligns():
    s, b, target = cross_setup()
    hist = [target.id(b"<bos>")] + target.tokenize(b"The quick").tolist()
    s.begin(0, np.array(hist[:-1]))
    (d,) = s.draft([req(0, hist)])
    # the draft model wrote " brown f" (8 bytes); " f" may still grow into " fox": dropped
    assert [target.piece(int(t)) for t in d] == [b" brown"]
    assert b.kv[0][:10] == [1] + list(b"The quick")  # BOS + the text, the target's BOS left out
    # by default (keep_last=True) the last target token is kept although it could still grow
    s3, _, _ = cross_setup({"n_max": 8, "keep_last": True}, target)
    (d,) = s3.draft([req(0, hist)])
    assert [target.piece(int(t)) for t in d] == [b" brown", b" f"] and DraftParams().keep_last is True
    # two draft bytes " b": the only target token could still grow: nothing aligned is left
    s2, _, _ = cross_setup({"n_max": 2}, target)
    (d,) = s2.draft([req(0, hist)])
    assert len(d) == 0 and s2.counters.translated_empty == 1 and s2.counters.drafted_tokens == 2


def test_cross_vocab_mirror_follows_accepted_text_and_rolls_back_the_rest():
    s, b, target = cross_setup({"n_max": 12, "p_min": 0.1})
    hist = [target.id(b"<bos>")] + target.tokenize(b"The quick").tolist()
    s.begin(0, np.array(hist[:-1]))
    (d,) = s.draft([req(0, hist)])
    assert [target.piece(int(t)) for t in d] == [b" brown", b" fox"]
    # the target accepts " brown" and then samples " cat" (off-script)
    hist = hist + [int(d[0]), target.id(b" cat")]
    (d2,) = s.draft([req(0, hist)])
    text = b"The quick brown cat"
    assert b.kv[0][: 1 + len(text)] == [1] + list(text)
    assert s.counters.rolled_back > 0
    # off-script the draft model is unsure (p 0.05 < p_min): no draft
    assert len(d2) == 0 and s.counters.translated_empty == 0


def test_cross_vocab_incremental_text_matches_the_full_detokenisation():
    s, b, target = cross_setup({"n_max": 3})
    words = target.tokenize(TARGET_TEXT).tolist()
    hist = [target.id(b"<bos>")] + words[:2]
    for k in range(3, len(words)):
        s.draft([req(0, hist)])
        hist = [target.id(b"<bos>")] + words[:k]
        s.process(0, np.array(hist[-2:-1]), len(hist) - 2)
    s.draft([req(0, hist)])
    st = s.seqs[0]
    want = b"".join(target.piece(t) for t in hist[1:])
    assert bytes(st.text.text) == want
    assert st.text.tokens == [1] + list(want)
    assert b.kv[0][: len(want) + 1] == [1] + list(want)


class RunnerUpBackend(ScriptedBackend):
    """ScriptedBackend that also names each step's runner-up: the script's token plus 100, at `second[n]` of
    the drafted token's probability (default 0.3 over 0.9)."""

    def __init__(self, script, second=None, **kw):
        super().__init__(script, **kw)
        self.second = second or {}

    def decode(self, runs, runner_ups=False):
        top, prob = super().decode(runs)
        if not runner_ups:
            return top, prob
        alt = np.where(top > 0, top + 100, 1).astype(np.int32)
        alt_prob = np.array([self.second.get(len(self.kv[seq]), 0.3) for seq, _, _ in runs])
        return top, prob, alt, alt_prob


def test_a_drafts_runner_ups_are_one_token_branches_most_likely_first():
    s, b = spec({"n_max": 4}, RunnerUpBackend(SCRIPT, second={6: 0.6, 7: 0.0}))
    assert s.offers_branches and not s.runner_ups_wanted
    (d,) = s.draft([req(0, SCRIPT[:5])])
    # a chain without trees never asks: the backend is not asked for runner-ups either; the first ask turns
    # them on for the next drafts
    assert s.branches(0, d, 3) == [] and s.runner_ups_wanted
    s.begin(0, np.array(SCRIPT[:5]))
    (d,) = s.draft([req(0, SCRIPT[:5])])
    assert d.tolist() == SCRIPT[5:9]
    # depth 1 (the cache held script[:6]) has the likeliest runner-up; depth 2's has no probability at all
    got = [(br.at, br.tokens.tolist(), round(br.weight, 3)) for br in s.branches(0, d, 3)]
    assert got == [(1, [SCRIPT[6] + 100], 0.667), (0, [SCRIPT[5] + 100], 0.333), (3, [SCRIPT[8] + 100], 0.333)]
    # the planner cut the draft to two tokens: only branches within it
    assert [br.at for br in s.branches(0, d[:2], 3)] == [1, 0]
    # a draft that is not the last one has no branches, nor a sequence that got none
    assert s.branches(0, np.array([1, 2], np.int32), 3) == []
    assert s.branches(5, d, 3) == []


def test_no_runner_ups_without_them_from_the_backend_or_across_vocabularies():
    class TopOnly(ScriptedBackend):  # asked for runner-ups, it has none to give
        def decode(self, runs, runner_ups=False):
            return super().decode(runs)

    s, _ = spec({"n_max": 3}, TopOnly(SCRIPT))
    s.runner_ups_wanted = True
    (d,) = s.draft([req(0, SCRIPT[:5])])
    assert len(d) == 3 and s.branches(0, d, 3) == []
    s, _ = spec({"n_max": 3}, RunnerUpBackend(SCRIPT), translator=object())
    assert not s.offers_branches
