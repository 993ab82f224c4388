"""The prefix cache's parts without a model: the idle slots' record (engine/prompt_cache.py), where a prompt starts
from (prefix_plan.py), the shared pool's cell count (cell_ledger.py), the host tier's index (host_tier.py), the
admission over a recording target (prefix_cache.py) and the order of prompt chunks (scheduler.prompt_chunks). The
engine's use of them on a real model: tests/integration/test_prompt_cache.py."""

from __future__ import annotations

import doctest

import numpy as np
import pytest

from specray.engine import cell_ledger, host_tier, prefix_plan, prompt_cache, scheduler
from specray.engine.cell_ledger import CellLedger
from specray.engine.host_tier import HostTier
from specray.engine.prefix_cache import MIN_WAIT_TOKENS, PrefixCache
from specray.engine.prefix_plan import PrefixPlan
from specray.engine.prompt_cache import PromptCache
from specray.engine.request import GenerationRequest, Sequence, SeqState
from specray.engine.scheduler import prompt_chunks


@pytest.mark.parametrize("module", [prompt_cache, prefix_plan, cell_ledger, host_tier, scheduler])
def test_doctests(module):
    assert doctest.testmod(module).failed == 0


def test_eviction_is_least_recently_used_and_spares_the_chosen_slots():
    pc = PromptCache()
    for slot, n in ((0, 100), (1, 50), (2, 80)):
        pc.keep(slot, np.arange(n, dtype=np.int32))
    freed: list[int] = []
    # 1 and 2 hold 130 > 100: the older, 1, goes (0 is older but spared)
    pc.evict(lambda: pc.idle_cells(0) <= 100, lambda s, c: freed.append(s), but=(0,))
    assert freed == [1] and sorted(pc.slots) == [0, 2] and pc.idle_cells() == 180 and pc.evicted == 1
    pc.evict(lambda: False, lambda s, c: freed.append(s), counted=False)  # a forced clear: not evictions
    assert freed == [1, 0, 2] and pc.idle_cells() == 0 and pc.evicted == 1


def test_the_ledger_counts_shared_cells_once_until_the_last_holder_lets_go():
    led = CellLedger()
    led.own(0, 0, 500)
    led.share(1, 0, 400)
    led.own(1, 400, 450)
    led.share(2, 1, 420)  # a copy of a copy: 400 of slot 0's run and 20 of slot 1's
    assert led.cells() == 550 and led.held(2) == 420
    led.clear(0)
    led.clear(1)
    assert led.cells() == 420  # slot 2 still sees them all
    led.clip(2, 100)
    assert led.cells() == 100 and led.cells(without=(2,)) == 0


def test_the_host_tier_keeps_to_its_budget_and_prices_restores_by_what_it_measured():
    tier = HostTier(budget_bytes=1000)
    a = tier.new_key()
    tier.add(a, np.arange(100), 0)
    tier.resize(a, 400)  # the target reports the real size after the round
    assert tier.bytes == 400 and tier.bytes_per_token() == 4
    b = tier.new_key()
    tier.add(b, np.arange(1000, 1200), 800)
    assert tier.over_budget() == [a]  # the least recently used goes first
    assert tier.covers(np.arange(50)) and not tier.covers(np.arange(101))
    first_guess = tier.restore_price(b)
    tier.restored(b, 0.004, True)  # 800 bytes in 4 ms: slower than the first guess
    assert tier.restore_price(b) == pytest.approx(0.004) and tier.restore_price(b) > first_guess
    tier.restored(b, 0.0, False)
    assert tier.to_dict()["restores"] == 1 and tier.to_dict()["failed_restores"] == 1


def test_the_buffers_the_target_keeps_count_against_the_budget():
    """Dropped entries' buffers the target keeps for its next saves (StepOutput.host_kept) take budget: entries go
    until both fit, and /v1/stats shows them."""
    tier = HostTier(budget_bytes=1000)
    keys = [tier.new_key() for _ in range(3)]
    for i, k in enumerate(keys):
        tier.add(k, np.arange(100 * i, 100 * i + 50), 300)
    assert tier.over_budget() == []  # 900 bytes
    tier.kept_bytes = 300
    assert tier.over_budget() == [keys[0]] and tier.to_dict()["kept_bytes"] == 300
    tier.kept_bytes = 1000
    assert tier.over_budget() == keys  # the kept buffers alone fill it


def test_round_done_takes_the_targets_kept_bytes_before_it_keeps_to_the_budget():
    target = RecordingTarget()
    cache = PrefixCache(target, True, None, 1000, lambda n: 1.0)
    keys = [cache.host.new_key() for _ in range(2)]
    for i, k in enumerate(keys):
        cache.host.add(k, np.arange(100 * i, 100 * i + 80), 400)
    cache.round_done({}, [], kept=400)
    assert cache.host.kept_bytes == 400 and list(cache.host.entries) == [keys[1]]
    assert target.ops[-1] == ("drop", (keys[0],))


def test_a_prompt_that_shares_less_than_the_host_entry_restores_only_where_it_pays():
    idle = {0: prompt_cache.Cached(np.arange(10), 1)}
    tier = HostTier(10**6)
    tier.add(tier.new_key(), np.arange(400), 1000)
    holders = prefix_plan.Holders(idle, {}, {}, tier.best)
    prompt = np.arange(500)
    # the conversation's own slot (it continues its 10 tokens), its 400-token history restored into it
    assert prefix_plan.plan_prefix(prompt, [0, 1], holders, True) == PrefixPlan(0, 400, restore=0)
    # a restore dearer than the prefill it saves: the slot's own 10 tokens only
    dear = prefix_plan.plan_prefix(prompt, [0, 1], holders, True, worth_restore=lambda key, gain: False)
    assert dear == PrefixPlan(0, 10)



class RecordingTarget:
    """The target's slot operations, in order."""

    def __init__(self) -> None:
        self.ops: list[tuple] = []

    def start(self, seq_id, params, prompt, n_keep=0, copy_from=None, restore=None, share=None):
        self.ops.append(("start", seq_id, n_keep, copy_from, restore))

    def release(self, seq_id, keep=0):
        self.ops.append(("release", seq_id, keep))

    def stash(self, seq_id, key):
        self.ops.append(("stash", seq_id, key))

    def drop_stash(self, keys):
        self.ops.append(("drop", tuple(keys)))


def _seq(tokens, reserve=None) -> Sequence:
    prompt = np.asarray(tokens, dtype=np.int32)
    return Sequence(GenerationRequest(prompt, max_tokens=8), (), 0, reserve or len(prompt) + 8)


def _run(cache: PrefixCache, seq: Sequence, free: list[int], active: dict) -> PrefixPlan:
    plan = cache.plan(seq, free, active, True, lambda q: False)
    if plan.slot is not None:
        assert cache.admit(seq, plan, True, len(active))
        free.remove(plan.slot)
        seq.slot, seq.state = plan.slot, SeqState.PREFILL
        active[plan.slot] = seq
    return plan


def test_admission_copies_a_running_prefix_saves_evicted_caches_and_restores_them():
    target = RecordingTarget()
    cache = PrefixCache(target, True, shared_cells=3000, host_bytes=10**9, prefill_seconds=lambda n: n * 1e-3)
    system = list(range(1000, 1000 + MIN_WAIT_TOKENS + 100))
    free, active = [1, 0], {}
    a = _seq(system + [1, 2, 3])
    assert _run(cache, a, free, active) == PrefixPlan(0)
    b = _seq(system + [7, 8])
    assert _run(cache, b, free, active).wait == 0  # a is still prefilling the system prompt: b waits
    a.n_prefilled = a.n_past = len(a.req.prompt_tokens)  # a prefilled it; b copies it from the running a
    assert _run(cache, b, free, active) == PrefixPlan(1, len(system), copy_from=0)
    assert target.ops[-1] == ("start", 1, len(system), 0, None)
    assert cache.stats()["copies_from_running"] == 1
    assert cache.ledger.cells() == a.reserve + b.reserve - len(system)  # the system prompt counted once
    # a finishes: its cells stay as slot 0's idle cache; c, another conversation, takes slot 0 (none empty),
    # which saves a's cache to host memory first
    del active[0]
    a.state = SeqState.FINISHED
    target.release(0, cache.finished(a))
    free.append(0)
    c = _seq(list(range(5000, 5400)))
    assert _run(cache, c, free, active) == PrefixPlan(0)
    assert target.ops[-2:] == [("stash", 0, 0), ("start", 0, 0, None, None)]
    cache.round_done({0: 40_000}, [])
    assert cache.host.to_dict()["entries"] == 1 and cache.host.bytes == 40_000
    # a's next turn: its history is in host memory only; restoring it is cheaper than prefilling it
    del active[0]
    c.state = SeqState.FINISHED
    target.release(0, cache.finished(c))
    free.append(0)
    a2 = _seq(list(a.kv_prefix()) + [9, 9, 9])
    plan = _run(cache, a2, free, active)
    assert plan.restore == 0 and plan.reuse == len(a.kv_prefix())
    assert target.ops[-1][-1] == 0  # start(..., restore=0)
    cache.forget()
    assert ("drop", (0,)) in target.ops and cache.host.to_dict()["entries"] == 0


def test_short_prompts_go_first_and_the_oldest_still_progresses():
    # a 1500-token prompt (the oldest) and a 60-token continuation, 128 prompt rows a round beside decoding
    assert prompt_chunks([1500, 60], room=500, chunk=256, budget=128, oldest=0, floor=32) == [68, 60]
    assert prompt_chunks([1500], room=500, chunk=256, budget=128, oldest=0, floor=32) == [128]
    assert prompt_chunks([1500, 60], room=500, chunk=256, oldest=0, floor=32) == [256, 60]  # nothing decodes


@pytest.mark.parametrize("argv, message", [
    (["--prefill-budget", "5"], "--prefill-budget must be >= 16"),
    (["--cache-ram", "-1"], "--cache-ram must be >= 0"),
    (["--queue-max-wait", "0"], "--queue-max-wait must be > 0 seconds"),
    (["--queue-order", "lifo"], "--queue-order: invalid choice"),
])
def test_serve_names_a_bad_prefix_cache_flag(argv, message, capsys):
    from specray.cli import main as cli

    with pytest.raises(SystemExit):
        cli.main(["serve", *argv])
    assert message in capsys.readouterr().err


def test_serve_flags_reach_the_engine_config():
    from specray.cli import main as cli
    from specray.cli.serve import flag_overrides

    args = cli.build_parser().parse_args(["serve", "--cache-ram", "512", "--prefill-budget", "128",
                                          "--queue-order", "arrival", "--queue-max-wait", "5"])
    assert ({"cache_ram": 512, "prefill_budget": 128, "queue_order": "arrival", "queue_max_wait_s": 5.0}.items()
            <= flag_overrides(args)["engine"].items())
