"""The chain: the speculators an engine drafts with, and their life with each sequence.

Speculator instances are shared by every sequence of an engine (their global
tables and trees learn across requests); each sequence names the chain it
uses (the engine default, or its own per-request subset). The chain builds
them, begins and ends them with sequences, mirrors what the target commits
into them, makes the look-ups it is asked for (`look_up`) and tells them how
their drafts did (`accept`). It decides nothing: which speculators are asked,
which draft is sent and how much of it is the draft policy's
(engine/policy/).

Live reconfiguration (`Chain.reconfigure`, e.g. an arm's `user_config` on a
running replica): speculators whose parameters changed are rebuilt with the
new ones; their counters carry over (so metrics and /v1/stats stay
monotonic). Running sequences on a rebuilt speculator go on with the new
instance, begun on their history so far (prompt + generated); output stays
lossless either way, since every draft is verified. New requests use the new
chain at once; queued ones keep the speculator names they were admitted with.
Model speculators (`draft`, ...) hold a model context: their parameters are
start-up config and cannot change.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from .config import ChainConfig
from .speculator import DraftRequest, Speculator, SpeculatorStats, blame
from .speculators.draft_base import ModelSpeculator

log = logging.getLogger("specray.chain")


@dataclass
class ChainChange:
    """What `Chain.reconfigure` did."""

    rebuilt: list[str]  # instances replaced because their parameters changed (counters carried over)
    built: list[str]  # instances that did not exist before (named by the new chain for the first time)
    resumed: int  # running sequences whose speculators were begun anew on their history


class Chain:
    """The speculators of an engine, by name, each built once from its parameters.

    >>> from specray.engine.speculators.registry import speculator_factory
    >>> config = ChainConfig(speculators=["ngram_simple"], params={"ngram_simple": {"size_n": 2, "size_m": 4}})
    >>> chain = Chain(config, speculator_factory())
    >>> history = np.array([0, 1, 2, 3, 4, 5, 6, 9, 1, 2], np.int32)
    >>> chain.begin(0, ("ngram_simple",), history)
    >>> [d.tolist() for d in chain.look_up("ngram_simple", [(0, history, 2)])]   # (seq_id, history, n_max)
    [[3, 4]]
    """

    def __init__(self, config: ChainConfig, factory: Callable[[str, dict | None], Speculator]) -> None:
        self.config = config
        self._factory = factory
        self.instances: dict[str, Speculator] = {}
        self._needs_hidden: dict[tuple[str, ...], bool] = {}  # needs_hidden's answers
        self._is_model: dict[str, bool] = {}  # is_model's answers: asked per speculator and sequence, every round
        # (speculator, setting) -> its parameters with the setting applied: made once, not per look-up (a
        # pydantic copy costs more than many look-ups, and tuning times the look-ups of each setting)
        self._settings: dict[tuple[str, tuple], object] = {}
        for name in config.speculators:
            self.speculator(name)  # fail fast on unknown names / bad params

    def speculator(self, name: str) -> Speculator:
        spec = self.instances.get(name)
        if spec is None:
            spec = self._install(name, self._factory(name, self.config.params.get(name)))
        return spec

    def is_model(self, name: str) -> bool:
        """Whether `name` drafts with a model (its drafts cost model time: the policy prices them first)."""
        known = self._is_model.get(name)
        if known is None:
            known = self._is_model[name] = isinstance(self.speculator(name), ModelSpeculator)
        return known

    def _install(self, name: str, spec: Speculator) -> Speculator:
        self.instances[name] = spec
        self._needs_hidden.clear()  # a new instance may read hidden rows where the old one did not
        self._is_model.pop(name, None)
        self._settings = {k: v for k, v in self._settings.items() if k[0] != name}  # its new parameters
        return spec

    def reconfigure(self, new: ChainConfig,
                    running: Mapping[int, tuple[tuple[str, ...], np.ndarray]] | None = None) -> ChainChange:
        """Swap the chain's config for `new` while sequences run (between rounds only: no proposal may be in
        flight). running: seq_id -> (speculator names, history so far) of every running sequence; a rebuilt
        or new speculator a sequence names is begun on its history, so the sequence goes on drafting with it.

        Speculators whose parameters changed are rebuilt, keeping their counters (the policy drops their
        estimates: ChainChange.rebuilt). Speculators the new chain names for the first time are built.
        Speculators left out of the new chain are kept: queued and running sequences (and per-request chains)
        may still name them. Raises ValueError, changing nothing, for unknown speculators, bad parameters or a
        model speculator whose parameters changed."""
        changed = sorted(n for n in self.instances
                         if (self.config.params.get(n) or {}) != (new.params.get(n) or {}))
        models = [n for n in changed if isinstance(self.instances[n], ModelSpeculator)]
        if models:
            raise ValueError(f"parameters of model speculators {models} cannot change at run time (restart the "
                             "deployment)")
        added = [n for n in dict.fromkeys(new.speculators) if n not in self.instances]
        # everything is built and begun before anything is installed: a bad name, parameter or begin leaves
        # the running chain untouched
        try:
            fresh = {name: self._factory(name, new.params.get(name)) for name in changed + added}
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"chain update refused: {e}") from None
        begun = _begin_on_running(fresh, running or {})
        for name, seq_id in begun:
            if name in self.instances:
                _end_quietly(self.instances[name], name, seq_id)  # discarded, but may hold per-sequence state
        for name, spec in fresh.items():
            old = self.instances.get(name)
            if old is not None:  # counters carry over, the same object: whoever holds it sees them go on
                old.stats.merge(spec.stats)
                spec.stats = old.stats
            self._install(name, spec)
        self.config = new
        return ChainChange(rebuilt=changed, built=added, resumed=len({seq_id for _, seq_id in begun}))

    def validate(self, names: tuple[str, ...]) -> None:
        for name in names:
            self.speculator(name)

    # ---- sequence life -----------------------------------------------------------
    def begin(self, seq_id: int, names: tuple[str, ...], prompt: np.ndarray, grammar: str | None = None) -> None:
        for name in names:  # `grammar`: the request's, for the speculators that read it (set_grammar)
            if hasattr(spec := self.speculator(name), "set_grammar"):
                spec.set_grammar(seq_id, grammar)
            spec.begin(seq_id, prompt)

    def prefilling(self, seq_id: int, names: tuple[str, ...], n: int) -> None:
        """The target prefills seq_id's prompt up to its token `n` this round (Speculator.prefilling)."""
        for name in names:
            self.instances[name].prefilling(seq_id, n)

    def end(self, seq_id: int, names: tuple[str, ...]) -> None:
        for name in names:
            self.instances[name].end(seq_id)

    def process(self, seq_id: int, names: tuple[str, ...], tokens: np.ndarray, pos: int) -> None:
        """The target committed `tokens` at positions pos... of seq_id (mirrored by model speculators)."""
        for name in names:
            self.instances[name].process(seq_id, tokens, pos)

    # ---- hidden rows (mtp, eagle3: speculators with a `take_hidden` method) ----------------------------
    def needs_hidden(self, names: tuple[str, ...]) -> bool:
        """True if a speculator of `names` reads the target's hidden rows (the target then returns them).
        Memoised per chain (asked for every decoding sequence, every round); _install clears it."""
        hit = self._needs_hidden.get(names)
        if hit is None:
            hit = self._needs_hidden[names] = any(hasattr(self.instances.get(n), "take_hidden") for n in names)
        return hit

    def hidden(self, record) -> None:
        """A round's hidden rows (engine/hidden_rows.py HiddenRows, or a transport handle) for every speculator
        that reads them; they pair them with the process() calls that follow."""
        for spec in self.instances.values():
            take = getattr(spec, "take_hidden", None)
            if take is not None:
                take(record)

    # ---- drafting ------------------------------------------------------------------
    def look_up(self, name: str, asks: list[tuple[int, np.ndarray, int]],
                settings: list[dict] | None = None) -> list[np.ndarray]:
        """`name`'s drafts for `asks` (seq_id, history, most tokens), in order. settings[j]: parameter
        overrides ask j's look-up runs with (online tuning; {} for the configured ones): asks sharing a setting
        draft together, and the configured parameters are put back afterwards. An exception raised here names
        the speculator (`.speculator`), so the caller can disable it."""
        spec = self.instances[name]
        reqs = [DraftRequest(seq_id, history, n) for seq_id, history, n in asks]
        try:
            if not settings or not any(settings):
                return spec.draft(reqs)
            return self._draft_by_setting(name, spec, reqs, settings)
        except Exception as e:
            blame(e, name)
            raise

    def shadow_look_up(self, name: str, ask: tuple[int, np.ndarray, int], setting: dict) -> tuple[np.ndarray, float]:
        """(draft, seconds the look-up itself took) of `name` for one ask with `setting` swapped in, unseen by
        the speculator's counters (online tuning's shadow look-ups: settings are compared by what their
        look-ups cost, so the swap is kept out of the time)."""
        spec = self.instances[name]
        configured, before = spec.params, (spec.stats.calls, spec.stats.drafts_generated)
        spec.params = self._params(name, configured, tuple(sorted(setting.items())))
        try:
            t0 = time.perf_counter()
            draft = spec.draft([DraftRequest(*ask)])[0]
            return draft, time.perf_counter() - t0
        except Exception as e:
            blame(e, name)
            raise
        finally:
            spec.params = configured
            spec.stats.calls, spec.stats.drafts_generated = before

    def _params(self, name: str, configured, key: tuple):
        """`configured` with the setting `key` (sorted items) applied, made once per speculator and setting."""
        if not key:
            return configured
        params = self._settings.get((name, key))
        if params is None:
            params = self._settings[(name, key)] = configured.model_copy(update=dict(key))
        return params

    def _draft_by_setting(self, name: str, spec: Speculator, reqs: list[DraftRequest],
                          settings: list[dict]) -> list[np.ndarray]:
        """spec.draft with each request's parameter overrides swapped in for its group's look-ups."""
        groups: dict[tuple, list[int]] = {}
        for j, o in enumerate(settings):
            groups.setdefault(tuple(sorted(o.items())), []).append(j)
        out: list = [None] * len(reqs)
        configured = spec.params
        try:
            for key, members in groups.items():
                spec.params = self._params(name, configured, key)
                for j, d in zip(members, spec.draft([reqs[j] for j in members])):
                    out[j] = d
        finally:
            spec.params = configured
        return out

    def draft_context(self, name: str, seq_id: int) -> int:
        """`name`'s own context bucket for its last draft of seq_id (Speculator.draft_context)."""
        return self.instances[name].draft_context(seq_id)

    def accept(self, seq_id: int, asked: tuple[str, ...], sent_by: str | None, n_drafted: int,
               n_accepted: int) -> None:
        """Tell every speculator asked for seq_id this round how its round went (`sent_by`: whose draft the
        target verified, n_drafted tokens of it, n_accepted accepted)."""
        for name in asked:
            self.instances[name].accept(seq_id, n_drafted, n_accepted, name == sent_by and n_drafted > 0)

    def stats(self) -> dict[str, SpeculatorStats]:
        return {name: spec.stats for name, spec in self.instances.items()}


def _begin_on_running(specs: Mapping[str, Speculator],
                      running: Mapping[int, tuple[tuple[str, ...], np.ndarray]]) -> list[tuple[str, int]]:
    """Begin each of `specs` on every running sequence that names it, on its history so far; returns the
    (name, seq_id) pairs begun. If one fails, those begun are ended again and ValueError is raised."""
    begun: list[tuple[str, int]] = []
    for seq_id, (names, history) in running.items():
        for name in names:
            if name not in specs:
                continue
            try:
                specs[name].begin(seq_id, np.array(history, dtype=np.int32))
            except Exception as e:
                for b_name, b_seq in begun:
                    _end_quietly(specs[b_name], b_name, b_seq)
                raise ValueError(f"chain update refused: speculator {name!r} could not resume sequence "
                                 f"{seq_id}: {type(e).__name__}: {e}") from e
            begun.append((name, seq_id))
    return begun


def _end_quietly(spec: Speculator, name: str, seq_id: int) -> None:
    """End an instance being dropped: a failure there must not stop what dropping it is for."""
    try:
        spec.end(seq_id)
    except Exception:
        log.warning("ending dropped speculator %s on sequence %s failed", name, seq_id, exc_info=True)
