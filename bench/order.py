"""The order in which `specray bench` runs its configurations on one group of prompts, and which `none`
runs each configuration is measured against. Pure, so the CLI can offer the choices without loading
llama.cpp."""

from __future__ import annotations

ORDERS = ("lockstep", "sandwich", "alternate")


def run_order(configs: list[str], order: str, reverse: bool) -> list[str]:
    """The order in which one group of prompts runs its configurations, one after another (`lockstep`
    runs them all at once, a round each in turn: see bench.py; this is then the turn order).
    `alternate`: each configuration once. `sandwich`: `none` before and after every other configuration,
    so each is measured against its own neighbours and a drift in machine speed slower than one run
    cancels (a shared machine's speed drifts in waves of tens of seconds).
    `reverse` flips the order (the bench flips it every other group, category and pass: reversed_turn).

    >>> run_order(["none", "a", "b"], "alternate", reverse=False)
    ['none', 'a', 'b']
    >>> run_order(["none", "a", "b"], "sandwich", reverse=True)
    ['none', 'b', 'none', 'a', 'none']
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    seq = configs[::-1] if reverse else list(configs)
    if order != "sandwich":
        return seq
    out = ["none"]
    for c in seq:
        if c != "none":
            out += [c, "none"]
    return out


def reversed_turn(rep: int, category: int, group: int) -> bool:
    """Whether a group of prompts runs its configurations in reverse order: every other pass, category
    and group, so each configuration's place in the turn order evens out even in a single pass that runs
    each category as one group (several slots). A fixed place in the turn order can bias a lockstep round
    against the configuration that holds it.

    >>> [reversed_turn(0, c, 0) for c in range(4)]
    [False, True, False, True]
    >>> [reversed_turn(1, 0, g) for g in range(3)]
    [True, False, True]
    """
    return (rep + category + group) % 2 == 1


def baseline_positions(sequence: list[str], i: int) -> list[int]:
    """Positions of the `none` runs that the run at position `i` is measured against: with `sandwich`
    its two neighbours; otherwise the group's one `none` run; for a `none` run, itself.

    >>> baseline_positions(["none", "a", "none", "b", "none"], 3)
    [2, 4]
    >>> baseline_positions(["b", "a", "none"], 0)
    [2]
    >>> baseline_positions(["none", "a", "none"], 2)
    [2]
    """
    if sequence[i] == "none":
        return [i]
    near = [j for j in (i - 1, i + 1) if 0 <= j < len(sequence) and sequence[j] == "none"]
    return near or [sequence.index("none")]
