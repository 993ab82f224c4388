"""What a replica's stream yields, typed: `StreamStart`, then `StreamDelta`s, then `StreamEnd` or `StreamError`.

A stream that is refused (a bad request, a full queue, the target restarting) yields only a StreamError. The
items cross Serve handles pickled (split layout) or stay in the process (fused); a delta is made once per
round per stream on the hot path, hence `slots=True` (and, for it alone, not frozen).

>>> import pickle
>>> d = StreamDelta("Paris", t=1.5)
>>> pickle.loads(pickle.dumps(d)) == d, d.plain
(True, True)
>>> merge([StreamDelta("Par", t=1.0), StreamDelta("is", t=2.0)])
StreamDelta(text='Paris', t=1.0, logprobs=None, prompt_logprobs=None)
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ServeError


@dataclass(frozen=True, slots=True)
class StreamStart:
    """The request was admitted: its sequence id and prompt size (`truncated_prompt_tokens`: dropped from the
    left to fit the context, prompt_overflow: truncate)."""

    id: int
    prompt_tokens: int
    truncated_prompt_tokens: int = 0


# not frozen: a frozen dataclass's __init__ sets each field through object.__setattr__ (about four times the
# cost), and a delta is made per round per stream; nothing changes one after it is made
@dataclass(slots=True)
class StreamDelta:
    """New text. `t`: perf_counter when the round made it (the replica's emit stage is measured from it).
    `logprobs`: the tokens' entries (streams.logprob_entries) where the request asked for them; echo puts the
    prompt's in `prompt_logprobs` with the first delta."""

    text: str
    t: float = 0.0
    logprobs: list | None = None
    prompt_logprobs: list | None = None

    @property
    def plain(self) -> bool:
        """Text only: a socket sink may write it as it is."""
        return self.logprobs is None and self.prompt_logprobs is None


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """The sequence finished. `usage` and `speculative` as the response reports them; `timing`: ttft/itl/e2e
    (s) and the replica's stages (ms, metrics.replica_stages)."""

    finish_reason: str | None
    usage: dict
    speculative: dict
    timing: dict

    def summary(self) -> dict:
        """As a finished request's record (ab/stats.ArmRecords.add) reads it."""
        return {"finish_reason": self.finish_reason, "usage": self.usage, "speculative": self.speculative,
                "timing": self.timing}


@dataclass(frozen=True, slots=True)
class StreamError:
    """The stream ends in `error` (errors.py): instead of the start, or mid-stream."""

    error: ServeError


def merge(deltas: list[StreamDelta]) -> StreamDelta | None:
    """Deltas queued up between two reads as one: texts and entries joined (an empty list of entries is none),
    the oldest `t` kept; None when they say nothing (no text, no entries)."""
    if len(deltas) == 1:
        d = deltas[0]
        if d.logprobs == [] or d.prompt_logprobs == []:
            d = StreamDelta(d.text, d.t, d.logprobs or None, d.prompt_logprobs or None)
        return d if d.text or d.logprobs or d.prompt_logprobs else None
    text = "".join(d.text for d in deltas)
    lps = [e for d in deltas if d.logprobs for e in d.logprobs] or None
    plps = [e for d in deltas if d.prompt_logprobs for e in d.prompt_logprobs] or None
    return StreamDelta(text, deltas[0].t, lps, plps) if text or lps or plps else None
