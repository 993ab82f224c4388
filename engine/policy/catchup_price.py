"""What a lagging model speculator's catch-up is charged to the draft that pays it (cost policy).

A model speculator's cache takes the tokens committed since its last draft
only when it is asked again (hidden_base.py: queued pairs; draft.py: the
history's new tail), in one batched decode: rounds in which it is not asked
cost its model nothing. The draft that ends a lag pays for it: a sequence's
first draft catches up its whole prompt, one after 50 rounds unasked 50
tokens (a batched decode that can outlast several rounds). That is paid once if the
speculator then drafts every round (its cache stays a token or two behind),
so the cost policy spreads it over the rounds the sequence has left. A
speculator whose drafts are not sent is not asked the next round either: its
cache lags again and the next draft pays another catch-up. So the catch-up is
spread over the rounds it is expected to keep drafting: the rounds left times
its steady share, the share of its recent drafts that were sent.

With the share, a head whose drafts are rarely worth sending is asked once
on its fresh estimate, then only to explore (chain.py's `model_explore`
budget, which pays the whole catch-up); without it, a head whose estimate
stayed optimistic would be asked to catch up lag after lag.

>>> s = SteadyShare()
>>> s.share("eagle3")   # never measured: as if it kept drafting
1.0
>>> for _ in range(4): s.drafted("eagle3", sent=False)
>>> round(s.share("eagle3"), 2)   # one sent draft of prior against four not sent (discounted)
0.21
>>> round(catchup_charge(0.050, tokens_left=128, expected_tokens=0.2, share=1.0) * 1e3, 2)  # ms a round
0.47
>>> round(catchup_charge(0.050, tokens_left=128, expected_tokens=0.2, share=0.2) * 1e3, 2)
2.34
"""

from __future__ import annotations

#: weight of the prior: one sent draft (a speculator is trusted to keep drafting until its drafts say otherwise)
PRIOR_SENT = 1.0


class SteadyShare:
    """Per speculator: its drafts sent / drafts made, both discounted by `forget` per draft, with a prior of one
    sent draft (a few unsent drafts bring it down fast; ~1/(1-forget) drafts of memory)."""

    def __init__(self, forget: float = 0.97) -> None:
        self.forget = forget
        self._sent: dict[str, float] = {}
        self._made: dict[str, float] = {}

    def drafted(self, name: str, sent: bool) -> None:
        f = self.forget
        self._sent[name] = f * self._sent.get(name, 0.0) + float(sent)
        self._made[name] = f * self._made.get(name, 0.0) + 1.0

    def share(self, name: str) -> float:
        return (self._sent.get(name, 0.0) + PRIOR_SENT) / (self._made.get(name, 0.0) + PRIOR_SENT)


def catchup_charge(catchup_seconds: float, tokens_left: int | None, expected_tokens: float, share: float) -> float:
    """Seconds of a catch-up charged to this round's draft: spread over the rounds the sequence has left (its
    tokens left over the tokens a round emits with this speculator drafting) that the speculator is expected to
    keep drafting (`share`); all of it where that is a round or less."""
    rounds_left = (tokens_left or 64) / (1.0 + expected_tokens)
    return catchup_seconds / max(1.0, rounds_left * share)
