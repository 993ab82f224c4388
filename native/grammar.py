"""Grammar-constrained decoding through llama.cpp's grammar sampler (GBNF, as llama-server's `grammar`).

`Grammar` is one sequence's grammar state (a `llama_sampler_init_grammar` sampler): which tokens it allows
next (`allows`, `allowed`, `mask`) and how it advances (`accept`). It implements the engine's
`TokenConstraint` (engine/constraint.py); `GrammarCompiler` is the engine's `ConstraintFactory` for one
vocabulary. JSON schemas become GBNF with llama-cpp-python's converter (the one llama-server's
`json_schema` uses, ported), `{"type": "json_object"}` with llama.cpp's JSON grammar.

llama.cpp aborts the process when a grammar accepts a token it does not allow: callers accept only tokens
the grammar allowed (verification picks the best *allowed* token; the grammar speculator checks first).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import sys
import tempfile
import threading
from collections import OrderedDict

import llama_cpp
import numpy as np
from llama_cpp import llama_grammar

__all__ = ["Grammar", "GrammarCompiler", "GrammarError", "JSON_OBJECT_GBNF", "schema_to_gbnf", "tool_call_gbnf"]

#: `{"type": "json_object"}`: any JSON object (llama.cpp's grammars/json.gbnf)
JSON_OBJECT_GBNF = llama_grammar.JSON_GBNF

_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)], align=True)
assert _TOKEN_DATA.itemsize == ctypes.sizeof(llama_cpp.llama_token_data)
_compile_lock = threading.Lock()


class GrammarError(ValueError):
    """A grammar or schema that does not compile (the message says where, as llama.cpp's parser does)."""


def schema_to_gbnf(schema: dict | str) -> str:
    """GBNF for a JSON schema (OpenAI's `response_format.json_schema.schema`).

    >>> print(schema_to_gbnf({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}))
    boolean ::= ("true" | "false") space
    ok-kv ::= "\\"ok\\"" space ":" space boolean
    root ::= "{" space ok-kv "}" space
    space ::= " "?
    """
    text = schema if isinstance(schema, str) else json.dumps(schema)
    try:
        return llama_grammar.json_schema_to_gbnf(text)
    except (ValueError, TypeError, KeyError, AssertionError, NotImplementedError, RecursionError,
            json.JSONDecodeError) as e:
        raise GrammarError(f"the JSON schema cannot be turned into a grammar: {e}") from None


def tool_call_gbnf(schema: dict) -> str:
    """GBNF for one Hermes-style tool call whose JSON follows `schema` (deployments/http/tool_calls.py):
    `<tool_call>\n{...}\n</tool_call>`, the model's end token after it."""
    body = re.sub(r"^root ::=", "call ::=", schema_to_gbnf(schema), flags=re.M)
    return body + '\nroot ::= "<tool_call>\\n" call "\\n</tool_call>"\n'


class _TokenArray:
    """A llama_token_data_array over a numpy buffer of `n` entries (reused: no allocation per call)."""

    def __init__(self, n: int) -> None:
        self.buf = np.zeros(n, dtype=_TOKEN_DATA)
        self.arr = llama_cpp.llama_token_data_array(
            data=self.buf.ctypes.data_as(llama_cpp.llama_token_data_p), size=n, selected=-1, sorted=False)
        self.ref = ctypes.byref(self.arr)

    def load(self, ids: np.ndarray, logits: np.ndarray | float) -> None:
        n = len(ids)
        self.buf["id"][:n] = ids
        self.buf["logit"][:n] = logits
        self.arr.size, self.arr.selected, self.arr.sorted = n, -1, False


class Grammar:
    """One sequence's grammar state (llama.cpp's grammar sampler), over a vocabulary of `n_vocab` tokens."""

    def __init__(self, smpl, n_vocab: int, eog: np.ndarray) -> None:
        self._smpl = smpl
        self.n_vocab = n_vocab
        self._eog = eog  # bool [n_vocab]
        self._few = _TokenArray(64)
        self._full: _TokenArray | None = None  # built at the first full-row mask

    def allows(self, token: int) -> bool:
        """True if `token` may come next."""
        return bool(self.allowed(np.array([token], dtype=np.int32))[0])

    def allowed(self, tokens: np.ndarray) -> np.ndarray:
        """Which of `tokens` may come next (bool per token). Costs the grammar's check of these tokens only."""
        tokens = np.asarray(tokens, dtype=np.int32)
        out = np.empty(len(tokens), dtype=bool)
        for s in range(0, len(tokens), len(self._few.buf)):
            part = tokens[s : s + len(self._few.buf)]
            self._few.load(part, 0.0)
            llama_cpp.llama_sampler_apply(self._smpl, self._few.ref)
            out[s : s + len(part)] = np.isfinite(self._few.buf["logit"][: len(part)])
        return out

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of a logits row [n_vocab] with every token the grammar forbids at -inf (a full-vocabulary check:
        about as costly as llama.cpp's own grammar sampling)."""
        if self._full is None:
            self._full = _TokenArray(self.n_vocab)
            self._full.buf["id"] = np.arange(self.n_vocab, dtype=np.int32)
        f = self._full
        f.buf["logit"] = logits
        f.arr.size, f.arr.selected, f.arr.sorted = self.n_vocab, -1, False
        llama_cpp.llama_sampler_apply(self._smpl, f.ref)
        return f.buf["logit"].copy()

    def accept(self, token: int) -> None:
        """Advance past `token` (which the grammar must allow; an end-of-generation token ends it)."""
        if self._eog[token]:
            return  # the sequence ends here; llama.cpp's accept of an end token only checks it was allowed
        llama_cpp.llama_sampler_accept(self._smpl, int(token))

    def clone(self) -> "Grammar":
        """An independent copy of this state (the grammar speculator looks ahead on one)."""
        return Grammar(llama_cpp.llama_sampler_clone(self._smpl), self.n_vocab, self._eog)

    def close(self) -> None:
        if self._smpl:
            llama_cpp.llama_sampler_free(self._smpl)
            self._smpl = None

    def __del__(self) -> None:  # a sequence dropped without close() must not leak its sampler
        try:
            self.close()
        except Exception:
            pass


class GrammarCompiler:
    """Compiles GBNF grammars for one model's vocabulary (the engine's ConstraintFactory). Keeps `model` alive:
    every grammar holds a pointer to its vocabulary.

    A request's grammar is needed several times (checked at admission and at submit, the sequence's state,
    the grammar speculator's copy), and a JSON schema's GBNF takes llama.cpp's parser a while: the last
    TEMPLATES grammars are kept compiled, and each use gets a clone of its template (a copy of the parsed
    rules, no parsing). `of(model)` is the one compiler per model, so that the engine's parts share it."""

    TEMPLATES = 32

    def __init__(self, model) -> None:
        self.model = model
        self.n_vocab = model.n_vocab
        self._eog = np.zeros(model.n_vocab, dtype=bool)
        self._eog[list(model.eog_ids)] = True
        self.eos = int(model.eos) if 0 <= model.eos < model.n_vocab else int(min(model.eog_ids, default=0))
        self._templates: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._lock = threading.Lock()  # Serve runs sync methods in a thread pool
        self.compiled = 0  # grammars parsed (the rest were clones)

    @classmethod
    def of(cls, model) -> "GrammarCompiler":
        """`model`'s shared compiler, `model.grammar_compiler` (made at first use; it lives as long as the model)."""
        comp = model.grammar_compiler
        if comp is None:
            comp = model.grammar_compiler = cls(model)
        return comp

    def __call__(self, gbnf: str, root: str = "root") -> Grammar:
        """A fresh grammar state; GrammarError (with llama.cpp's parse message) if it does not compile."""
        with self._lock:
            return self._template(gbnf, root).clone()

    def check(self, gbnf: str, root: str = "root") -> None:
        """GrammarError if `gbnf` does not compile (it is kept compiled for the request's later uses)."""
        with self._lock:
            self._template(gbnf, root)

    def _template(self, gbnf: str, root: str) -> Grammar:
        key = (gbnf, root)
        t = self._templates.get(key)
        if t is not None:
            self._templates.move_to_end(key)
            return t
        if not gbnf or not gbnf.strip():
            raise GrammarError("the grammar is empty")
        smpl = llama_cpp.llama_sampler_init_grammar(self.model.vocab, gbnf.encode(), root.encode())
        if not smpl:
            raise GrammarError(f"the grammar does not compile: {self._parse_message(gbnf, root)}")
        self.compiled += 1
        t = self._templates[key] = Grammar(smpl, self.n_vocab, self._eog)
        if len(self._templates) > self.TEMPLATES:
            self._templates.popitem(last=False)[1].close()
        return t

    def tokenize(self, text: str) -> np.ndarray:
        """Token ids of `text` (no BOS, special tokens as text): what the grammar speculator drafts."""
        return self.model.tokenize(text, add_special=False, parse_special=False)

    def piece(self, token: int) -> str:
        """The text of one token (bytes of a split character replaced)."""
        return self.model.token_to_piece(int(token)).decode("utf-8", errors="replace")

    def char_tokens(self, chars: str) -> dict[str, int]:
        """The single-token id of each character of `chars` that has one (for the grammar speculator's probes)."""
        out = {}
        for c in chars:
            ids = self.tokenize(c)
            if len(ids) == 1:
                out[c] = int(ids[0])
        return out

    def _parse_message(self, gbnf: str, root: str) -> str:
        """llama.cpp's parse error, one line: its parser writes it to the process's stderr (fd 2), so the grammar
        is compiled again with fd 2 sent to a file for the moment (only on this failure path)."""
        with _compile_lock, tempfile.TemporaryFile() as f:
            sys.stderr.flush()
            saved = os.dup(2)
            try:
                os.dup2(f.fileno(), 2)
                smpl = llama_cpp.llama_sampler_init_grammar(self.model.vocab, gbnf.encode(), root.encode())
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            if smpl:
                llama_cpp.llama_sampler_free(smpl)
            f.seek(0)
            text = f.read().decode(errors="replace")
        lines = [ln.split("error parsing grammar:", 1)[-1].strip() for ln in text.splitlines() if "error" in ln]
        return "; ".join(dict.fromkeys(lines))[:300] or "llama.cpp's GBNF parser refused it"
