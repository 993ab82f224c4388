"""Helpers shared by the speculator unit tests (no model needed)."""

from __future__ import annotations

import numpy as np

from specray.engine.speculator import DraftRequest, Speculator


def arr(*tokens) -> np.ndarray:
    return np.array(tokens, dtype=np.int32)


def draft1(spec: Speculator, seq_id: int, history, n_max: int = 64) -> np.ndarray:
    """One draft through the public API."""
    (d,) = spec.draft([DraftRequest(seq_id, np.asarray(history, dtype=np.int32), n_max)])
    assert d.dtype == np.int32
    assert len(d) <= n_max
    return d


def run_lifecycle(spec: Speculator, prompt, continuation, n_max: int = 8, seq_id: int = 7) -> dict:
    """begin -> (draft -> accept against `continuation`)* -> end, like the server.

    The "target" emits `continuation` token by token; each round it accepts the
    longest draft prefix that agrees with it, plus one bonus token. Returns
    counters computed independently of the speculator's stats.
    """
    prompt = [int(t) for t in prompt]
    cont = [int(t) for t in continuation]
    spec.begin(seq_id, np.array(prompt, dtype=np.int32))
    hist = prompt + cont[:1]
    pos = 1
    mine = {"calls": 0, "nonempty": 0, "tok_gen": 0, "tok_acc": 0, "drafts_acc": 0}
    while pos < len(cont):
        d = draft1(spec, seq_id, hist, n_max)
        mine["calls"] += 1
        acc = 0
        for i, t in enumerate(d.tolist()):
            if pos + i < len(cont) and cont[pos + i] == t:
                acc += 1
            else:
                break
        if len(d):
            mine["nonempty"] += 1
            mine["tok_gen"] += len(d)
            mine["tok_acc"] += acc
            mine["drafts_acc"] += acc > 0
            spec.accept(seq_id, len(d), acc, True)
        step = acc + 1
        hist += cont[pos : pos + step]
        pos += step
    spec.end(seq_id)
    return mine


def check_stats(spec: Speculator, mine: dict) -> None:
    st = spec.stats
    assert st.calls == mine["calls"]
    assert st.drafts_generated == mine["nonempty"]
    assert st.drafts_chosen == mine["nonempty"]
    assert st.tokens_generated == mine["tok_gen"]
    assert st.tokens_accepted == mine["tok_acc"]
    assert st.drafts_accepted == mine["drafts_acc"]
    if mine["tok_gen"]:
        assert st.drafted_per_pos[0] == mine["nonempty"]
        assert sum(st.accepted_per_pos) == mine["tok_acc"]
    assert st.time_draft_s > 0


def memory_growth(run) -> int:
    """Bytes of Python memory that five more calls of `run()` keep beyond one warm call: 0 where `run` drops all
    it makes (tracemalloc also sees the objects a C extension allocates)."""
    import gc
    import tracemalloc

    run()
    gc.collect()
    tracemalloc.start()
    try:
        run()
        gc.collect()
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(5):
            run()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
