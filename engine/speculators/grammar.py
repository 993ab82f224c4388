"""grammar: drafts the text a request's grammar leaves no choice about (SGLang's jump-forward decoding).

Inside a JSON schema's output much of the text is fixed: the keys, `": "`, the commas and braces between
values. For a request with a grammar (SamplingParams.grammar) this speculator keeps its own copy of the
grammar state, advanced with the tokens the target committed, and before each draft walks forward on a
clone: at each step it asks the grammar which single characters may come next (one check of ~100
one-character tokens). Exactly one character: it is forced. One character or optional whitespace (JSON
grammars allow a space almost everywhere): the whitespace this sequence wrote after the same character
before (or a finished sequence did), else JSON's habit (a space after `:` and `,`), then the character. Anything else, or a point where
the grammar could end: the walk stops. The forced text is tokenized and drafted; the target checks it like
any draft, so a wrong guess (another whitespace, another tokenization) costs a rejected token and nothing
else. Requests without a grammar get no draft, so it costs nothing in a chain that serves free text too
(the default chain ends with it).

>>> forced_walk(_Regex('{"id": '), probe=tuple('{}":, id'), habits={}, tail=None, max_chars=32)
'{"id": '
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from specray.engine.constraint import TokenConstraint
from specray.engine.speculator import DraftRequest, Speculator

from ._util import EMPTY_DRAFT

__all__ = ["GrammarParams", "GrammarSpeculator", "GrammarTools", "forced_walk"]

WHITESPACE = " \n\t"
#: the characters probed at each step: printable ASCII, newline, tab
PROBE_CHARS = "".join(chr(c) for c in range(32, 127)) + "\n\t"
#: whitespace JSON writers put after a character (json.dumps' separators), when the sequence shows none yet
DEFAULT_HABITS = {":": " ", ",": " "}


class GrammarParams(BaseModel):
    """Parameters of the grammar speculator."""

    model_config = ConfigDict(extra="forbid")

    max_chars: int = Field(64, ge=1, le=1024, description="Look at most this many characters ahead per draft.")
    min_chars: int = Field(1, ge=1, description="Draft nothing when fewer characters than this are forced.")


class GrammarTools(Protocol):  # specray.native.grammar.GrammarCompiler
    eos: int

    def __call__(self, gbnf: str) -> TokenConstraint: ...
    def tokenize(self, text: str) -> np.ndarray: ...
    def char_tokens(self, chars: str) -> dict[str, int]: ...
    def piece(self, token: int) -> str: ...


def forced_walk(g: TokenConstraint, probe: tuple, habits: dict[str, str], tail: str | None,
                max_chars: int, probe_ids: np.ndarray | None = None, char_id: dict | None = None,
                eos: int | None = None) -> str:
    """The text `g` (a clone: it is advanced) leaves no real choice about, up to `max_chars` characters.

    `probe`: the characters to ask about (`probe_ids`/`char_id`: their token ids, default: a stand-in where
    the constraint takes characters), `habits`: the whitespace this sequence wrote after a character,
    `tail`: the last non-whitespace character written, `eos`: an end-of-generation token (the walk stops
    where the grammar could end).
    """
    ids = probe_ids if probe_ids is not None else probe
    char_id = char_id or {c: c for c in probe}
    out: list[str] = []
    after_ws = False
    while len(out) < max_chars:
        if eos is not None and g.allows(eos):
            break
        ok = g.allowed(ids)
        allowed = [c for c, a in zip(probe, ok) if a]
        solid = [c for c in allowed if c not in WHITESPACE]
        spaces = [c for c in allowed if c in WHITESPACE]
        if len(solid) == 1 and (not spaces or after_ws):
            step = solid[0]
        elif len(solid) == 1:
            run = habits.get(tail, DEFAULT_HABITS.get(tail, "")) if tail is not None else ""
            step = run if run and run[0] in spaces else solid[0]
        elif not solid and len(spaces) == 1 and not after_ws:
            step = spaces[0]
        else:
            break
        for c in step:  # a whitespace run goes in while the grammar takes it
            if len(out) >= max_chars or not g.allows(char_id[c]):
                break
            g.accept(char_id[c])
            out.append(c)
        else:
            after_ws = step[-1] in WHITESPACE
            if not after_ws:
                tail = step[-1]
            continue
        break
    return "".join(out)


@dataclass
class _Seq:
    grammar: TokenConstraint
    n_prompt: int
    n_fed: int = 0  # generated tokens the grammar has taken
    tail: str | None = None  # last non-whitespace character written
    ws: str = ""  # whitespace written since
    habits: dict[str, str] = field(default_factory=dict)


class GrammarSpeculator(Speculator):
    name = "grammar"
    cost_per_token = 0.0

    def __init__(self, params: GrammarParams | None = None, tools: GrammarTools | None = None) -> None:
        super().__init__()
        self.params = params or GrammarParams()
        # None: built without a vocabulary (make_speculator alone): it drafts nothing. Engines pass the target's
        self.tools = tools
        char_id = tools.char_tokens(PROBE_CHARS) if tools is not None else {}
        self._probe = tuple(char_id)
        self._probe_ids = np.array([char_id[c] for c in self._probe], dtype=np.int32)
        self._char_id = char_id
        self._grammars: dict[int, str] = {}
        self._seqs: dict[int, _Seq] = {}
        # whitespace habits of finished sequences (the model's JSON style): where a new sequence starts from
        self._habits: dict[str, str] = {}

    def set_grammar(self, seq_id: int, gbnf: str | None) -> None:
        """The grammar of the request about to begin in seq_id (None: it has none)."""
        if gbnf is None:
            self._grammars.pop(seq_id, None)
        else:
            self._grammars[seq_id] = gbnf

    def _begin(self, seq_id: int, prompt: np.ndarray) -> None:
        self._end(seq_id)
        gbnf = self._grammars.pop(seq_id, None)
        if gbnf is not None and self.tools is not None:
            self._seqs[seq_id] = _Seq(self.tools(gbnf), len(prompt), habits=dict(self._habits))

    def _draft_one(self, req: DraftRequest) -> np.ndarray:
        st = self._seqs.get(req.seq_id)
        if st is None or not self._feed(req.seq_id, st, req.history):
            return EMPTY_DRAFT
        g = st.grammar.clone()
        try:
            text = forced_walk(g, self._probe, st.habits, st.tail, self.params.max_chars, self._probe_ids,
                               self._char_id, self.tools.eos)
        finally:
            g.close()
        if len(text) < self.params.min_chars:
            return EMPTY_DRAFT
        return self.tools.tokenize(text)[: req.n_max]

    def _feed(self, seq_id: int, st: _Seq, history: np.ndarray) -> bool:
        """Advance the grammar with the tokens committed since the last draft; False (and forget the sequence)
        where they do not follow it (history edited under us: nothing to draft from)."""
        new = history[st.n_prompt + st.n_fed :]
        for t in new:
            t = int(t)
            if not st.grammar.allows(t):
                self._end(seq_id)
                return False
            st.grammar.accept(t)
            for c in self.tools.piece(t):
                if c in WHITESPACE:
                    st.ws += c
                else:
                    if st.tail is not None:
                        st.habits[st.tail] = st.ws
                    st.tail, st.ws = c, ""
        st.n_fed += len(new)
        return True

    def _end(self, seq_id: int) -> None:
        st = self._seqs.pop(seq_id, None)
        if st is not None:
            st.grammar.close()
            self._habits.update((c, ws) for c, ws in st.habits.items() if not c.isalnum())


class _Regex:
    """A doctest stand-in constraint over characters: allows exactly the next character of `text`, a space
    anywhere a JSON grammar would allow one (after '{', ':' and ','), and ends after `text`."""

    def __init__(self, text: str, i: int = 0) -> None:
        self.text, self.i = text.replace(" ", ""), i

    def allows(self, c) -> bool:
        nxt = self.text[self.i] if self.i < len(self.text) else None
        return c == nxt or (c == " " and self.i > 0 and self.text[self.i - 1] in "{:,")

    def allowed(self, cs) -> np.ndarray:
        return np.array([self.allows(c) for c in cs])

    def accept(self, c) -> None:
        if c != " ":
            self.i += 1
