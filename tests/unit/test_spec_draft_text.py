"""Cross-vocab text plumbing: UTF-8 boundaries, incremental retokenisation, draft -> target alignment."""

from __future__ import annotations

import doctest
import re

import numpy as np

from specray.engine.speculators import draft_text
from specray.engine.speculators.draft_text import (
    CharVocab,
    TextMirror,
    complete_utf8_len,
    to_target_tokens,
)

WORD = re.compile(rb"<[a-z_]+>| ?[A-Za-z]+| ?[0-9]| ?[^A-Za-z0-9\s<]|\s+(?!\S)|\s+|<")


class WordVocab:
    """A pre-tokeniser-style tokenizer: whole words with their leading space, digits one by one,
    punctuation alone; `<name>` is one special token. Ids are handed out on first sight."""

    def __init__(self) -> None:
        self.ids: dict[bytes, int] = {}
        self.pieces: list[bytes] = []
        self.calls = 0
        self.bytes_tokenised = 0

    def id(self, piece: bytes) -> int:
        if piece not in self.ids:
            self.ids[piece] = len(self.pieces)
            self.pieces.append(piece)
        return self.ids[piece]

    def piece(self, token: int) -> bytes:
        return self.pieces[token]

    def tokenize(self, text: bytes) -> np.ndarray:
        self.calls += 1
        self.bytes_tokenised += len(text)
        parts = WORD.findall(bytes(text))
        assert b"".join(parts) == bytes(text)
        return np.array([self.id(p) for p in parts], dtype=np.int32)


TEXT = (b"The quick brown fox jumps over the lazy dog. It was 42 degrees, and the dog slept.\n"
        b"def f(x):\n    return x * 2  # twice\n" + "caf\u00e9 na\u00efve \u2014 \U0001F600 ok.".encode())


def test_complete_utf8_len():
    s = "a\u00e9\u20ac\U0001F600".encode()  # 1 + 2 + 3 + 4 bytes
    assert complete_utf8_len(s) == 10
    for cut, want in [(2, 1), (3, 3), (4, 3), (5, 3), (6, 6), (7, 6), (8, 6), (9, 6), (10, 10)]:
        assert complete_utf8_len(s[:cut]) == want, cut
    assert complete_utf8_len(b"") == 0


def test_incremental_mirror_equals_full_tokenisation_whatever_the_split():
    rng = np.random.default_rng(0)
    for trial in range(20):
        v = WordVocab()
        m = TextMirror(v, prefix=(999,), window=4)
        # feed the text in random byte chunks (cutting words and UTF-8 characters)
        cuts = sorted(set(rng.integers(1, len(TEXT), size=25).tolist())) + [len(TEXT)]
        start = 0
        for c in cuts:
            m.extend([TEXT[start:c]])
            start = c
            full = [int(t) for t in v.tokenize(TEXT[: complete_utf8_len(TEXT[:c])])]
            assert m.tokens == [999] + full, (trial, c)
            assert m.ends[-1] == m.covered == complete_utf8_len(TEXT[:c])
        assert m.n_target == len(cuts) and m.roundtrip_mismatches == 0


def test_retokenisation_is_a_tail_window_not_the_whole_text():
    v = WordVocab()
    m = TextMirror(v, window=4)
    words = [b" word%d" % i for i in range(400)]
    for w in words:
        m.extend([w])
    n_tokens = len(m.tokens)
    assert n_tokens >= 800  # " word" + digits
    # every extend re-tokenised at most ~2 windows of tokens, not the whole text
    assert m.retokenised < 400 * (2 * 4 + 4)
    assert v.bytes_tokenised < 400 * 80


def test_reset_keeps_the_prefix():
    m = TextMirror(WordVocab(), prefix=(7,), window=2)
    m.extend([b"hello there"])
    m.reset()
    assert m.tokens == [7] and m.text == bytearray() and m.n_target == 0


def test_to_target_tokens_keeps_only_aligned_text():
    v = WordVocab()
    anchor = [int(t) for t in v.tokenize(b" The")]
    # whole words: " quick" ends at the end of the draft text -> dropped by default (could grow)
    d = to_target_tokens(v, anchor, b" quick brown")
    assert [v.piece(int(t)) for t in d] == [b" quick"]
    d = to_target_tokens(v, anchor, b" quick brown", keep_last=True)
    assert [v.piece(int(t)) for t in d] == [b" quick", b" brown"]
    # punctuation at the end is kept: it rarely merges with what follows
    d = to_target_tokens(v, anchor, b" quick.")
    assert [v.piece(int(t)) for t in d] == [b" quick", b"."]
    # a draft that continues the anchor's word: the anchor does not come back, the text is tokenised alone
    d = to_target_tokens(v, anchor, b"se cat.", keep_last=True)
    assert [v.piece(int(t)) for t in d] == [b"se", b" cat", b"."]
    # an unfinished UTF-8 character is not drafted
    d = to_target_tokens(CharVocab(), [ord("a")], "b\u00e9".encode()[:2], keep_last=True)
    assert d.tolist() == [ord("b")]
    assert len(to_target_tokens(v, anchor, b"")) == 0


def test_special_tokens_round_trip_as_text():
    v = WordVocab()
    m = TextMirror(v, window=3)
    m.extend([b"<start>", b"user", b"\nHi", b"<end>"])
    assert [v.piece(t) for t in m.tokens] == [b"<start>", b"user", b"\n", b"Hi", b"<end>"]


def test_doctests():
    res = doctest.testmod(draft_text)
    assert res.attempted > 0 and res.failed == 0
