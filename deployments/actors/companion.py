"""The companion actor: home of the model-based speculators (the draft model; the MTP / EAGLE-3 / DFlash heads).

Distributed mode. The companion owns the draft model and its context (one
sequence per slot, mirroring the target's KV cache, engine/speculators/draft.py).
The router talks to it through `CompanionDraftProxy`, the `draft` speculator
of the router's chain: the proxy buffers what the scheduler tells it
(sequences begun and ended, the tokens the target committed per sequence via
`process()`) and sends all of it together with the round's draft requests in
ONE call, `CompanionService.round`, which returns every slot's draft (one
batched draft decode per draft step, all slots at once). Rounds in which the
chain's cost policy asks the draft model for nothing make no call at all, and
the buffer simply waits for the next one.

Calls go through the router's `CompanionClient` (deployments/actors/companion_client.py):
a companion that is down or fails a call gives no drafts that round and is
recreated; its `epoch` changes, and a sequence begun on an older companion
drafts nothing from then on (the new companion has no mirror of it), new
sequences draft again. The hidden-state speculators (mtp, eagle3, dflash) work the
same way with their own call, `hidden_round` (deployments/actors/companion_hidden.py).
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import ray

from specray.engine.config import EngineConfig
from specray.engine.draft_tree import Branch, runner_ups_within
from specray.engine.speculator import EMPTY_DRAFT, TOKEN_DTYPE
from specray.engine.speculators.draft_base import DraftParams

from specray.deployments import heap
from specray.deployments.actors.companion_proxy import CompanionProxy, answer_draft_requests
from specray.engine.speculators.registry import MODEL_SPECULATOR_PARAMS, Factory, speculator_factory

EMPTY = EMPTY_DRAFT


class CompanionService:
    """The draft model + context; callable locally or as a Ray actor (`CompanionActor`)."""

    def __init__(self, engine_config: dict | EngineConfig, freeze_gc: bool = False) -> None:
        """`freeze_gc`: as an actor, freeze what start-up left out of the garbage collector once the draft model
        is up (ServeConfig.freeze_gc, deployments/heap.py)."""
        from specray.deployments.builder import usable_cpus

        from specray.deployments.actors.decode_thread import DecodeThread

        self.config = EngineConfig.model_validate(engine_config).with_threads(True, usable_cpus())
        self.cpus = usable_cpus()
        # every call that touches a context runs on this one thread, the set-up's decodes included: a
        # compiled graph's calls arrive on a thread of Ray's (decode_thread.py)
        self._decoder = DecodeThread("specray-companion-decode")
        self._wake = threading.Event()  # ends a compiled graph's park (target_channel.py)
        self._decoder.run(self._build)
        self.speculators: dict[str, object] = {}  # DraftSpeculator per parameter set (a chain's params)
        self._lock = threading.Lock()  # the draft context is not thread-safe
        self.calls = 0
        self.rounds = 0
        self.inside_seconds = 0.0
        self.unsynced = 0
        heap.watch()
        if freeze_gc:
            heap.freeze_startup()

    def _build(self) -> None:
        self.draft_model = None
        self.target_vocab = None
        cfg = self.config
        if cfg.draft.model:
            from specray.native.backends import BACKENDS
            from specray.native.model import Model

            # the target's vocabulary only: the compatibility check, and text for cross-vocab drafting
            self.target_vocab = Model(cfg.model, chat_template=cfg.chat_template, vocab_only=True)
            self.draft_model = BACKENDS["draft"].open(cfg, self.target_vocab, target_n_ctx=cfg.n_ctx)
        self.hidden = None  # mtp / eagle3 / dflash heads (deployments/actors/companion_hidden.py)
        if cfg.hidden.enabled:
            from specray.native.model import Model

            from specray.deployments.actors.companion_hidden import HiddenCompanion

            if self.target_vocab is None:
                self.target_vocab = Model(cfg.model, chat_template=cfg.chat_template, vocab_only=True)
            self.hidden = HiddenCompanion(cfg, self.target_vocab)

    def ping(self) -> str:
        return "ok"

    def info(self) -> dict:
        ctx = ray.get_runtime_context() if ray.is_initialized() else None
        d = {"pid": os.getpid(), "node_id": ctx.get_node_id() if ctx else None,
             "placement_group_id": ctx.get_placement_group_id() if ctx else None,
             "gpu_ids": [str(g) for g in ray.get_gpu_ids()] if ctx else [],
             "speculators": (["draft"] if self.draft_model is not None else [])
             + (self.hidden.names if self.hidden is not None else []),
             "model_speculators_known": sorted(MODEL_SPECULATOR_PARAMS), "draft": None,
             "cpus": self.cpus, "threads": self.threads()}
        if self.draft_model is not None:
            d["draft"] = self.draft_model.info()
            d["draft_decode_costs"] = self.draft_model.backend.decode_costs()
        if self.hidden is not None:
            d["hidden"] = self.hidden.heads.info()
            d["hidden_decode_costs"] = self.hidden.decode_costs()
            d["hidden_inject_costs"] = self.hidden.inject_costs()
        return d

    def threads(self) -> int:
        """The most CPU threads one of its contexts decodes with (0: no model)."""
        cfg, t = self.config, []
        if cfg.draft.model:
            t.append(cfg.draft.threads or cfg.threads)
        if cfg.hidden.enabled:
            t.append(cfg.hidden.threads or cfg.threads)
        return max(t, default=0)

    def hidden_round(self, payload: dict) -> dict:
        """One router round for a hidden-state speculator (mtp, eagle3, dflash): see
        companion_hidden.HiddenCompanion."""
        if self.hidden is None:
            raise ValueError("the companion has no hidden-state heads (engine.hidden)")
        return self._decoder.run(self.hidden.round, payload)

    def hidden_state(self, name: str, seq_ids: list[int]) -> dict:
        """Inspection (tests): per sequence, what the `name` head mirrors and the rows it received."""
        return self._decoder.run(self.hidden.state, name, seq_ids) if self.hidden is not None else {}

    def channel(self, msg: tuple):
        """The one method of a compiled graph (companion_hop: compiled; target_channel.py), on Ray's graph
        thread: ("round", payload) | ("hidden_round", payload) | ("park",). A park holds the thread in a
        plain wait until `wake`: between executions Ray 2.60's graph loop polls its input channel, a whole core
        while the router is idle."""
        op = msg[0]
        if op == "round":
            return self.round(msg[1])
        if op == "hidden_round":
            return self.hidden_round(msg[1])
        if op == "park":
            self._wake.wait()
            self._wake.clear()
            return None
        raise ValueError(f"unknown companion channel op {op!r}")

    def wake(self) -> None:
        """Ends a park (on the actor's main thread, beside the parked graph thread)."""
        self._wake.set()

    def _speculator(self, params: dict):
        key = repr(sorted(params.items()))
        spec = self.speculators.get(key)
        if spec is None:
            if self.draft_model is None:
                raise ValueError("the companion has no draft model (engine.draft.model)")
            spec = self.speculators[key] = self.draft_model.speculator(DraftParams.model_validate(params))
        return spec

    def round(self, payload: dict) -> dict:
        return self._decoder.run(self._round, payload)

    def _round(self, payload: dict) -> dict:
        """One router round: sequences ended and begun, tokens committed since the last call, then drafts.

        payload: params (DraftParams dict), ends [seq], begins [seq], shifts [(seq, n_keep, n_discard)] (context
        shifts, applied before the commits: those follow them), commits [(seq, pos, tokens)],
        requests [(seq, last_token, history_len, n_max)]. A request whose history length does not match
        what this companion mirrored gets no draft (listed in `unsynced`).
        """
        t0 = time.perf_counter()
        with self._lock:
            self.calls += 1
            spec = self._speculator(payload.get("params") or {})
            for seq in payload.get("ends", ()):
                spec.end(seq)
            for seq in payload.get("begins", ()):
                spec.begin(seq, EMPTY)
            for seq, keep, discard in payload.get("shifts", ()):
                spec.shift(seq, keep, discard)
            for seq, pos, toks in payload.get("commits", ()):
                spec.process(seq, np.asarray(toks, dtype=TOKEN_DTYPE), pos)
            requests = payload.get("requests", ())
            ups_wanted = bool(payload.get("runner_ups")) and spec.offers_branches
            spec.runner_ups_wanted = ups_wanted
            drafts, unsynced, drafted = answer_draft_requests(spec, requests)
            self.rounds += 1 if drafted else 0
            self.unsynced += len(unsynced)
            costs = spec.step_cost.table()
            ups = [runner_ups(spec, r[0], d) for r, d in zip(requests, drafts)] if ups_wanted else []
        inside = time.perf_counter() - t0
        self.inside_seconds += inside
        return {"drafts": drafts, "unsynced": unsynced, "inside_s": inside, "step_costs": costs, "runner_ups": ups}

    def positions(self, seq_ids: list[int], sync: bool = False) -> dict:
        """Per sequence: the draft KV cache's largest position (-1 if empty), its tokens, the committed
        target tokens it mirrors. sync=True first decodes what was mirrored but not decoded yet."""
        return self._decoder.run(self._positions, seq_ids, sync)

    def _positions(self, seq_ids: list[int], sync: bool) -> dict:
        with self._lock:
            out = {}
            for spec in self.speculators.values():
                if sync:
                    spec.sync(seq_ids)
                for s in seq_ids:
                    if s in spec.seqs:
                        out[s] = {"pos_max": self.draft_model.backend.pos_max(s),
                                  "kv_tokens": spec.kv_tokens(s).tolist(), "committed": spec.committed(s).tolist()}
            return out

    def accept(self, updates: list) -> None:
        """Verdicts are not needed here: the next round's commits say what the target kept."""

    def draft(self, requests: list) -> list[np.ndarray]:
        """The old per-round entry point: drafts need the mirrored state `round` carries."""
        return [EMPTY for _ in requests]

    def counters(self) -> dict:
        d = {"calls": self.calls, "rounds": self.rounds, "inside_seconds": self.inside_seconds,
             "unsynced": self.unsynced}
        for spec in self.speculators.values():
            c = spec.counters
            for k in ("steps", "decode_seconds", "catchup_tokens", "drafted_tokens", "rolled_back", "failures"):
                d[f"draft_{k}"] = d.get(f"draft_{k}", 0) + getattr(c, k)
        if self.hidden is not None:
            d |= self.hidden.counters()
        from specray.native import decode_threads

        return d | {"decode_threads": len(decode_threads.live()), "decode_tids": decode_threads.native_ids(),
                    "gc": heap.watch().snapshot()}


CompanionActor = ray.remote(CompanionService)


def runner_ups(spec, seq_id: int, draft: np.ndarray) -> list[tuple[int, list[int], float]]:
    """The runner-ups `spec` holds beside `draft` (DraftSpeculator.branches), as plain values for the router's
    proxy: (depth, tokens, weight) each; none for an empty draft."""
    if not len(draft):
        return []
    return [(b.at, b.tokens.tolist(), b.weight) for b in spec.branches(seq_id, draft, len(draft))]


class CompanionDraftProxy(CompanionProxy):
    """The router's `draft` speculator: buffers begin/process/end, one companion call per round that drafts. The
    round's answer carries each draft's runner-ups (the draft model's second choices), a draft tree's branches."""

    name = "draft"
    offers_branches = True

    def __init__(self, params: DraftParams | None, client, cost_table: dict[int, float] | None = None) -> None:
        super().__init__(params or DraftParams(), client, cost_table)
        self._runner_ups: dict[int, tuple[np.ndarray, list[Branch]]] = {}  # seq -> (its last draft, runner-ups)
        self.runner_ups_wanted = False  # set by the first `branches` call: the companion finds them from then on
        self._ends: list[int] = []
        self._begins: list[int] = []
        self._commits: list[tuple[int, int, np.ndarray]] = []
        self._shifts: list[tuple[int, int, int]] = []  # context shifts, sent before any commit buffered after them

    def _begin(self, seq_id: int, prompt: np.ndarray) -> None:
        self._drop(seq_id)
        super()._begin(seq_id, prompt)
        self._begins.append(seq_id)

    def process(self, seq_id: int, tokens: np.ndarray, pos: int) -> None:
        if self._current(seq_id):
            self._commits.append((seq_id, int(pos), np.asarray(tokens, dtype=TOKEN_DTYPE).copy()))

    def shift(self, seq_id: int, n_keep: int, n_discard: int) -> None:
        """Context shift: the companion's draft cache shifts as the target's did (DraftSpeculator.shift). The
        commits buffered so far are at the old positions: they go first (a shift is rare, the call cheap)."""
        if self._current(seq_id):
            self.flush()
            self._shifts.append((seq_id, int(n_keep), int(n_discard)))

    def _answered(self, seq_id: int, draft: np.ndarray, res: dict, i: int) -> None:
        ups = res.get("runner_ups")
        if ups and ups[i]:
            self._runner_ups[seq_id] = (draft, [Branch(at, np.asarray(t, dtype=TOKEN_DTYPE), w) for at, t, w in ups[i]])
        else:
            self._runner_ups.pop(seq_id, None)

    def _branches(self, seq_id: int, main: list[int], width: int) -> list[Branch]:
        """The last draft's runner-ups within `main` (a prefix of that draft), most likely first."""
        self.runner_ups_wanted = True
        last, held = self._runner_ups.get(seq_id, (None, []))
        return runner_ups_within(last, held, main, width)

    def _end(self, seq_id: int) -> None:
        self._drop(seq_id)
        self._runner_ups.pop(seq_id, None)
        super()._end(seq_id)
        if seq_id not in self._ends:
            self._ends.append(seq_id)

    def _drop(self, seq_id: int) -> None:
        """Forget what is buffered for a slot's previous sequence."""
        self._commits = [c for c in self._commits if c[0] != seq_id]
        self._begins = [s for s in self._begins if s != seq_id]
        self._shifts = [s for s in self._shifts if s[0] != seq_id]

    def _send(self, requests: list) -> dict | None:
        payload = {"params": self.params.model_dump(), "ends": self._ends, "begins": self._begins,
                   "shifts": self._shifts, "commits": self._commits, "requests": requests,
                   "runner_ups": self.runner_ups_wanted}
        self._ends, self._begins, self._commits, self._shifts = [], [], [], []
        return self._call("round", payload)

    def flush(self) -> bool:
        """Send what is buffered (begun/ended sequences, commits) without asking for drafts, e.g. before
        inspecting the companion's mirror. False if the companion could not take it."""
        if not (self._ends or self._begins or self._commits or self._shifts):
            return True
        return self._send([]) is not None

    def counters(self) -> dict:
        return super().counters() | {"buffered_commits": len(self._commits)}


def companion_speculator_factory(client, config: EngineConfig, ack_sink=None, extra=None) -> Factory:
    """Chain factory of the router in distributed mode: `draft`, `mtp`, `eagle3`, `dflash` run in the companion (if
    configured), model-free speculators in the router, and the router's own `extra` builders (`grammar`).
    `ack_sink` takes CUDA-IPC hidden-row buffer acks back to the target (RemoteTarget.ack_hidden)."""
    from specray.deployments.actors.companion_hidden import hidden_proxy_builders

    builders = dict(extra or {}) | hidden_proxy_builders(client, config, ack_sink)
    if config.draft.model:
        costs = client.sup.info.get("draft_decode_costs")
        builders[CompanionDraftProxy.name] = lambda p: CompanionDraftProxy(p, client, costs)
    return speculator_factory(builders or None)
