"""Chain selection policies and the request's stop-string handling (no model)."""

from __future__ import annotations

import numpy as np
import pytest

from specray.engine.chain import Chain
from specray.engine.policy import DraftPolicy, SeqDraftRequest
from specray.engine.config import ChainConfig, EngineConfig, parse_chain
from specray.engine.request import GenerationRequest, Sequence
from specray.engine.speculator import DraftRequest, Speculator


class Fixed(Speculator):
    """A speculator that always proposes the same tokens (a hand-made stand-in)."""

    def __init__(self, name: str, tokens: list[int]):
        super().__init__()
        self.name = name
        self.tokens = np.array(tokens, dtype=np.int32)

    def _draft_one(self, req: DraftRequest) -> np.ndarray:
        return self.tokens


def make_chain(policy: str, specs: dict[str, list[int]]) -> DraftPolicy:
    """A chain of fixed drafts and its draft policy."""
    cfg = ChainConfig(speculators=list(specs), policy=policy)
    return DraftPolicy(Chain(cfg, lambda name, params: Fixed(name, specs[name])))


def req(chain) -> SeqDraftRequest:
    return SeqDraftRequest(0, tuple(chain), np.array([1, 2, 3], dtype=np.int32), 8)


def test_first_policy_takes_the_first_non_empty_and_skips_the_rest():
    ch = make_chain("first", {"a": [], "b": [5, 6], "c": [7, 8, 9]})
    (p,) = ch.propose([req("abc")])
    assert p.speculator == "b" and p.tokens.tolist() == [5, 6]
    assert p.asked == ("a", "b")  # c was never asked
    assert ch.chain.instances["c"].stats.calls == 0


def test_expected_policy_prefers_the_longer_draft_at_equal_rates_and_learns():
    ch = make_chain("expected", {"a": [5], "b": [7, 8, 9]})
    (p,) = ch.propose([req("ab")])
    assert p.speculator == "b"
    for _ in range(30):  # b's drafts keep failing, a's keep passing
        ch.accept(p, 3, 0)
        (pa,) = ch.propose([req("a")])
        ch.accept(pa, 1, 1)
    (p2,) = ch.propose([req("ab")])
    assert p2.speculator == "a"
    assert ch.chain.instances["b"].stats.tokens_accepted == 0
    assert ch.chain.instances["a"].stats.tokens_accepted >= 30


def test_cut_and_losers_are_told():
    ch = make_chain("cost", {"a": [5, 6, 7], "b": [9]})
    (p,) = ch.propose([req("ab")])
    p.cut(1)
    ch.accept(p, 1, 1)
    winner = ch.chain.instances[p.speculator]
    loser = ch.chain.instances["b" if p.speculator == "a" else "a"]
    assert winner.stats.drafts_chosen == 1 and winner.stats.tokens_accepted == 1
    assert loser.stats.drafts_chosen == 0 and loser.stats.calls == 1


def test_parse_chain_and_config_errors():
    assert parse_chain("ngram_mod, suffix") == ["ngram_mod", "suffix"]
    assert parse_chain("none") == []
    with pytest.raises(ValueError, match="cannot be combined"):
        parse_chain("none,suffix")
    with pytest.raises(ValueError):
        ChainConfig(n_max=-1)
    with pytest.raises(ValueError):
        EngineConfig(slots=0)
    with pytest.raises(ValueError, match="flash_attn conflicts with exact"):
        EngineConfig(exact=True, flash_attn=True)
    assert EngineConfig(flash_attn=True).flash_attn and EngineConfig(exact=True).exact
    # unset: on, except in exact mode
    assert EngineConfig().flash_attn_on and not EngineConfig(exact=True).flash_attn_on
    # weight repacking: refused with exact mode, resolved off there, left to the build otherwise
    with pytest.raises(ValueError, match="use_extra_bufts conflicts with exact"):
        EngineConfig(exact=True, use_extra_bufts=True)
    assert EngineConfig(exact=True).repack_weights is False
    assert EngineConfig().repack_weights is None and EngineConfig(use_extra_bufts=True).repack_weights is True
    assert ChainConfig(speculators="ngram_mod,suffix").speculators == ["ngram_mod", "suffix"]


def test_stop_string_split_across_tokens_is_held_back_then_cut():
    seq = Sequence(GenerationRequest(np.array([1], np.int32), stop=["END"]), (), 0, 10)
    out = seq.feed_text(b"hello E")
    assert out == "hello "  # "E" might start "END": held back
    out = seq.feed_text(b"N")
    assert out == "" and seq.finish_reason is None
    out = seq.feed_text(b"D and more")
    assert out == "" and seq.finish_reason == "stop" and seq.text == "hello "


def test_utf8_split_across_tokens_is_decoded_whole():
    seq = Sequence(GenerationRequest(np.array([1], np.int32)), (), 0, 10)
    euro = "€".encode()
    assert seq.feed_text(euro[:1]) == ""
    assert seq.feed_text(euro[1:]) == "€"


class _Vocab:
    """token_to_piece / is_eog of a toy vocabulary: 0 ends generation, 1 and 2 are the two halves of "é"."""

    pieces = {1: "é".encode()[:1], 2: "é".encode()[1:], 3: b" ab", 4: b"c", 5: b"END"}

    def token_to_piece(self, t: int) -> bytes:
        return self.pieces[t]

    def is_eog(self, t: int) -> bool:
        return t == 0


def test_emit_decodes_a_rounds_pieces_whole_with_and_without_stop_strings():
    """emit decodes a round's pieces in one go when the request has no stop strings: the text, the kept tokens
    and the finish reason are those of token-by-token emission (a character split across tokens and rounds,
    the end of generation, max_tokens), and with stop strings it still cuts at the stop."""
    seq = Sequence(GenerationRequest(np.array([9], np.int32), max_tokens=6), (), 0, 10)
    assert seq.emit(np.array([3, 1], np.int32), None, _Vocab()) == ([3, 1], " ab")  # "é" half: held
    assert seq.emit(np.array([2, 4, 0, 4], np.int32), None, _Vocab()) == ([2, 4], "éc")  # stops at the eog
    assert seq.finish_reason == "stop" and seq.text == " abéc" and seq.generated == [3, 1, 2, 4]
    seq = Sequence(GenerationRequest(np.array([9], np.int32), max_tokens=3), (), 0, 10)
    assert seq.emit(np.array([4, 1, 2, 4], np.int32), None, _Vocab()) == ([4, 1, 2], "cé")  # cut at max_tokens
    assert seq.finish_reason == "length" and seq.history_view().tolist()[-3:] == [4, 1, 2]
    seq = Sequence(GenerationRequest(np.array([9], np.int32), stop=["ND"]), (), 0, 10)
    assert seq.emit(np.array([4, 5, 3], np.int32), None, _Vocab()) == ([4, 5], "cE")  # the stop string cuts
    assert seq.finish_reason == "stop"
