"""Cross-vocabulary drafting: target tokens -> text -> draft tokens, and back.

Any draft model can draft for any target through text: the target's tokens
are detokenised, the text is tokenised for the draft model, the draft model
continues it, and its text is tokenised for the target; only target tokens
whose text lines up with the draft text are kept.

Two costs are kept small here:

* Incremental retokenisation. `TextMirror` holds one sequence's text and its
  draft-vocab tokens. New target text is appended and only a tail window is
  tokenised again, starting at a word start a few tokens back (BPE/SPM
  pre-tokenisers split at word starts, so the tokens before it keep their
  segmentation). The draft context's KV cache follows `tokens`: the caller
  keeps the longest common prefix and decodes the rest.
* UTF-8 boundaries. A byte-level token may end inside a character; text is
  tokenised only up to the last complete character, the rest waits.

>>> v = CharVocab()
>>> m = TextMirror(v, window=4)
>>> m.extend([b"hello", b" wor"]); m.tokens, m.covered
([104, 101, 108, 108, 111, 32, 119, 111, 114], 9)
>>> to_target_tokens(v, [ord("o")], b"ld!", keep_last=True)
array([108, 100,  33], dtype=int32)
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from specray.engine.speculator import EMPTY_DRAFT, TOKEN_DTYPE

WORD_START = (b" ", b"\n", b"\t", b"\r")


class TextVocab(Protocol):
    """A tokenizer as cross-vocab drafting needs it (native/draft_backend.py wraps a llama model)."""

    def piece(self, token: int) -> bytes:
        """Bytes of one token (special tokens as their text)."""
        ...

    def tokenize(self, text: bytes) -> np.ndarray:
        """int32 token ids of `text`, no BOS added, special-token text parsed as special tokens."""
        ...


def complete_utf8_len(data: bytes | bytearray) -> int:
    """Length of the longest prefix of `data` that does not end inside a UTF-8 character.

    >>> complete_utf8_len("a😀".encode()), complete_utf8_len("a😀".encode()[:3]), complete_utf8_len(b"ab")
    (5, 1, 2)
    """
    n = len(data)
    # look back at most 3 bytes for the lead byte of the last character
    for k in range(1, min(4, n) + 1):
        b = data[n - k]
        if b & 0xC0 == 0x80:  # continuation byte
            continue
        if b < 0x80:
            return n  # ASCII: complete (trailing continuation bytes, if any, are stray)
        need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
        return n if k >= need else n - k
    return n


def starts_word(piece: bytes) -> bool:
    return piece[:1] in WORD_START or piece[:1] == b"<"


class TextMirror:
    """One sequence's text and its tokens in the draft vocabulary.

    `prefix` tokens (the draft model's BOS) sit before the text and are never
    retokenised. `tokens[i]` covers text bytes [ends[i-1], ends[i]).
    """

    def __init__(self, vocab: TextVocab, prefix: tuple[int, ...] = (), window: int = 16) -> None:
        self.vocab = vocab
        self.n_prefix = len(prefix)
        self.window = max(1, window)
        self.text = bytearray()
        self.tokens: list[int] = list(prefix)
        self.ends: list[int] = [0] * len(prefix)
        self.covered = 0  # text bytes tokenised (the rest: an unfinished UTF-8 character)
        self.n_target = 0  # target tokens whose text is in self.text
        self.retokenised = 0  # tokens produced by tail retokenisation (cost counter)
        self.roundtrip_mismatches = 0  # tokenize -> pieces did not give the text back

    def reset(self) -> None:
        del self.tokens[self.n_prefix :]
        del self.ends[self.n_prefix :]
        self.text.clear()
        self.covered = self.n_target = 0

    def extend(self, pieces: list[bytes], n_target: int | None = None) -> None:
        """Append target text (one piece per target token) and retokenise the tail."""
        for p in pieces:
            self.text += p
        self.n_target += len(pieces) if n_target is None else n_target
        self._retokenise()

    def _retokenise(self) -> None:
        end = complete_utf8_len(self.text)
        if end == self.covered:
            return
        lo = self.n_prefix
        i = max(lo, len(self.tokens) - self.window)
        floor = max(lo, i - self.window)
        while i > floor and not starts_word(self.vocab.piece(self.tokens[i])):
            i -= 1
        start = self.ends[i - 1] if i > lo else 0
        new = [int(t) for t in self.vocab.tokenize(bytes(self.text[start:end]))]
        ends, off = [], start
        for t in new:
            off += len(self.vocab.piece(t))
            ends.append(off)
        if off != end:  # the tokenizer normalised the text: keep the mirror usable, count it
            self.roundtrip_mismatches += 1
            if ends:
                ends[-1] = end
        del self.tokens[i:]
        del self.ends[i:]
        self.tokens += new
        self.ends += ends
        self.covered = end
        self.retokenised += len(new)


def to_target_tokens(
    target: TextVocab, anchor: list[int] | np.ndarray, draft_text: bytes, keep_last: bool | None = None
) -> np.ndarray:
    """Target tokens for `draft_text`, which continues the target text ending with `anchor`'s tokens.

    The anchor (the target's last tokens) is tokenised together with the draft
    text so the first drafted token is segmented as in context; if the anchor
    does not come back unchanged (the draft text merged into it), the draft text
    is tokenised alone. Only tokens whose text is exactly the next slice of the
    draft text are kept. The last token's right context is unknown (more text
    could merge into it): keep_last=None keeps it only if it ends on a word
    boundary the draft text shows (whitespace or punctuation after a word).
    """
    body = bytes(draft_text[: complete_utf8_len(draft_text)])
    if not body:
        return EMPTY_DRAFT
    anchor = [int(t) for t in anchor]
    anchor_text = b"".join(target.piece(t) for t in anchor)
    toks = [int(t) for t in target.tokenize(anchor_text + body)] if anchor else []
    if anchor and toks[: len(anchor)] == anchor:
        rest = toks[len(anchor) :]
    else:
        rest = [int(t) for t in target.tokenize(body)]
    out: list[int] = []
    off = 0
    for t in rest:
        p = target.piece(t)
        if not p or body[off : off + len(p)] != p:
            break
        out.append(t)
        off += len(p)
    if out and off == len(body):
        last = target.piece(out[-1])
        keep = keep_last if keep_last is not None else _ends_on_boundary(last)
        if not keep:
            out.pop()
    return np.asarray(out, dtype=TOKEN_DTYPE) if out else EMPTY_DRAFT


def _ends_on_boundary(piece: bytes) -> bool:
    """A token ending in punctuation after a word (`.`, `,`, `)`, ...) or in a newline rarely grows."""
    if not piece:
        return False
    c = piece[-1:]
    return c in (b"\n",) or (c in b".,;:!?)]}\"'" and len(piece.strip()) >= 1 and not piece.isspace())


class CharVocab:
    """One token per byte (ids = byte values): a tokenizer for tests and examples."""

    def piece(self, token: int) -> bytes:
        return bytes([token])

    def tokenize(self, text: bytes) -> np.ndarray:
        return np.frombuffer(bytes(text), dtype=np.uint8).astype(TOKEN_DTYPE)
