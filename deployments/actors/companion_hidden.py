"""Hidden-state speculators (mtp, eagle3, dflash) across actors: the companion's side and the router's proxy.

Distributed mode. The target actor returns each round's hidden rows as a
transport handle (deployments/actors/row_transport.py) inside its step result; the
scheduler hands it to the chain (`Chain.hidden`), i.e. to the router's
`CompanionHiddenProxy`, which only keeps the handle. Like the `draft` proxy, it
buffers what the scheduler tells it, IN ORDER (sequences ended and begun, round
records, committed tokens), and sends it with the round's draft requests in ONE
companion call (`CompanionService.hidden_round`). The companion opens each
record (object store: a shared-memory get; the router never copied the rows)
and replays the events into the real speculator (engine/speculators/mtp.py,
eagle3.py, dflash.py), whose RowStash checks every commit against its rows'
sequence, positions and token ids, then drafts all slots in one batched head
decode per step (dflash: one block decode for all of them). A context shift
of a sequence travels as a "shift" event: `dflash` moves its feature window,
mtp and eagle3 stop drafting for that sequence (their rows of the moved cells
cannot be made again). If no draft is asked for a while, the buffer is flushed every `FLUSH_RECORDS`
records so the object store does not hold many rounds' rows; where the node has room for the companion's
replay (engine.hidden.flush_behind), that flush does not wait: its answer is read before the next call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from specray.engine.config import EngineConfig
from specray.engine.cost import DecodeCostModel
from specray.engine.speculator import EMPTY_DRAFT, TOKEN_DTYPE
from specray.engine.speculators.dflash import block_draft_seconds
from specray.engine.speculators.registry import enabled_speculators, make_params

from specray.deployments.actors.companion_proxy import CompanionProxy, answer_draft_requests
from specray.deployments.actors.row_transport import HiddenReceiver

log = logging.getLogger("specray.companion.hidden")

#: records buffered by the proxy before it sends them without a draft request
FLUSH_RECORDS = 16


class HiddenCompanion:
    """The companion's hidden-state heads and speculators (one speculator per name and parameter set)."""

    def __init__(self, cfg: EngineConfig, target_vocab) -> None:
        from specray.native.hidden_heads import open_hidden_heads

        self.heads = open_hidden_heads(cfg, target_vocab, target_n_ctx=cfg.n_ctx)
        self.builders = self.heads.builders() if self.heads is not None else {}
        self.receiver = HiddenReceiver()
        self.speculators: dict[tuple[str, str], object] = {}
        self._lock = threading.Lock()  # head contexts are not thread-safe
        self.calls = 0
        self.inside_seconds = 0.0
        self.unsynced = 0
        self.open_failures = 0

    @property
    def names(self) -> list[str]:
        return sorted(self.builders)

    def _speculator(self, name: str, params: dict):
        key = (name, repr(sorted(params.items())))
        spec = self.speculators.get(key)
        if spec is None:
            if name not in self.builders:
                raise ValueError(f"the companion has no {name} head (engine.hidden)")
            spec = self.speculators[key] = self.builders[name](make_params(name, params))
        return spec

    def round(self, payload: dict) -> dict:
        """events: ordered ("end", seq) | ("begin", seq) | ("rows", handle) | ("commit", seq, pos, tokens) |
        ("shift", seq, n_keep, n_discard); requests: [(seq, last_token, history_len, n_max)]. Returns drafts,
        unsynced sequences, time inside, step costs (dflash: also injection costs) and acks (CUDA buffers done
        with)."""
        t0 = time.perf_counter()
        with self._lock:
            self.calls += 1
            spec = self._speculator(payload["name"], payload.get("params") or {})
            for ev in payload.get("events", ()):
                kind = ev[0]
                if kind == "rows":
                    try:
                        record = self.receiver.open_handle(ev[1])
                    except Exception:
                        # e.g. the target actor died and its objects with it: the commits of these rows then
                        # find none and their sequences stop drafting; the companion itself is fine
                        self.open_failures += 1
                        log.exception("could not open a round's hidden rows")
                        continue
                    spec.take_hidden(record)
                elif kind == "commit":
                    spec.process(ev[1], np.asarray(ev[3], dtype=TOKEN_DTYPE), ev[2])
                elif kind == "begin":
                    spec.begin(ev[1], EMPTY_DRAFT)
                elif kind == "end":
                    spec.end(ev[1])
                elif kind == "shift" and hasattr(spec, "shift"):
                    spec.shift(ev[1], ev[2], ev[3])
            drafts, unsynced, _ = answer_draft_requests(spec, payload.get("requests", ()))
            self.unsynced += len(unsynced)
            costs = spec.step_cost.table()
            inject = spec.inject_cost.table() if hasattr(spec, "inject_cost") else None
            acks = self.receiver.take_acks()
        inside = time.perf_counter() - t0
        self.inside_seconds += inside
        out = {"drafts": drafts, "unsynced": unsynced, "inside_s": inside, "step_costs": costs, "acks": acks}
        return out | ({"inject_costs": inject} if inject is not None else {})

    def state(self, name: str, seq_ids: list[int]) -> dict:
        """Per sequence: committed tokens, head KV tokens and pos_max, and (audit on) the rows received by
        position: {seq: {"committed", "kv_tokens", "pos_max", "audit": {pos: (token, row)}}}."""
        with self._lock:
            out: dict = {}
            for (n, _), spec in self.speculators.items():
                if n != name:
                    continue
                for s in seq_ids:
                    if s in spec.seqs:
                        out[s] = {"committed": spec.committed(s), "kv_tokens": spec.kv_tokens(s),
                                  "pos_max": spec.backend.pos_max(s), "lost": spec.seqs[s].lost,
                                  "audit": dict(spec.audit.get(s, {}))}
                        if hasattr(spec.seqs[s], "window"):  # dflash: which positions its cache holds
                            w = spec.seqs[s].window
                            out[s]["window"] = {"lo": w.lo, "injected": w.injected, "end": w.end}
            return out

    def counters(self) -> dict:
        d = {"hidden_calls": self.calls, "hidden_inside_seconds": self.inside_seconds,
             "hidden_unsynced": self.unsynced, "hidden_open_failures": self.open_failures}
        for (name, _), spec in self.speculators.items():
            for k, v in spec.counters.__dict__.items():
                d[f"{name}_{k}"] = d.get(f"{name}_{k}", 0) + v
        d |= {f"hidden_transport_{k}": v for k, v in self.receiver.stats.to_dict().items()}
        return d

    def decode_costs(self) -> dict[str, dict[int, float]]:
        heads = self.heads.named() if self.heads is not None else {}
        return {name: head.decode_costs() for name, head in heads.items()}

    def inject_costs(self) -> dict[str, dict[int, float]]:
        """dflash: seconds per feature-injection decode by rows."""
        heads = self.heads.named() if self.heads is not None else {}
        return {name: head.inject_costs() for name, head in heads.items() if hasattr(head, "inject_costs")}

    def close(self) -> None:
        self.receiver.close()
        if self.heads is not None:
            self.heads.close()


class CompanionHiddenProxy(CompanionProxy):
    """The router's `mtp` / `eagle3` / `dflash` speculator: buffers events in order, one companion call per
    drafting round.

    `ack_sink(acks)` (optional) takes CUDA-IPC buffer acks back to the target."""

    def __init__(self, name: str, params, client, cost_table: dict[int, float] | None = None,
                 ack_sink: Callable[[list], None] | None = None) -> None:
        super().__init__(params, client, cost_table)
        self.name = name
        self.ack_sink = ack_sink
        self.flushes = 0
        self._events: list[tuple] = []
        self._records = 0
        self._pending = None  # a flush sent without waiting (CompanionClient.Pending), read before the next call
        # flushes go without waiting (engine.hidden.flush_behind): the companion's replay then overlaps the
        # target's decode, which pays where the node has room for it (target_channel.companion_has_room)
        self.flush_behind = bool(getattr(client, "flush_behind", False))

    # ---- events ------------------------------------------------------------------------------------------
    def _begin(self, seq_id: int, prompt: np.ndarray) -> None:
        super()._begin(seq_id, prompt)
        self._events.append(("begin", seq_id))

    def _end(self, seq_id: int) -> None:
        super()._end(seq_id)
        self._events.append(("end", seq_id))

    def shift(self, seq_id: int, n_keep: int, n_discard: int) -> None:
        """Context shift: in order with the other events (the head in the companion stops drafting for it)."""
        if self._current(seq_id):
            self._events.append(("shift", seq_id, int(n_keep), int(n_discard)))

    def take_hidden(self, handle) -> None:
        self._events.append(("rows", handle))
        self._records += 1
        if self._records >= FLUSH_RECORDS:
            if self.flush_behind:
                self._flush_behind()
            else:
                self.flush()

    def _flush_behind(self) -> None:
        """Send what is buffered without waiting for the answer: the companion opens the records while the
        target decodes the next round; the answer (acks) is read before the next call."""
        self._settle()
        payload = self._payload([])
        self._events, self._records = [], 0
        self.flushes += 1
        self.calls += 1
        self._pending = self.client.submit("hidden_round", payload)
        if self._pending is None:
            self.failed_calls += 1

    def _settle(self) -> None:
        p, self._pending = self._pending, None
        if p is None:
            return
        res = p.result()
        if res is None:
            self.failed_calls += 1
        elif res.get("acks") and self.ack_sink is not None:
            self.ack_sink(res["acks"])

    def process(self, seq_id: int, tokens: np.ndarray, pos: int) -> None:
        if self._current(seq_id):
            self._events.append(("commit", seq_id, int(pos), np.asarray(tokens, dtype=TOKEN_DTYPE).copy()))

    def _payload(self, requests: list) -> dict:
        return {"name": self.name, "params": self.params.model_dump(), "events": self._events, "requests": requests}

    def _send(self, requests: list) -> dict | None:
        self._settle()
        payload = self._payload(requests)
        self._events, self._records = [], 0
        res = self._call("hidden_round", payload)
        if res is not None and res.get("acks") and self.ack_sink is not None:
            self.ack_sink(res["acks"])
        return res

    def flush(self) -> bool:
        """Send what is buffered without asking for drafts (bounds the rows held in the object store)."""
        if not self._events:
            return True
        self.flushes += 1
        return self._send([]) is not None

    def counters(self) -> dict:
        return super().counters() | {"flushes": self.flushes, "buffered_events": len(self._events)}


class CompanionDFlashProxy(CompanionHiddenProxy):
    """The router's `dflash` speculator: priced as one injection decode and ONE block decode for all the
    sequences drafting together (engine/speculators/dflash.block_draft_seconds), not one decode per token."""

    name = "dflash"

    def __init__(self, params, client, cost_table: dict[int, float] | None = None,
                 ack_sink: Callable[[list], None] | None = None, inject_table: dict[int, float] | None = None,
                 block_size: int = 16) -> None:
        super().__init__(self.name, params, client, cost_table, ack_sink)
        self.max_steps = max(1, min(params.n_max, block_size - 1))
        self.inject_cost = DecodeCostModel(inject_table or None, ema=0.1)

    def draft_seconds(self, n_seqs: int, n_steps: int) -> float:
        return self.hop_seconds + block_draft_seconds(self.step_cost, self.inject_cost, n_seqs,
                                                      min(n_steps, self.max_steps), 2.0)

    def catchup_seconds(self, seq_id: int, history: np.ndarray) -> float:
        rows = len(history) - self._drafted_len.get(seq_id, 0) + 1
        return max(0.0, self.inject_cost.cost(rows) - self.inject_cost.cost(2)) if rows > 2 else 0.0

    def _send(self, requests: list) -> dict | None:
        res = super()._send(requests)
        if res is not None and res.get("inject_costs"):
            self.inject_cost = DecodeCostModel({int(k): v for k, v in res["inject_costs"].items()}, ema=0.1)
        return res


def hidden_proxy_builders(client, config: EngineConfig, ack_sink=None) -> dict[str, Callable]:
    """Router-side builders for the hidden-state speculators the companion has heads for."""
    if not config.hidden.enabled:
        return {}
    info = client.sup.info or {}
    costs = info.get("hidden_decode_costs") or {}
    names = enabled_speculators(config, hidden_rows=True)

    def builder(name: str):
        table = {int(k): v for k, v in (costs.get(name) or {}).items()}
        if name == CompanionDFlashProxy.name:  # priced per block, with its injection costs
            inject = {int(k): v for k, v in ((info.get("hidden_inject_costs") or {}).get(name) or {}).items()}
            block_size = int(((info.get("hidden") or {}).get(name) or {}).get("block_size", 16))
            return lambda p: CompanionDFlashProxy(p, client, table, ack_sink, inject, block_size)
        return lambda p: CompanionHiddenProxy(name, p, client, table, ack_sink)

    return {n: builder(n) for n in names}
