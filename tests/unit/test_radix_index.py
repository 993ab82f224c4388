"""The radix tree over held prefixes (engine/radix_index.py), held equal to the one-by-one scan it replaces on
random conversations: shared system prompts, next turns that extend earlier ones, removals in any order."""

from __future__ import annotations

import doctest

import numpy as np
import pytest

from specray.engine import radix_index
from specray.engine.host_tier import HostTier
from specray.engine.prompt_cache import common_prefix
from specray.engine.radix_index import RadixIndex


def test_doctests():
    assert doctest.testmod(radix_index).failed == 0


def scan_longest(held: dict[int, np.ndarray], prompt: np.ndarray) -> tuple[int | None, int]:
    """The reference: every key's shared prefix, the longest; ties to the fewest tokens, then the smallest key."""
    best = min(held, key=lambda k: (-common_prefix(held[k], prompt), len(held[k]), k), default=None)
    n = common_prefix(held[best], prompt) if best is not None else 0
    return (best, n) if n else (None, 0)


def conversations(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    """Token sequences as agents send them: one of three system prompts, then turns that often extend an
    earlier sequence, sometimes cut back, sometimes only one token long."""
    systems = [rng.integers(0, 50, size=int(rng.integers(1, 40))) for _ in range(3)]
    out: list[np.ndarray] = []
    for _ in range(n):
        r = rng.random()
        if out and r < 0.4:  # a next turn: an earlier sequence and more
            base = out[int(rng.integers(len(out)))]
            seq = np.concatenate([base, rng.integers(0, 50, size=int(rng.integers(0, 20)))])
        elif out and r < 0.55:  # a prefix of an earlier one
            base = out[int(rng.integers(len(out)))]
            seq = base[: int(rng.integers(0, len(base) + 1))]
        else:
            seq = np.concatenate([systems[int(rng.integers(3))], rng.integers(0, 50, size=int(rng.integers(0, 30)))])
        out.append(seq.astype(np.int32))
    return out


@pytest.mark.parametrize("seed", range(20))
def test_the_tree_answers_as_the_scan_does_through_inserts_and_removals(seed):
    rng = np.random.default_rng(seed)
    seqs = conversations(rng, 60)
    idx, held = RadixIndex(), {}
    for key, toks in enumerate(seqs):
        if held and rng.random() < 0.3:  # removals in any order, between inserts
            gone = int(rng.choice(list(held)))
            idx.remove(gone)
            del held[gone]
        if held and rng.random() < 0.1:  # a key saved again with other tokens
            again = int(rng.choice(list(held)))
            idx.insert(again, toks)
            held[again] = toks
        idx.insert(key, toks)
        held[key] = toks
        assert len(idx) == len(held)
        for probe in (toks, *rng.choice(np.array(seqs, dtype=object), 3), rng.integers(0, 50, size=25)):
            probe = np.asarray(probe, dtype=np.int32)
            assert idx.longest(probe) == scan_longest(held, probe)
            assert sorted(idx.prefixes_of(probe)) == sorted(
                k for k, t in held.items() if len(t) <= len(probe) and common_prefix(t, probe) == len(t))
            assert idx.covers(probe) == any(
                len(t) >= len(probe) and common_prefix(t, probe) == len(probe) for t in held.values())
        for k, t in held.items():
            assert np.array_equal(idx.tokens(k), t)
    for k in list(held):
        idx.remove(k)
    assert len(idx) == 0 and idx.nodes() == 1  # everything pruned back to the root


def test_a_shared_system_prompt_is_one_edge_below_which_every_conversation_hangs():
    system = np.arange(1000, 2600, dtype=np.int32)  # 1,600 tokens
    idx = RadixIndex()
    for k in range(50):
        idx.insert(k, np.concatenate([system, np.full(100, k, dtype=np.int32)]))
    assert idx.nodes() == 1 + 1 + 50  # the root, the system prompt, one leaf per conversation
    prompt = np.concatenate([system, np.full(100, 7, dtype=np.int32), [5, 6]])
    assert idx.longest(prompt) == (7, 1700)
    # a new conversation: the system prompt's 1,600 tokens, from the entry holding fewest (here all hold 1,700)
    assert idx.longest(np.concatenate([system, [99999]])) == (0, 1600)


def test_the_host_tier_caps_its_match_and_prefers_the_cheapest_restore():
    tier = HostTier(budget_bytes=10**6)
    long_key = tier.new_key()
    tier.add(long_key, np.arange(300), 3000)
    short_key = tier.new_key()
    tier.add(short_key, np.concatenate([np.arange(100), [7, 7]]), 1020)
    # both share the first 100 tokens of this prompt: the smaller entry restores those for less
    assert tier.best(np.concatenate([np.arange(100), [9]])) == (short_key, 100)
    assert tier.best(np.arange(400), limit=250) == (long_key, 250)
    assert tier.best(np.arange(400), limit=50) == (short_key, 50)
    assert tier.best(np.array([5000])) == (None, 0)
    # a save that holds all of the short entry's tokens and more supersedes it
    newer = tier.new_key()
    assert tier.add(newer, np.concatenate([np.arange(100), [7, 7, 8]]), 1030) == [short_key]
    assert short_key not in tier.index and tier.best(np.concatenate([np.arange(100), [7, 7]])) == (newer, 102)
    assert tier.clear() == [long_key, newer] and len(tier.index) == 0
