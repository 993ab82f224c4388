"""A chain changed while sequences run (Chain.reconfigure, Scheduler.reconfigure_chain): an added speculator
drafts from the next round, a rebuilt one keeps its counters and resumes the running sequences, a refused
change leaves everything as it was, and a speculator that fails while drafting is named, disabled and counted
once instead of losing every draft of every round. No model: a stand-in target that continues a cycle."""

from __future__ import annotations

import numpy as np
import pytest

from specray.engine.chain import Chain
from specray.engine.policy import DraftPolicy, SeqDraftRequest
from specray.engine.policy.estimates import CONTEXT_OWN_BUCKETS
from specray.engine.config import ChainConfig, EngineConfig
from specray.engine.request import GenerationRequest
from specray.engine.scheduler import Scheduler
from specray.engine.speculator import DraftRequest, Speculator
from specray.engine.speculators.draft_base import ModelSpeculator
from specray.engine.speculators.registry import speculator_factory
from specray.engine.target import StepOutput, StepResult


class Fixed(Speculator):
    """Drafts `tokens` (params {"tokens": [...]}); records begin/end calls; params {"bad": True} are refused the
    way the registry refuses invalid parameters."""

    def __init__(self, params: dict | None) -> None:
        super().__init__()
        params = params or {}
        if params.get("bad"):
            raise ValueError("invalid parameters: bad")
        self.params = params
        self.tokens = np.array(params.get("tokens", [7, 8]), dtype=np.int32)
        self.begun: dict[int, list[int]] = {}
        self.ended: list[int] = []

    def _begin(self, seq_id: int, prompt: np.ndarray) -> None:
        if self.params.get("fail_begin"):
            raise RuntimeError("cannot begin")
        self.begun[seq_id] = prompt.tolist()

    def _end(self, seq_id: int) -> None:
        self.ended.append(seq_id)

    def _draft_one(self, req: DraftRequest) -> np.ndarray:
        return self.tokens


class Model(ModelSpeculator, Fixed):
    """A model speculator (its parameters are start-up config)."""

    def draft_seconds(self, n_seqs: int, n_steps: int) -> float:
        return 0.0


def factory(name: str, params: dict | None) -> Speculator:
    if name.startswith("model"):
        return Model(params)
    if name.startswith("fixed"):
        return Fixed(params)
    raise ValueError(f"unknown speculator {name!r}")


def chain_of(names: list[str], params: dict | None = None, policy: str = "first") -> Chain:
    return Chain(ChainConfig(speculators=names, params=params or {}, policy=policy, n_max=8), factory)


HISTORY = np.array([1, 2, 3, 4], np.int32)


def propose1(policy: DraftPolicy, names: tuple[str, ...], seq_id: int = 0):
    [prop] = policy.propose([SeqDraftRequest(seq_id, names, HISTORY, 8)])
    return prop


def internals(chain: Chain) -> tuple:
    """Every piece of chain state a reconfiguration may replace (by identity)."""
    return (chain.config, dict(chain.instances))


@pytest.mark.parametrize("policy", ["first", "expected", "cost"])
def test_an_added_speculator_drafts_on_the_next_propose(policy):
    chain = chain_of(["fixed_a"], {"fixed_a": {"tokens": []}}, policy)  # `fixed_a` never drafts
    drafts = DraftPolicy(chain)
    new = chain.config.model_copy(update={"speculators": ["fixed_a", "fixed_b"]})
    change = chain.reconfigure(new, {})
    drafts.chain_changed(change)
    assert change.built == ["fixed_b"] and change.rebuilt == [] and chain.config is new
    # its first draft is estimated like any other
    prop = propose1(drafts, ("fixed_a", "fixed_b"))
    assert prop.speculator == "fixed_b" and prop.tokens.tolist() == [7, 8] and len(prop.prefix_probs) == 2
    drafts.accept(prop, 2, 2, np.array([7, 8, 9], np.int32))
    assert chain.instances["fixed_b"].stats.tokens_accepted == 2


def test_a_rebuilt_speculator_keeps_its_counters_and_resumes_running_sequences():
    chain = chain_of(["fixed_a", "fixed_c"], {"fixed_a": {"tokens": [7, 8]}})
    policy = DraftPolicy(chain)
    chain.begin(0, ("fixed_a",), HISTORY[:2])
    chain.begin(1, ("fixed_c",), HISTORY[:2])
    prop = propose1(policy, ("fixed_a",))
    policy.accept(prop, 2, 1, np.array([7, 5], np.int32))
    old, untouched = chain.instances["fixed_a"], chain.instances["fixed_c"]
    old_tracker, old_cal = policy.estimates.tracker("fixed_a"), policy.estimates.calibration("fixed_a")
    kept = policy.estimates.tracker("fixed_c")
    counted = (old.stats.calls, old.stats.tokens_generated, old.stats.tokens_accepted)
    assert counted == (1, 2, 1)

    new = chain.config.model_copy(update={"params": {"fixed_a": {"tokens": [9]}}})
    change = chain.reconfigure(new, {0: (("fixed_a",), HISTORY), 1: (("fixed_c",), HISTORY)})
    policy.chain_changed(change)
    assert change.rebuilt == ["fixed_a"] and change.built == [] and change.resumed == 1
    rebuilt = chain.instances["fixed_a"]
    assert rebuilt is not old and rebuilt.tokens.tolist() == [9]  # the new parameters
    assert rebuilt.stats is old.stats  # the same counters object: /v1/stats and metrics stay monotonic
    assert (rebuilt.stats.calls, rebuilt.stats.tokens_generated, rebuilt.stats.tokens_accepted) == counted
    assert rebuilt.begun == {0: HISTORY.tolist()}  # resumed on the whole history, not the prompt
    assert old.ended == [0]
    # estimates start afresh (they measured the old parameters); the other speculator is left alone
    assert policy.estimates.tracker("fixed_a") is not old_tracker
    assert policy.estimates.calibration("fixed_a") is not old_cal
    assert policy.estimates.tracker("fixed_c") is kept
    assert chain.instances["fixed_c"] is untouched and untouched.begun == {1: [1, 2]}
    prop = propose1(policy, ("fixed_a",))
    assert prop.tokens.tolist() == [9] and rebuilt.stats.calls == counted[0] + 1


@pytest.mark.parametrize("new, match", [
    (ChainConfig(speculators=["fixed_a", "warp"]), "warp"),  # unknown name
    (ChainConfig(speculators=["fixed_a", "fixed_b"], params={"fixed_b": {"bad": True}}), "bad"),
    (ChainConfig(speculators=["fixed_a"], params={"fixed_a": {"bad": True}}), "bad"),
    (ChainConfig(speculators=["fixed_a", "model"], params={"model": {"tokens": [1]}}), "model speculators"),
    (ChainConfig(speculators=["fixed_a"], params={"fixed_a": {"fail_begin": True}}), "resume sequence 0"),
])
def test_a_refused_change_leaves_the_chain_untouched(new, match):
    chain = chain_of(["fixed_a", "model"])
    chain.begin(0, ("fixed_a",), HISTORY)
    before = internals(chain)
    with pytest.raises(ValueError, match=match):
        chain.reconfigure(new, {0: (("fixed_a",), HISTORY)})
    after = internals(chain)
    assert after[0] is before[0]
    for b, a in zip(before[1:], after[1:]):
        assert a.keys() == b.keys() and all(a[k] is b[k] for k in b)
    assert chain.instances["fixed_a"].ended == []  # the running sequence still has its speculator


def test_estimates_are_made_on_first_use_with_every_context_bucket():
    chain = chain_of(["fixed_a"])
    policy = DraftPolicy(chain)
    chain.validate(("fixed_x",))  # built for a per-request chain, outside the configured one
    change = chain.reconfigure(ChainConfig(speculators=["fixed_b", "fixed_a"],
                                           params={"fixed_x": {"tokens": [3]}, "fixed_a": {"tokens": [4]}}))
    policy.chain_changed(change)
    assert set(chain.instances) == {"fixed_a", "fixed_b", "fixed_x"}
    assert chain.instances["fixed_x"].tokens.tolist() == [3]  # not in the chain, still rebuilt
    [prop] = policy.propose([SeqDraftRequest(0, ("fixed_x", "fixed_a"), HISTORY, 8)])
    assert set(prop.drafts) == {"fixed_x", "fixed_a"} and len(prop.prefix_probs) == 1
    # a tracker of another size would merge context buckets
    assert {policy.estimates.tracker(n).n_contexts for n in chain.instances} == {3 * CONTEXT_OWN_BUCKETS}


def test_propose_names_the_speculator_that_failed():
    chain = chain_of(["fixed_a", "fixed_b"], {"fixed_a": {"tokens": []}}, policy="expected")

    def broken(req):
        raise RuntimeError("table corrupted")

    chain.instances["fixed_b"]._draft_one = broken
    with pytest.raises(RuntimeError, match="table corrupted") as info:
        propose1(DraftPolicy(chain), ("fixed_a", "fixed_b"))
    assert info.value.speculator == "fixed_b"


# ---- the scheduler, on a stand-in target -------------------------------------------------------------
CYCLE = [11, 12, 13, 14, 15, 16, 17]  # the "model" continues this cycle, greedily and forever


def nxt(t: int) -> int:
    return CYCLE[(CYCLE.index(int(t)) + 1) % len(CYCLE)]


class CycleTarget:
    """Verifies drafts against the cycle: accepts the draft prefix that continues it, then emits one token."""

    def start(self, seq_id, params, prompt, n_keep=0, copy_from=None, restore=None, share=None):
        pass

    def release(self, seq_id, keep=False):
        pass

    def step(self, items):
        results = []
        for it in items:
            if not it.sample:
                results.append(StepResult(it.seq_id, np.zeros(0, np.int32)))
                continue
            last, draft = int(it.tokens[it.n_commit - 1]), it.tokens[it.n_commit:].tolist()
            out = []
            for d in draft:
                if d != nxt(last):
                    break
                out.append(d)
                last = d
            results.append(StepResult(it.seq_id, np.array(out + [nxt(last)], np.int32), len(out)))
        return StepOutput(results, 0.0, sum(len(it.tokens) for it in items), 1)


class Tok:
    def token_to_piece(self, token, special=False):
        return f"{token},".encode()

    def is_eog(self, token):
        return False


REGISTRY = speculator_factory()  # the real model-free speculators


def scheduler(chain: ChainConfig, factory=REGISTRY) -> Scheduler:
    cfg = EngineConfig(slots=2, calibrate=False, chain=chain)
    return Scheduler(cfg, CycleTarget(), Tok(), Chain(chain, factory), n_ctx=1024)


PROMPT = np.array(CYCLE * 4 + CYCLE[:3], np.int32)
SUFFIX = {"min_match": 1, "p_min": 0.01}


def expected_text(n: int) -> str:
    t, out = int(PROMPT[-1]), []
    for _ in range(n):
        t = nxt(t)
        out.append(f"{t},")
    return "".join(out)


def test_scheduler_adds_a_speculator_and_new_requests_draft_with_it():
    # ngram_simple keyed on 1000 tokens never drafts here: before the change nothing is drafted
    slow = {"ngram_simple": {"size_n": 1000}}
    s = scheduler(ChainConfig(speculators=["ngram_simple"], params=slow, policy="first", n_max=8))
    running = s.submit(GenerationRequest(PROMPT, max_tokens=40, ignore_eos=True))
    for _ in range(3):
        s.step()
    assert running.spec_total.drafts == 0
    new = s.config.chain.model_copy(update={"speculators": ["ngram_simple", "suffix"], "n_max": 6,
                                            "params": slow | {"suffix": SUFFIX}})
    result = s.reconfigure_chain(new)
    assert result == {"chain": "ngram_simple,suffix", "rebuilt": [], "added": ["suffix"], "resumed_sequences": 0}
    assert s.config.chain is new  # admission follows: the new default chain and n_max
    later = s.submit(GenerationRequest(PROMPT, max_tokens=40, ignore_eos=True))
    assert later.chain == ("ngram_simple", "suffix") and later.n_max == 6
    assert running.chain == ("ngram_simple",)  # admitted before the change: keeps its names
    while s.has_work():
        s.step()
    assert later.text == running.text == expected_text(40)  # every draft is verified: lossless
    suffix = s.chain.stats()["suffix"]
    assert suffix.tokens_accepted > 0 and later.spec_by_name["suffix"].accepted == suffix.tokens_accepted
    assert s.stats.speculator_failures == 0 and not s.disabled_speculators


def test_scheduler_rebuilds_a_speculator_under_a_running_sequence_which_resumes_with_it():
    s = scheduler(ChainConfig(speculators=["suffix"], params={"suffix": SUFFIX}, policy="first", n_max=8))
    seq = s.submit(GenerationRequest(PROMPT, max_tokens=60, ignore_eos=True))
    for _ in range(4):
        s.step()
    old = s.chain.instances["suffix"]
    before = old.stats.tokens_accepted
    long_before = sum(old.stats.drafted_per_pos[2:])  # drafts of 3+ tokens
    assert before > 0 and long_before > 0
    s.disabled_speculators.add("suffix")  # as if it had failed: new parameters give it another chance
    new = s.config.chain.model_copy(update={"params": {"suffix": SUFFIX | {"max_draft": 2}}})
    result = s.reconfigure_chain(new)
    assert result == {"chain": "suffix", "rebuilt": ["suffix"], "added": [], "resumed_sequences": 1}
    assert not s.disabled_speculators
    while s.has_work():
        s.step()
    assert seq.text == expected_text(60)
    rebuilt = s.chain.instances["suffix"]
    assert rebuilt is not old and rebuilt.stats is old.stats
    assert rebuilt.stats.tokens_accepted > before  # the resumed sequence drafted with the rebuilt instance
    assert sum(rebuilt.stats.drafted_per_pos[2:]) == long_before  # max_draft 2: no draft of 3+ since


def test_a_speculator_that_fails_while_drafting_is_disabled_once_and_the_chain_goes_on():
    fails = {"n": 0}

    def broken(req):
        fails["n"] += 1
        raise RuntimeError("table corrupted")

    def with_broken(name, params):
        spec = REGISTRY(name, params)
        if name == "ngram_simple":
            spec._draft_one = broken
        return spec

    s = scheduler(ChainConfig(speculators=["ngram_simple", "suffix"], params={"suffix": SUFFIX}, policy="first",
                              n_max=8), with_broken)
    seq = s.submit(GenerationRequest(PROMPT, max_tokens=40, ignore_eos=True))
    while s.has_work():
        s.step()
    assert seq.text == expected_text(40)
    # one failure, blamed on ngram_simple; suffix drafts in every round after it
    assert fails["n"] == 1 and s.stats.speculator_failures == 1
    assert s.disabled_speculators == {"ngram_simple"}
    assert seq.spec_by_name["suffix"].accepted > 0


class Hidden(Fixed):
    """A speculator that reads the target's hidden rows (as mtp and eagle3 do: a `take_hidden` method)."""

    def take_hidden(self, record) -> None:
        pass


def test_needs_hidden_follows_a_speculator_rebuilt_into_one_that_reads_hidden_rows():
    # Chain.needs_hidden is memoised per chain tuple: a reconfiguration that installs an instance reading hidden
    # rows under a name asked before must be seen, or the target would stop returning the rows it needs
    def hidden_factory(name: str, params: dict | None) -> Speculator:
        return Hidden(params) if (params or {}).get("hidden") else Fixed(params)

    chain = Chain(ChainConfig(speculators=["fixed"], policy="first", n_max=8), hidden_factory)
    assert chain.needs_hidden(("fixed",)) is False and chain.needs_hidden(("fixed",)) is False  # memoised
    chain.reconfigure(ChainConfig(speculators=["fixed"], params={"fixed": {"hidden": True}}, policy="first",
                                  n_max=8))
    assert isinstance(chain.instances["fixed"], Hidden) and chain.needs_hidden(("fixed",)) is True
    chain.reconfigure(ChainConfig(speculators=["fixed"], policy="first", n_max=8))
    assert chain.needs_hidden(("fixed",)) is False
