"""llama.cpp's draft/target vocabulary compatibility rules over small in-memory tables."""

from __future__ import annotations

import doctest

import pytest

from specray.engine import vocab as vocab_mod
from specray.engine.vocab import FakeVocab, VocabMismatchError, check_vocab_compatible, vocab_mismatch

TEXTS = [b"<unk>", b"<s>", b"</s>", b"<pad>", b"<x>"] + [b"tok%d" % i for i in range(5, 40)]


def table(**kw) -> FakeVocab:
    args = dict(vocab_type=2, texts=list(TEXTS), bos=1, eos=2, add_bos=True, add_eos=False)
    args.update(kw)
    return FakeVocab(**args)


def test_identical_tables_are_compatible():
    assert vocab_mismatch(table(), table()) is None
    check_vocab_compatible(table(), table())


def test_token_texts_below_id_5_are_not_compared():
    other = list(TEXTS)
    other[3], other[4] = b"<something>", b"<else>"
    assert vocab_mismatch(table(), table(texts=other)) is None


@pytest.mark.parametrize(
    "draft_kw, rule, words",
    [
        (dict(vocab_type=1), "vocab_type", ["BPE", "SPM"]),
        (dict(add_bos=False), "bos", ["add_bos=True", "add_bos=False"]),
        (dict(bos=3), "bos", ["id 1", "id 3"]),
        (dict(add_eos=True), "eos", ["add_eos=False", "add_eos=True"]),
        (dict(extra=129), "n_vocab", ["40", "169", "129"]),
        (dict(texts=TEXTS[:20] + [b"other"] + TEXTS[21:]), "token_text", ["token 20", "tok20", "other"]),
    ],
)
def test_each_rule_is_named(draft_kw, rule, words):
    m = vocab_mismatch(table(), table(**draft_kw))
    assert m is not None and m.rule == rule
    assert all(w in m.detail for w in words), m.detail
    with pytest.raises(VocabMismatchError) as e:
        check_vocab_compatible(table(), table(**draft_kw), "big-model", "small-model")
    msg = str(e.value)
    assert rule in msg and "big-model" in msg and "small-model" in msg and "--cross-vocab" in msg


def test_eos_id_only_matters_when_added_and_sizes_within_128_pass():
    assert vocab_mismatch(table(eos=2), table(eos=3)) is None  # neither adds EOS
    assert vocab_mismatch(table(), table(extra=128)) is None  # 128 apart is still allowed
    # the shared ids are compared; the extra ids of the bigger vocabulary are not
    assert vocab_mismatch(table(extra=100), table(texts=TEXTS[:30])) is None


def test_the_first_broken_rule_is_reported():
    m = vocab_mismatch(table(), table(vocab_type=1, add_bos=False, extra=500))
    assert m.rule == "vocab_type"


def test_doctests():
    res = doctest.testmod(vocab_mod)
    assert res.attempted > 0 and res.failed == 0
