"""Can a draft model's token ids go to the target as they are? llama.cpp's rules.

`common_speculative_are_compatible` (llama.cpp common/speculative.cpp) accepts a
draft/target pair only if, in this order:

1. the vocabulary types are the same (SPM, BPE, ...);
2. both add a BOS token or neither does, and if they do it is the same id;
3. the same for EOS;
4. the vocabulary sizes differ by at most 128;
5. every token id from 5 to min(n_vocab) - 1 has the same text.

An incompatible pair can still draft through text (cross-vocab mode,
engine/speculators/draft_text.py).

>>> t = FakeVocab(vocab_type=2, texts=[b"<s>", b"</s>", b"a", b"b", b"c", b"d", b"e"], bos=0, eos=1)
>>> d = FakeVocab(vocab_type=2, texts=[b"<s>", b"</s>", b"a", b"b", b"c", b"d", b"x"], bos=0, eos=1)
>>> vocab_mismatch(t, t) is None
True
>>> vocab_mismatch(t, d).rule
'token_text'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

VOCAB_MAX_SIZE_DIFFERENCE = 128
VOCAB_CHECK_START_TOKEN_ID = 5

#: llama_vocab_type values (llama.h)
VOCAB_TYPE_NAMES = {0: "none", 1: "SPM", 2: "BPE", 3: "WPM", 4: "UGM", 5: "RWKV", 6: "PLaMo2"}


class VocabFacts(Protocol):
    vocab_type: int
    n_vocab: int
    bos: int
    eos: int
    add_bos: bool
    add_eos: bool


class VocabTable(Protocol):
    """What the check reads from a model (specray.native.model.Model provides it)."""

    def vocab_info(self) -> VocabFacts: ...
    def token_text(self, token: int) -> bytes: ...


@dataclass(frozen=True)
class VocabMismatch:
    rule: str  # vocab_type | bos | eos | n_vocab | token_text
    detail: str


class VocabMismatchError(ValueError):
    """The draft model's token ids cannot be used by the target (and cross-vocab mode is off)."""

    def __init__(self, mismatch: VocabMismatch, target_name: str = "target", draft_name: str = "draft") -> None:
        self.mismatch = mismatch
        super().__init__(
            f"draft model {draft_name!r} is not vocabulary-compatible with target {target_name!r}: "
            f"{mismatch.rule} differs ({mismatch.detail}); use cross-vocab mode (--cross-vocab) "
            "to draft through text"
        )


def _type_name(t: int) -> str:
    return f"{VOCAB_TYPE_NAMES.get(t, '?')} ({t})"


def vocab_mismatch(target: VocabTable, draft: VocabTable) -> VocabMismatch | None:
    """The first llama.cpp compatibility rule the pair breaks, or None if compatible."""
    ti, di = target.vocab_info(), draft.vocab_info()
    if ti.vocab_type != di.vocab_type:
        return VocabMismatch(
            "vocab_type", f"target {_type_name(ti.vocab_type)}, draft {_type_name(di.vocab_type)}"
        )
    for rule, add_t, add_d, id_t, id_d in (
        ("bos", ti.add_bos, di.add_bos, ti.bos, di.bos),
        ("eos", ti.add_eos, di.add_eos, ti.eos, di.eos),
    ):
        if add_t != add_d or (add_t and id_t != id_d):
            return VocabMismatch(
                rule, f"target add_{rule}={add_t} id {id_t}, draft add_{rule}={add_d} id {id_d}"
            )
    diff = abs(ti.n_vocab - di.n_vocab)
    if diff > VOCAB_MAX_SIZE_DIFFERENCE:
        return VocabMismatch(
            "n_vocab",
            f"target {ti.n_vocab} tokens, draft {di.n_vocab}: {diff} apart, "
            f"at most {VOCAB_MAX_SIZE_DIFFERENCE} allowed",
        )
    for i in range(VOCAB_CHECK_START_TOKEN_ID, min(ti.n_vocab, di.n_vocab)):
        a, b = target.token_text(i), draft.token_text(i)
        if a != b:
            return VocabMismatch("token_text", f"token {i} is {a!r} in the target, {b!r} in the draft")
    return None


def check_vocab_compatible(
    target: VocabTable, draft: VocabTable, target_name: str = "target", draft_name: str = "draft"
) -> None:
    """Raise VocabMismatchError naming the first broken rule."""
    m = vocab_mismatch(target, draft)
    if m is not None:
        raise VocabMismatchError(m, target_name, draft_name)


@dataclass
class FakeVocab:
    """A small in-memory vocabulary table (tests and examples)."""

    vocab_type: int
    texts: list[bytes]
    bos: int = -1
    eos: int = -1
    add_bos: bool = False
    add_eos: bool = False
    extra: int = field(default=0)  # pretend there are this many more tokens (size rule)

    @property
    def n_vocab(self) -> int:
        return len(self.texts) + self.extra

    def vocab_info(self) -> FakeVocab:
        return self

    def token_text(self, token: int) -> bytes:
        return self.texts[token] if token < len(self.texts) else b"<extra %d>" % token
