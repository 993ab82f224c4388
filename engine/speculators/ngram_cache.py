"""ngram_cache: n-gram -> next-token count tables (context, dynamic, static).

Mirrors llama.cpp's common/ngram-cache.cpp (`--spec-type ngram-cache`, the
`lookup` example):

* context: counts of (n-gram of size 1..4 -> next token) over this sequence's
  history, updated incrementally as the history grows;
* dynamic: the same counts accumulated over finished sequences (each
  sequence's context table is merged in at `end`, as llama-lookup does), loaded
  from / saved to `dynamic_path`;
* static: counts of 2-grams over a corpus, loaded from `static_path`
  (llama-lookup-create's output), read-only.

Drafting (`common_ngram_cache_draft`), one token at a time up to `n_draft`:
try the context table with lax thresholds, then the dynamic table with strict
ones, each from the longest n-gram (4) down to 1; a table entry qualifies when
its total count reaches the minimum sample size and its best token's share the
minimum percentage for that n-gram size. A candidate's count is weighted by
100 x its static count (1 if the static table does not know it). Last resort:
the static table alone with the 2-gram thresholds. Stop at the first step
where nothing qualifies.

File format: exactly llama.cpp's `common_ngram_cache_save` (native-endian
int32s): per n-gram, 4 tokens padded with -1, the number of distinct next
tokens k, then k pairs (token, count). Files written by llama-lookup-create
load here and vice versa.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from itertools import islice

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from specray.engine.draft_tree import Branch
from specray.engine.speculator import DraftRequest, Speculator

from ._util import EMPTY_DRAFT, HistoryCursor, as_tokens
from .kept_states import KeptStates

try:  # the compiled core of NgramCountTable.update and .merge and of ngram_cache_draft (setup.py builds it)
    from ._ngram_core import RULES as _CORE_RULES
    from ._ngram_core import SUMMARY_KEYS as _CORE_KEYS
    from ._ngram_core import draft as _core_draft
    from ._ngram_core import merge as _core_merge
    from ._ngram_core import update as _core_update
except ImportError:  # a source tree that was never built: the references (update_reference, ...) run instead
    _CORE_RULES = _CORE_KEYS = _core_draft = _core_merge = _core_update = None

NGRAM_MIN = 1  # LLAMA_NGRAM_MIN
NGRAM_MAX = 4  # LLAMA_NGRAM_MAX
NGRAM_STATIC = 2  # LLAMA_NGRAM_STATIC
TOKEN_NULL = -1
# thresholds by n-gram size 1..4 (llama.cpp draft_min_sample_size_* / draft_min_percent_*)
MIN_SAMPLE_LAX = (2, 2, 1, 1)
MIN_PERCENT_LAX = (66, 50, 50, 50)
MIN_SAMPLE_STRICT = (4, 3, 2, 2)
MIN_PERCENT_STRICT = (75, 66, 66, 66)

_ISZ = 4  # bytes per token in keys (int32)

# An entry is one of two things, neither of them a container Python's cyclic garbage collector tracks (a
# long-running server's tables hold hundreds of thousands of entries, and a list per entry, as at first, made each
# full collection walk every one of them):
# - an n-gram seen once is the int of the token that followed it: most n-grams of a text are seen once (3- and
#   4-grams nearly all), and an int costs neither the time nor the memory of a dict per n-gram;
# - from its second occurrence on, a dict of ints: its next tokens' counts under their ids (>= 0), and under these
#   three negative keys the entry's total, its best count and its best token.
_TOTAL, _BEST_COUNT, _BEST_TOKEN = -2, -3, -4
_META = 3  # keys of a dict entry that are not tokens
if _core_update is not None and _CORE_KEYS != (_TOTAL, _BEST_COUNT, _BEST_TOKEN):
    raise ImportError(f"_ngram_core.c's summary keys {_CORE_KEYS} are not ngram_cache.py's: rebuild it")
_RULES = (NGRAM_MIN, NGRAM_MAX, MIN_SAMPLE_LAX, MIN_PERCENT_LAX, MIN_SAMPLE_STRICT, MIN_PERCENT_STRICT)
if _core_draft is not None and _CORE_RULES != _RULES:
    raise ImportError(f"_ngram_core.c's drafting thresholds {_CORE_RULES} are not ngram_cache.py's {_RULES}: "
                      "rebuild it")
#: whether NgramCountTable.update and .merge and ngram_cache_draft run compiled here
COMPILED_CORE = _core_update is not None


def _entry(token: int, count: int) -> dict[int, int]:
    return {token: count, _TOTAL: count, _BEST_COUNT: count, _BEST_TOKEN: token}


def _grown(e, token: int) -> dict[int, int]:
    """A once-seen entry `e` (an int) after one more occurrence, followed by `token`: a dict entry in which `e`'s
    token keeps the lead on a tie (add()'s rule: a token leads once its count beats the leader's)."""
    if e == token:
        return {e: 2, _TOTAL: 2, _BEST_COUNT: 2, _BEST_TOKEN: e}
    return {e: 1, token: 1, _TOTAL: 2, _BEST_COUNT: 1, _BEST_TOKEN: e}


def _counted(e: dict[int, int], token: int) -> dict[int, int]:
    """A dict entry `e` after one more occurrence followed by `token` (add()'s rule); returns `e`."""
    c = e[token] = e.get(token, 0) + 1
    e[_TOTAL] += 1
    if c > e[_BEST_COUNT]:
        e[_BEST_COUNT] = c
        e[_BEST_TOKEN] = token
    return e


def entry_counts(e) -> dict[int, int]:
    """The next tokens' counts of an entry (NgramCountTable.get), without its summary keys.

    >>> entry_counts(7), entry_counts(_grown(7, 9))
    ({7: 1}, {7: 1, 9: 1})
    """
    if e.__class__ is int:
        return {e: 1}
    return {t: c for t, c in e.items() if t >= 0}


def entry_summary(e) -> tuple[int, int, int]:
    """(total, best count, best token) of an entry (NgramCountTable.get).

    >>> entry_summary(7), entry_summary(_grown(7, 7)), entry_summary(_grown(7, 9))
    ((1, 1, 7), (2, 2, 7), (2, 1, 7))
    """
    if e.__class__ is int:
        return 1, 1, e
    return e[_TOTAL], e[_BEST_COUNT], e[_BEST_TOKEN]


class NgramCacheParams(BaseModel):
    """Parameters of ngram_cache."""

    model_config = ConfigDict(extra="forbid")

    n_draft: int = Field(8, ge=1, le=256, description="at most this many draft tokens (llama.cpp: 8)")
    static_path: str | None = Field(
        None, description="static n-gram cache file (llama-lookup-create format), loaded at construction"
    )
    dynamic_path: str | None = Field(
        None, description="dynamic n-gram cache file: loaded at construction if it exists, written by save()"
    )
    update_dynamic: bool = Field(True, description="merge each finished sequence's context counts into dynamic")
    dynamic_max_ngrams: int = Field(
        250_000, ge=0, description="bound on dynamic n-grams; the oldest inserted are dropped beyond it (one seen "
        "more than once holds a few hundred bytes, one seen once much less: docs/benchmarks.md; ngram_cache is in "
        "the default chain of every server)"
    )
    keep_finished: int = Field(
        16, ge=0, description="finished sequences whose context table is kept for a request that continues one (a "
        "conversation's next turn starts from it and counts only its new tokens); a kept table is merged into "
        "the dynamic table when it leaves the kept ones (the oldest first), a continued one at its own end. "
        "0: none kept, every table merged at its sequence's end"
    )
    keep_finished_tokens: int = Field(
        32_768, ge=0, description="tokens the kept context tables counted, in all; the oldest table goes first"
    )


class NgramCountTable:
    """n-gram (1..4 tokens, as int32 bytes) -> next-token counts.

    An n-gram seen once is the int of the token that followed it; from its second occurrence on its entry is a
    dict of ints (see `_TOTAL`): the next tokens' counts and the entry's total, best count and best token, so the
    best token is known without a scan. Read entries with `entry_summary` and `entry_counts`.

    >>> t = NgramCountTable()
    >>> t.update(np.array([1, 2, 1, 2, 1, 3], np.int32))
    >>> t.counts([1])           # after 1: 2 twice, 3 once
    {2: 2, 3: 1}
    >>> t.counts([2, 1]), t.counts([1, 2, 1, 2, 1]), len(t)
    ({2: 1, 3: 1}, {}, 8)
    >>> entry_summary(t.get(np.array([1], np.int32).tobytes()))   # total, best count, best token
    (3, 2, 2)
    >>> t.get(np.array([2, 1, 2], np.int32).tobytes())             # seen once, followed by 1
    1
    """

    __slots__ = ("table",)

    #: update, merge and ngram_cache_draft with the compiled core where it is built; False (on the class) runs the
    #: references
    compiled = True

    def __init__(self) -> None:
        self.table: dict[bytes, int | dict[int, int]] = {}

    def __len__(self) -> int:
        return len(self.table)

    def get(self, key: bytes):
        return self.table.get(key)

    def counts(self, ngram) -> dict[int, int]:
        e = self.table.get(as_tokens(ngram).tobytes())
        return {} if e is None else entry_counts(e)

    def add(self, key: bytes, token: int, count: int = 1) -> None:
        token = int(token)  # a once-seen entry is a Python int (a numpy one would read as a dict entry)
        if token < 0:  # the entry's negative keys are its summary (_TOTAL)
            raise ValueError(f"token id must be >= 0, got {token}")
        e = self.table.get(key)
        if e is None:
            self.table[key] = token if count == 1 else _entry(token, count)
            return
        if e.__class__ is int:
            e = self.table[key] = _entry(e, 1)
        c = e[token] = e.get(token, 0) + count
        e[_TOTAL] += count
        if c > e[_BEST_COUNT]:
            e[_BEST_COUNT] = c
            e[_BEST_TOKEN] = token

    def update(self, tokens: np.ndarray, start: int = 0, ngram_min: int = NGRAM_MIN, ngram_max: int = NGRAM_MAX) -> None:
        """Count (tokens[i-s:i] -> tokens[i]) for every new i >= start and s in [ngram_min, ngram_max]. Runs the
        compiled core (_ngram_core.c) where it is built, else `update_reference`: the two count the same table."""
        if _core_update is None or not self.compiled:
            self.update_reference(tokens, start, ngram_min, ngram_max)
            return
        tokens = as_tokens(tokens)
        lo = max(0, start - ngram_max)
        _core_update(self.table, tokens[lo:].tobytes(), lo, start, ngram_min, ngram_max)

    def update_reference(self, tokens: np.ndarray, start: int = 0, ngram_min: int = NGRAM_MIN,
                         ngram_max: int = NGRAM_MAX) -> None:
        """`update` in pure Python: the reference the compiled core is held to (tests/unit/test_spec_ngram_core.py),
        and what runs where the core is not built."""
        tokens = as_tokens(tokens)
        L = len(tokens)
        lo = max(0, start - ngram_max)
        hb = tokens[lo:].tobytes()
        toks = tokens[lo:].tolist()
        table = self.table
        # add() inlined: this loop runs for every prompt token (begin) and every emitted one, ~4 n-grams each,
        # on the round thread, where a call per n-gram is a large share of its time
        for i in range(max(start, ngram_min), L):
            r = i - lo
            tok = toks[r]
            end = r * _ISZ
            for s in range(ngram_min, min(ngram_max, i) + 1):
                key = hb[end - s * _ISZ : end]
                e = table.get(key)
                if e is None:
                    table[key] = tok
                    continue
                if e.__class__ is int:
                    table[key] = _grown(e, tok)
                    continue
                c = e[tok] = e.get(tok, 0) + 1
                e[_TOTAL] += 1
                if c > e[_BEST_COUNT]:
                    e[_BEST_COUNT] = c
                    e[_BEST_TOKEN] = tok

    def merge(self, other: "NgramCountTable") -> None:
        """Add all of `other`'s counts (llama.cpp `common_ngram_cache_merge`), taking its entries: `other` is
        left empty. Why take them: a finished sequence's context table is merged once and dropped, and moving
        its entries where the dynamic table lacks the n-gram (most of them) instead of copying each count dict
        makes the merge several times cheaper: the merge runs on the round thread, once per finished sequence.

        >>> a, b = NgramCountTable(), NgramCountTable()
        >>> a.update(np.array([1, 2, 1, 3], np.int32)); b.update(np.array([1, 3, 1, 3], np.int32))
        >>> a.merge(b)
        >>> a.counts([1]), entry_summary(a.get(np.array([1], np.int32).tobytes()))[2], len(b)   # 3 now leads
        ({2: 1, 3: 3}, 3, 0)

        Runs the compiled core (_ngram_core.c) where it is built, else `merge_reference`: the two leave the same
        table.
        """
        if _core_merge is None or not self.compiled:
            self.merge_reference(other)
            return
        _core_merge(self.table, other.table)
        other.table = {}

    def merge_reference(self, other: "NgramCountTable") -> None:
        """`merge` in pure Python: the reference the compiled core is held to (tests/unit/test_spec_ngram_core.py),
        and what runs where the core is not built."""
        mine = self.table
        for key, e in other.table.items():
            m = mine.get(key)
            if m is None:
                mine[key] = e
                continue
            if e.__class__ is int:
                mine[key] = _grown(m, e) if m.__class__ is int else _counted(m, e)
                continue
            if m.__class__ is int:
                m = mine[key] = _entry(m, 1)
            best = m[_BEST_COUNT]
            for tok, c in e.items():  # add()'s rule: a token leads once its count beats the leader's
                if tok < 0:
                    continue
                c += m.get(tok, 0)
                m[tok] = c
                if c > best:
                    best = c
                    m[_BEST_TOKEN] = tok
            m[_TOTAL] += e[_TOTAL]
            m[_BEST_COUNT] = best
        other.table = {}

    def trim(self, max_ngrams: int) -> int:
        """Drop the oldest inserted n-grams beyond `max_ngrams`; returns how many were dropped."""
        excess = len(self.table) - max_ngrams
        if excess <= 0:
            return 0
        for k in list(islice(iter(self.table), excess)):
            del self.table[k]
        return excess

    # ---- llama.cpp file format -------------------------------------------
    def to_bytes(self) -> bytes:
        out: list[int] = []
        for key, e in self.table.items():
            ng = np.frombuffer(key, dtype=np.int32).tolist()
            out.extend(ng + [TOKEN_NULL] * (NGRAM_MAX - len(ng)))
            if e.__class__ is int:  # seen once
                out += (1, e, 1)
                continue
            out.append(len(e) - _META)
            for tok, c in e.items():
                if tok >= 0:
                    out.append(tok)
                    out.append(c)
        return np.array(out, dtype=np.int32).tobytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> "NgramCountTable":
        if len(data) % _ISZ:
            raise ValueError("ngram cache data is not a whole number of int32s")
        a = np.frombuffer(data, dtype=np.int32).tolist()
        t = cls()
        table = t.table
        pos, n = 0, len(a)
        while pos < n:
            if pos + NGRAM_MAX + 1 > n:
                raise ValueError(f"truncated ngram cache entry at int32 offset {pos}")
            ng = a[pos : pos + NGRAM_MAX]
            size = NGRAM_MAX
            while size and ng[size - 1] == TOKEN_NULL:
                size -= 1
            k = a[pos + NGRAM_MAX]
            pos += NGRAM_MAX + 1
            if size == 0 or k <= 0 or pos + 2 * k > n:
                raise ValueError(f"bad ngram cache entry at int32 offset {pos - NGRAM_MAX - 1}")
            key = np.array(ng[:size], dtype=np.int32).tobytes()
            d: dict[int, int] = {}
            tot = best_c = 0
            best_t = TOKEN_NULL
            for q in range(pos, pos + 2 * k, 2):
                tok, c = a[q], a[q + 1]
                if c <= 0:
                    raise ValueError(f"non-positive count in ngram cache at int32 offset {q}")
                if tok < 0:
                    raise ValueError(f"negative token id in ngram cache at int32 offset {q}")
                d[tok] = d.get(tok, 0) + c
                tot += c
            for tok, c in d.items():
                if c > best_c:
                    best_c, best_t = c, tok
            pos += 2 * k
            if key in table:  # duplicate n-gram in a file: merge
                for tok, c in d.items():
                    t.add(key, tok, c)
            elif tot == 1:  # seen once: the entry is its token
                table[key] = best_t
            else:
                d[_TOTAL], d[_BEST_COUNT], d[_BEST_TOKEN] = tot, best_c, best_t
                table[key] = d
        return t

    def save(self, path: str | os.PathLike) -> None:
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "wb") as f:
            f.write(self.to_bytes())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "NgramCountTable":
        with open(path, "rb") as f:
            return cls.from_bytes(f.read())


def build_static_cache(corpus: np.ndarray) -> NgramCountTable:
    """A static table from a token corpus (2-grams only, as llama-lookup-create)."""
    t = NgramCountTable()
    t.update(corpus, 0, NGRAM_STATIC, NGRAM_STATIC)
    return t


def _best(entry, part_static) -> tuple[int, int, int]:
    """(total, best count, best token) of an entry, weighted by the static part (a dict entry) if any."""
    if entry.__class__ is int:  # seen once: its one token, however weighted
        return 1, 1, entry
    if not part_static:
        return entry[_TOTAL], entry[_BEST_COUNT], entry[_BEST_TOKEN]
    best_p = best_s = 0
    best_t = TOKEN_NULL
    for tok, c in entry.items():
        if tok < 0:
            continue
        s = part_static.get(tok)
        s = 100 * s if s is not None else 1
        if c * s > best_p * best_s:
            best_t, best_p, best_s = tok, c, s
    return entry[_TOTAL], best_p, best_t


def _try_primary(table: dict, buf: bytes, avail: int, part_static, min_sample, min_percent) -> int:
    for size in range(min(NGRAM_MAX, avail), NGRAM_MIN - 1, -1):
        e = table.get(buf[-size * _ISZ :])
        if e is None:
            continue
        tot, best_c, best_t = _best(e, part_static)
        if tot < min_sample[size - 1]:
            continue
        if 100 * best_c < min_percent[size - 1] * tot:
            continue
        return best_t
    return TOKEN_NULL


def ngram_cache_draft(
    history: np.ndarray,
    n_draft: int,
    context: NgramCountTable,
    dynamic: NgramCountTable | None = None,
    static: NgramCountTable | None = None,
) -> np.ndarray:
    """Draft up to `n_draft` tokens after `history` from the three tables (no update). Without a static table the
    compiled core (_ngram_core.c) walks them where it is built and NgramCountTable.compiled is on; else
    `ngram_cache_draft_reference`, which drafts the same tokens.

    >>> h = np.array([5, 1, 2, 3, 9, 1, 2, 3, 7, 1, 2], np.int32)
    >>> ctx = NgramCountTable(); ctx.update(h)
    >>> ngram_cache_draft(h, 4, ctx)    # [1 2] -> 3 (2/2); then [.. 2 3] -> 9 or 7 (1/2 each, 4/3-grams ok)
    array([3, 9, 1, 2], dtype=int32)
    >>> ngram_cache_draft(np.array([8, 8], np.int32), 4, ctx)     # nothing known after 8
    array([], dtype=int32)
    >>> ngram_cache_draft(h[:1], 4, ctx)                         # fewer than 2 tokens
    array([], dtype=int32)
    """
    if _core_draft is None or not NgramCountTable.compiled or (static is not None and len(static)):
        return ngram_cache_draft_reference(history, n_draft, context, dynamic, static)
    h = as_tokens(history)
    L = len(h)
    if L < NGRAM_STATIC or n_draft <= 0:
        return EMPTY_DRAFT
    dyn_t = dynamic.table if dynamic is not None and len(dynamic) else None
    out = _core_draft(context.table, dyn_t, h[max(0, L - NGRAM_MAX) :].tobytes(), L, n_draft)
    return np.array(out, dtype=np.int32) if out else EMPTY_DRAFT


def ngram_cache_draft_reference(
    history: np.ndarray,
    n_draft: int,
    context: NgramCountTable,
    dynamic: NgramCountTable | None = None,
    static: NgramCountTable | None = None,
) -> np.ndarray:
    """`ngram_cache_draft` in pure Python: the reference the compiled walk is held to
    (tests/unit/test_spec_ngram_core.py), and what runs with a static table or where the core is not built.
    With a static table, its 2-grams weigh the candidates and are the last resort:

    >>> static = NgramCountTable(); static.update(np.array([1, 2, 3] * 3, np.int32), ngram_min=2, ngram_max=2)
    >>> h = np.array([7, 1, 2], np.int32); ctx = NgramCountTable(); ctx.update(h)
    >>> ngram_cache_draft_reference(h, 3, ctx, None, static), ngram_cache_draft_reference(h, 3, ctx)
    (array([3, 1, 2], dtype=int32), array([], dtype=int32))
    """
    h = as_tokens(history)
    L = len(h)
    if L < NGRAM_STATIC or n_draft <= 0:
        return EMPTY_DRAFT
    ctx_t = context.table
    dyn_t = dynamic.table if dynamic is not None and len(dynamic) else None
    sta_t = static.table if static is not None and len(static) else None
    buf = h[max(0, L - NGRAM_MAX) :].tobytes()
    out: list[int] = []
    while len(out) < n_draft:
        avail = L + len(out)
        part_static = sta_t.get(buf[-NGRAM_STATIC * _ISZ :]) if sta_t is not None else None
        if part_static.__class__ is int:  # a 2-gram the corpus has once: weigh by it as a dict entry
            part_static = _entry(part_static, 1)
        tok = _try_primary(ctx_t, buf, avail, part_static, MIN_SAMPLE_LAX, MIN_PERCENT_LAX)
        if tok == TOKEN_NULL and dyn_t is not None:
            tok = _try_primary(dyn_t, buf, avail, part_static, MIN_SAMPLE_STRICT, MIN_PERCENT_STRICT)
        if tok == TOKEN_NULL and part_static is not None:
            tot, best_c, best_t = part_static[_TOTAL], part_static[_BEST_COUNT], part_static[_BEST_TOKEN]
            i = NGRAM_STATIC - 1
            if tot >= MIN_SAMPLE_LAX[i] and 100 * best_c >= MIN_PERCENT_LAX[i] * tot:
                tok = best_t
        if tok == TOKEN_NULL:
            break
        out.append(tok)
        buf = buf[-(NGRAM_MAX - 1) * _ISZ :] + int(tok).to_bytes(_ISZ, sys.byteorder, signed=True)
    return np.array(out, dtype=np.int32) if out else EMPTY_DRAFT


def _runner_up(table: dict, buf: bytes, avail: int, main_token: int) -> tuple[int, float] | None:
    """(token, its count over main_token's) of the entry the lax context rule drafted main_token from (the
    longest qualifying n-gram, as _try_primary), the most frequent other token; None where there is none."""
    for size in range(min(NGRAM_MAX, avail), NGRAM_MIN - 1, -1):
        e = table.get(buf[-size * _ISZ :])
        if e is None:
            continue
        tot, best_c, best_t = entry_summary(e)
        if tot < MIN_SAMPLE_LAX[size - 1] or 100 * best_c < MIN_PERCENT_LAX[size - 1] * tot:
            continue
        if best_t != main_token or e.__class__ is int or len(e) - _META < 2:
            return None
        tok, c = max(((t, c) for t, c in e.items() if t >= 0 and t != main_token), key=lambda tc: tc[1])
        return tok, c / best_c
    return None


def ngram_cache_branches(history: np.ndarray, main, context: NgramCountTable, width: int,
                         dynamic: NgramCountTable | None = None) -> list[Branch]:
    """Runner-ups beside `main`, a draft of the context table: at each depth where the context table's entry
    holds another next token, the most frequent one, continued by a draft of its own (no longer than the main
    draft's rest); its weight is its count over the main token's. The `width` most likely, most likely first.

    >>> h = np.array([5, 1, 2, 3, 9, 1, 2, 3, 7, 1, 2], np.int32)
    >>> ctx = NgramCountTable(); ctx.update(h)
    >>> main = ngram_cache_draft(h, 4, ctx); main.tolist()
    [3, 9, 1, 2]
    >>> [(b.at, b.tokens.tolist(), b.weight) for b in ngram_cache_branches(h, main, ctx, 2)]
    [(1, [7, 1, 2], 1.0)]
    """
    h = as_tokens(history)
    main = [int(t) for t in main]
    buf = h[max(0, len(h) - NGRAM_MAX) :].tobytes()
    alts: list[tuple[float, int, int]] = []  # (weight, depth, token)
    for j, t in enumerate(main):
        r = _runner_up(context.table, buf, len(h) + j, t)
        if r is not None:
            alts.append((r[1], j, r[0]))
        buf = buf[-(NGRAM_MAX - 1) * _ISZ :] + int(t).to_bytes(_ISZ, sys.byteorder, signed=True)
    alts.sort(key=lambda a: (-a[0], a[1]))
    out = []
    for w, j, tok in alts[:width]:
        stem = np.concatenate([h, np.asarray(main[:j] + [tok], np.int32)])
        rest = ngram_cache_draft(stem, len(main) - j - 1, context, dynamic)
        out.append(Branch(j, np.concatenate([[tok], rest]).astype(np.int32), w))
    return out


@dataclass
class _SeqState:
    context: NgramCountTable = field(default_factory=NgramCountTable)
    cursor: HistoryCursor = field(default_factory=HistoryCursor)
    history: np.ndarray | None = None  # the last draft's history, for its runner-ups (same round only)
    tokens: np.ndarray | None = None  # the tokens the context table counted
    prompt: np.ndarray | None = None  # the prompt, counted as the target prefills it (prefilling)


class NgramCacheSpeculator(Speculator):
    """llama.cpp `ngram-cache`: context / dynamic / static n-gram count tables."""

    name = "ngram_cache"
    offers_branches = True

    def __init__(self, params: NgramCacheParams | None = None) -> None:
        super().__init__()
        self.params = p = params or NgramCacheParams()
        self.static = NgramCountTable.load(p.static_path) if p.static_path else NgramCountTable()
        if p.dynamic_path and os.path.exists(p.dynamic_path):
            self.dynamic = NgramCountTable.load(p.dynamic_path)
        else:
            self.dynamic = NgramCountTable()
        self._seqs: dict[int, _SeqState] = {}
        # finished sequences' context tables, for the requests that continue them (kept_states.py)
        self.kept = KeptStates(p.keep_finished, p.keep_finished_tokens, on_drop=self._merge)

    def _sync(self, st: _SeqState, h: np.ndarray) -> None:
        if not st.cursor.is_extension(h):
            st.context = NgramCountTable()
            st.cursor.reset()
        if len(h) > st.cursor.n:
            st.context.update(h, st.cursor.n)
        st.cursor.advance(h)
        st.tokens = h

    def _begin(self, seq_id: int, prompt: np.ndarray) -> None:
        prompt = as_tokens(prompt)
        st = self.kept.take(prompt) if len(prompt) else None
        if st is None:
            st = _SeqState()
        else:
            self.stats.continued += 1
            self.stats.continued_tokens += st.cursor.n
        st.history = None
        st.prompt = prompt  # counted as the target prefills it (prefilling), or when it first drafts
        self._seqs[seq_id] = st

    def _prefilling(self, seq_id: int, n: int) -> None:
        st = self._seqs.get(seq_id)
        if st is not None and st.prompt is not None and n > st.cursor.n:
            self._sync(st, st.prompt[:n])

    def indexed(self, seq_id: int) -> int:
        """How many tokens of seq_id's history its context table has counted (0: none, or no such sequence)."""
        st = self._seqs.get(seq_id)
        return st.cursor.n if st is not None else 0

    def _draft_one(self, req: DraftRequest) -> np.ndarray:
        st = self._seqs.get(req.seq_id)
        if st is None:
            st = self._seqs[req.seq_id] = _SeqState()
        h = as_tokens(req.history)
        self._sync(st, h)
        d = ngram_cache_draft(h, min(self.params.n_draft, req.n_max), st.context, self.dynamic, self.static)
        st.history = h if len(d) else None
        return d

    def _branches(self, seq_id: int, main: list[int], width: int) -> list[Branch]:
        st = self._seqs.get(seq_id)
        if st is None or st.history is None or len(self.static):  # static weighting: one guess, no runner-up
            return []
        h, st.history = st.history, None
        return ngram_cache_branches(h, main, st.context, width, self.dynamic)

    def _end(self, seq_id: int) -> None:
        st = self._seqs.pop(seq_id, None)
        if st is None:
            return
        if st.tokens is not None and len(st.context):
            self.kept.put(st.tokens, st)  # merged into the dynamic table when it leaves the kept ones
        else:
            self._merge(st)

    def _merge(self, st: _SeqState) -> None:
        """A finished sequence's counts into the dynamic table (taken: its context table is left empty)."""
        if not self.params.update_dynamic or not len(st.context):
            return
        self.dynamic.merge(st.context)
        self.dynamic.trim(self.params.dynamic_max_ngrams)

    def merge_kept(self) -> None:
        """Every kept table's counts into the dynamic table now (they are no longer kept)."""
        for st in self.kept.drain():
            self._merge(st)

    def save(self, path: str | os.PathLike | None = None) -> str:
        """Write the dynamic table (llama.cpp format) to `path` or `dynamic_path`, the kept tables' counts merged
        in first; returns the path."""
        target = path if path is not None else self.params.dynamic_path
        if not target:
            raise ValueError("ngram_cache.save(): no path given and params.dynamic_path is not set")
        self.merge_kept()
        self.dynamic.save(target)
        return os.fspath(target)

    def get_state(self):
        self.merge_kept()
        return {"dynamic": self.dynamic.to_bytes()}

    def set_state(self, state) -> None:
        if state and state.get("dynamic") is not None:
            self.dynamic = NgramCountTable.from_bytes(state["dynamic"])
