"""How `specray bench` runs one group of prompts through its configurations: each configuration's requests
on an engine, a scheduler round at a time, timed over its own rounds only (ConfigRun); the plain
llama_cpp.Llama reference loop (native/reference_loop.py), a decode at a time (LlamaRun); the lockstep
driver that advances all of them in turn (run_lockstep), and run_alone for the orders that run them one
after another."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from .fit import bench_request
from .report import ConfigResult
from .round_profile import RoundProfiler

if TYPE_CHECKING:
    from specray.deployments.local_engine import LocalEngine
    from specray.engine.policy import DraftPolicy


def cpu_steal_seconds() -> float:
    """CPU seconds the hypervisor has stolen from this machine since boot (0 where /proc/stat says nothing)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK") if fields[0] == "cpu" and len(fields) > 8 else 0.0
    except (OSError, ValueError):
        return 0.0


class ConfigRun:
    """One configuration's requests on an engine, from submission to the result: run at once, or a round
    at a time (lockstep) with only its own rounds' time counted."""

    def __init__(self, engine: LocalEngine, policy: DraftPolicy, name: str, prompts: list[np.ndarray],
                 max_tokens: int, profiler: RoundProfiler | None = None,
                 grammars: list[str | None] | None = None) -> None:
        self.engine, self.name = engine, name
        self.profiler = profiler  # --profile: cProfile on during this run's rounds
        engine.scheduler.use_policy(policy)  # its chain and what the policy learnt of it
        grammars = grammars or [None] * len(prompts)
        reqs = [bench_request(t, max_tokens, name, g) for t, g in zip(prompts, grammars)]
        st = engine.scheduler.stats
        self.before = (st.prefill_seconds, st.loaded_seconds, st.loaded_tokens, st.rounds, st.draft_seconds,
                       st.target_seconds, dict(st.stage_seconds), st.seq_rounds, *self._lookups(policy),
                       st.rollback.to_dict(), st.failed_sequences, self._trees(policy))
        self.policy = policy
        self.seqs = [engine.submit(r) for r in reqs]
        self.seconds = 0.0

    @staticmethod
    def _trees(policy: DraftPolicy) -> tuple[int, int, int, int, int]:
        """(rounds with a draft, of them with a tree, trees, branches, trees that took a runner-up) so far."""
        t = policy.trees
        counters = t.counters.values()
        return (t.rounds, t.tree_rounds, sum(c.drafts for c in counters), sum(c.branches for c in counters),
                sum(sum(c.accepted_by_rank[1:]) for c in counters))

    @staticmethod
    def _lookups(policy: DraftPolicy) -> tuple[dict[str, float], dict[str, int]]:
        """Each speculator's look-up seconds and sequences asked, so far."""
        snap = policy.snapshot()
        return snap["lookup_seconds"], snap["lookups"]

    @property
    def done(self) -> int:
        """Prompts finished so far (for progress lines)."""
        return sum(1 for s in self.seqs if s.finished)

    def step(self) -> bool:
        """One round; False once every request has finished. Its time leaves out the bench's instrumentation
        (the top-2 margins the tie check reads: RoundStats.instrument_seconds), which no server computes."""
        stats = self.engine.scheduler.stats
        t0, instrument0 = time.perf_counter(), stats.instrument_seconds
        if self.profiler is None:
            self.engine.step()
        else:
            with self.profiler.round(self.name):
                self.engine.step()
        self.seconds += time.perf_counter() - t0 - (stats.instrument_seconds - instrument0)
        return self.engine.scheduler.has_work()

    def result(self, steal_seconds: float) -> tuple[ConfigResult, list]:
        st, before, name = self.engine.scheduler.stats, self.before, self.name
        r = ConfigResult(name, seconds=self.seconds, prefill_seconds=st.prefill_seconds - before[0],
                         steal_seconds=steal_seconds,
                         loaded_seconds=st.loaded_seconds - before[1], loaded_tokens=st.loaded_tokens - before[2],
                         rounds=st.rounds - before[3], draft_seconds=st.draft_seconds - before[4],
                         verify_seconds=st.target_seconds - before[5],
                         stage_seconds=_minus(st.stage_seconds, before[6]), seq_rounds=st.seq_rounds - before[7],
                         speculator_seconds=_minus(self._lookups(self.policy)[0], before[8]),
                         speculator_asks=_minus(self._lookups(self.policy)[1], before[9]),
                         rollback=_minus(st.rollback.to_dict(), before[10]),
                         failed=st.failed_sequences - before[11])
        r.draft_rounds, r.tree_rounds, r.tree_drafts, r.tree_branches, r.runner_ups_taken = (
            now - then for now, then in zip(self._trees(self.policy), before[12]))
        for s in self.seqs:
            r.sequences += 1 if s.generated else 0
            r.tokens += len(s.generated)
            r.drafts += s.spec_total.drafts
            r.drafted += s.spec_total.drafted
            r.accepted += s.spec_total.accepted
            r.add(ConfigResult(name, by_speculator=s.spec_by_name))
        return r, self.seqs


def _minus(now: dict, before: dict) -> dict:
    """Counters accrued since `before` (keys that did not move are left out)."""
    return {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}


def run_alone(run: ConfigRun | LlamaRun,
              on_round: Callable[[], None] | None = None) -> tuple[ConfigResult, list | None]:
    """One run to its end, by itself (the `sandwich` and `alternate` orders); `on_round` after each
    round."""
    steal0 = cpu_steal_seconds()
    while run.step():
        if on_round is not None:
            on_round()
    return run.result(cpu_steal_seconds() - steal0)


def run_lockstep(runs: dict[str, ConfigRun | LlamaRun],
                 on_round: Callable[[], None] | None = None) -> dict[str, tuple[ConfigResult, list | None]]:
    """Advance every configuration's run by one round in turn until all have finished, timing each round:
    a shared machine's speed drifts over tens of seconds, and rounds of
    all configurations taken within milliseconds of each other see the same speed, so the drift cancels.
    The host's stolen time is shared out by each configuration's share of the time. `on_round` is called
    after each turn (outside every run's timing), e.g. for progress lines."""
    steal0 = cpu_steal_seconds()
    active = list(runs)
    while active:
        active = [c for c in active if runs[c].step()]
        if on_round is not None:
            on_round()
    steal = cpu_steal_seconds() - steal0
    total = sum(r.seconds for r in runs.values()) or 1.0
    return {c: r.result(steal * r.seconds / total) for c, r in runs.items()}


class PlainLlama:
    """llama_cpp.Llama's own greedy generate, same model file and threads: the reference loop."""

    def __init__(self, engine: LocalEngine, threads: int, n_ctx: int) -> None:
        from specray.native.reference_loop import ReferenceLoop

        # the engine's own offload (all layers on a GPU machine), so the reference runs where the target does
        self.loop = ReferenceLoop(engine.model.path, threads, n_ctx, engine.model.eog_ids,
                                  n_gpu_layers=engine.model.n_gpu_layers)


class LlamaRun:
    """The reference loop on a group of prompts, a decode at a time (for lockstep)."""

    def __init__(self, llama: PlainLlama, prompts: list[np.ndarray], max_tokens: int) -> None:
        self.r = ConfigResult("llama_cpp")
        self.seconds = 0.0
        self.done = 0  # prompts finished (for progress lines)
        self._decodes = self._generate(llama, prompts, max_tokens)

    def _generate(self, llama: PlainLlama, prompts: list[np.ndarray], max_tokens: int):
        """Yields after each decode: "prompt" for the one that processes a prompt, else "token"."""
        for toks in prompts:
            n = 0
            for kind, tok in llama.loop.greedy(toks.tolist(), max_tokens):
                if tok is not None:
                    n += 1
                    self.r.tokens += 1
                yield kind
            self.r.sequences += 1 if n else 0
            self.done += 1

    def step(self) -> bool:
        t0 = time.perf_counter()
        kind = next(self._decodes, None)
        dt = time.perf_counter() - t0
        self.seconds += dt
        if kind == "prompt":  # prompt processing ends with the first token
            self.r.prefill_seconds += dt
        return kind is not None

    def result(self, steal_seconds: float) -> tuple[ConfigResult, None]:
        self.r.seconds, self.r.steal_seconds = self.seconds, steal_seconds
        return self.r, None
