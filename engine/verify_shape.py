"""Shape-stable verifies: the target's batch shape kept in a few buckets (EngineConfig.verify_shape).

A GPU backend replays a captured graph only while the graph's shape stays the
same: llama.cpp reuses a built graph when the ubatch matches (n_tokens,
n_seq_tokens, n_seqs, the sequences themselves with one KV stream per slot)
and so does n_outputs (llm_graph_params::allow_reuse), and its CUDA graphs are
re-captured when any node's shape changes. A loop that alternates 1-row
decodes with verifies of 3, 7, 12 rows keeps invalidating them. With
bucketing, every decoding sequence's verify of a decode-only round is padded
to the same row count: the smallest bucket that holds the round's longest
verify (1 + draft). The same count for every sequence, not a bucket each,
because the shape is the whole batch's: per-sequence buckets would make the
batch size a sum of buckets (4 slots x 5 buckets: dozens of shapes), and with
a KV stream per slot llama.cpp splits unequal sequences into several ubatches
(split_equal). So a decode-only round holds n_decoding x bucket rows, all of
them with logits (the output rows are part of the shape too).

Pad rows never reach the output: verification sees only the real draft, and
their KV cells go with the rejected tail (TargetRunner.step). Drafts are cut
to the largest bucket - 1 (max_draft), so every decode-only round's shape is
in the set; prompt-chunk rounds are not padded (their size varies with the
prompt anyway). A round whose padded batch would not fit n_batch (or a
sequence's context) is left unpadded: correct, one shape miss.

On CPU a row costs nearly its share of a decode, so padding costs time; the
cost policy prices the padded shape (batch_rows), which makes drafting up to
the bucket free, so the policy still sends a draft only where its price model
expects a gain under the option. (A model speculator's draft is priced before it is made by the
unpadded curve, policy.pricing.Pricing; the final cut of every draft uses the padded one.)
"""

from __future__ import annotations

from collections.abc import Sequence

#: default buckets: rows per decoding sequence (1 = a plain decode, no draft)
DEFAULT_BUCKETS = (1, 2, 4, 8, 16)


def bucket_of(rows: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding `rows` rows, or None if none does.

    >>> [bucket_of(n, (1, 2, 4, 8)) for n in (1, 3, 4, 5, 9)]
    [1, 4, 4, 8, None]
    """
    fits = [b for b in buckets if b >= rows]
    return min(fits) if fits else None


def max_draft(buckets: Sequence[int]) -> int:
    """The longest draft a bucketed verify holds: the largest bucket less the sequence's last token.

    >>> max_draft((1, 2, 4, 8, 16))
    15
    """
    return max(buckets) - 1


def padded_rows(rows: Sequence[int], buckets: Sequence[int], limit: int | None = None) -> list[int]:
    """Rows each decoding sequence's verify takes in a decode-only round whose real verifies take `rows`
    (1 + draft each): all the same bucket, the smallest that holds the longest. Unpadded (as is) if no bucket
    holds it, or if the padded batch would exceed `limit` rows (n_batch: one decode).

    >>> padded_rows([1, 3, 1, 2], (1, 2, 4, 8))      # the longest verify, 3 rows, sets the round's bucket
    [4, 4, 4, 4]
    >>> padded_rows([1, 1], (1, 2, 4, 8))            # a round without drafts: 1 row each
    [1, 1]
    >>> padded_rows([1], (4, 8))                     # buckets without 1: plain decodes are padded too
    [4]
    >>> padded_rows([9, 1], (1, 2, 4, 8)), padded_rows([5, 1], (1, 2, 4, 8), limit=12)   # no bucket / no room
    ([9, 1], [5, 1])
    """
    if not rows:
        return []
    b = bucket_of(max(rows), buckets)
    if b is None or (limit is not None and b * len(rows) > limit):
        return list(rows)
    return [b] * len(rows)


def batch_rows(draft_lengths: Sequence[int], buckets: Sequence[int] | None, n_prompt: int = 0,
               limit: int | None = None) -> int:
    """Rows of a round's target batch: one per decoding sequence plus its draft (`draft_lengths`), padded
    when `buckets` is set and the round holds no prompt rows, plus `n_prompt` prompt rows. What the cost
    policy prices: with buckets, a longer draft within the round's bucket adds no row.

    >>> batch_rows([2, 0, 0], None), batch_rows([2, 0, 0], (1, 2, 4, 8))
    (5, 12)
    >>> batch_rows([3, 0, 0], (1, 2, 4, 8)), batch_rows([2, 0, 0], (1, 2, 4, 8), n_prompt=40)
    (12, 45)
    """
    real = [1 + k for k in draft_lengths]
    if buckets is None or n_prompt:
        return n_prompt + sum(real)
    return sum(padded_rows(real, buckets, limit))
