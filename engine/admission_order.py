"""The order in which queued sequences are offered free slots when more wait than there are slots.

Under overload an agent's next turn would queue behind new conversations. Its history is cached, so it needs
only a few prompt rows before its first token, while a new conversation needs its whole prompt. SGLang's
scheduler orders the waiting queue by longest prefix match for the same reason. Here the key is the prompt
rows left after the longest cached prefix, and an age bound keeps the order fair: a sequence that has
waited `max_wait_s` goes ahead of any that has not, so no prompt waits forever behind shorter ones.
"""

from __future__ import annotations

from collections.abc import Sequence

#: queued sequences the order looks at, from the head (the rest keep their arrival order behind them)
ORDER_WINDOW = 32


def admission_order(rows_left: Sequence[int], waited_s: Sequence[float], max_wait_s: float) -> list[int]:
    """Indices of queued sequences (given in arrival order) in the order they are offered slots: first those
    that waited `max_wait_s` or more, in arrival order; then the rest by fewest prompt rows left to prefill
    (`rows_left`: prompt length minus the longest prefix cached anywhere), ties in arrival order.

    >>> admission_order([1600, 30, 90], [4.0, 1.0, 2.0], max_wait_s=10.0)  # the next turns first
    [1, 2, 0]
    >>> admission_order([1600, 30, 90], [12.0, 1.0, 2.0], max_wait_s=10.0)  # the new one waited long enough
    [0, 1, 2]
    """
    overdue = [i for i in range(len(rows_left)) if waited_s[i] >= max_wait_s]
    rest = sorted((i for i in range(len(rows_left)) if waited_s[i] < max_wait_s), key=lambda i: (rows_left[i], i))
    return overdue + rest
