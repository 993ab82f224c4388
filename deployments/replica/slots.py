"""Slots and streams, on the round thread: posted ops (submit, cancel, call) in, round events out.

`Slots` is the only code that pairs scheduler sequences with their callers'
streams. A submission is answered (admitted, 429 queue full, 503 target down,
400) at the top of the round after it was posted; a cancellation frees the
slot and its KV cells there too; a round's events become stream items, handed to each stream's sink
(sinks.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from time import perf_counter

from specray.engine.request import Sequence, SeqState
from specray.engine.scheduler import Event, QueueFullError, Scheduler

from .errors import BadRequest, ClientGone, EngineFailure, QueueFull, ServeError, Unavailable
from .sinks import call_in_loop
from .stream_items import StreamDelta, StreamError
from .streams import Op, Stream, end_info, logprob_entries, prompt_logprob_entries, resolve

log = logging.getLogger("specray.router")


@dataclass
class ReliabilityStats:
    cancelled: int = 0  # sequences cancelled because their caller went away
    cancel_rounds_max: int = 0  # rounds between a cancel being posted and applied (at most 1 by design)
    rejected_queue_full: int = 0
    rejected_target_down: int = 0
    failed_target_lost: int = 0  # sequences failed because the target actor died under them
    round_failures: int = 0  # rounds that raised for another reason (bug): their sequences got a 500
    truncated_prompts: int = 0


class Slots:
    def __init__(self, scheduler: Scheduler, rel: ReliabilityStats) -> None:
        self.scheduler = scheduler
        self.rel = rel
        self.streams: dict[str, Stream] = {}
        self.observer = None  # metrics.EngineMetrics (set by the replica): told of every finished request
        # overlapped rounds deliver events while the target decodes (Scheduler.use_overlap): a cancel they find
        # (a stream abandoned, a client gone) waits in this list for the round's end, when the target may be
        # touched again (apply_cancels); None: cancels apply at once
        self.cancels_later: list[Sequence] | None = None

    def apply(self, op: Op, target_ready: bool = True) -> None:
        if op.kind == "submit":
            self._submit(op, target_ready)
        elif op.kind == "cancel":
            self._cancel(op)
        elif op.kind == "call":
            try:
                op.result.append((True, op.fn()))
            except Exception as e:
                op.result.append((False, e))
            op.done.set()

    def _submit(self, op: Op, target_ready: bool) -> None:
        loop = op.stream.loop

        def refuse(e: ServeError) -> None:
            call_in_loop(loop, resolve, op.future, None, e)

        if not target_ready:
            self.rel.rejected_target_down += 1
            return refuse(Unavailable("the target model is restarting; retry shortly", code="target_unavailable"))
        try:
            seq = self.scheduler.submit(op.req)
        except QueueFullError as e:
            self.rel.rejected_queue_full += 1
            return refuse(QueueFull(str(e)))
        except ValueError as e:
            return refuse(BadRequest(str(e)))
        except Exception as e:
            log.exception("submit failed")
            return refuse(EngineFailure(f"internal error: {e}"))
        if op.stream.abandoned:
            self.scheduler.cancel(seq)
            return
        op.stream.seq = seq
        self.streams[seq.id] = op.stream
        call_in_loop(loop, resolve, op.future, seq)

    def _cancel(self, op: Op) -> None:
        self.streams.pop(op.seq.id, None)
        if op.seq.finished:
            return
        self.rel.cancelled += 1
        self.rel.cancel_rounds_max = max(self.rel.cancel_rounds_max, self.scheduler.rounds_run - op.round_posted)
        try:
            self.scheduler.cancel(op.seq)
        except Exception:
            log.exception("cancel failed")
        if op.seq.finished:  # cancelled while queued: no round will report it
            self.finished(op.seq)

    def event(self, ev: Event) -> None:
        """A round's event for one sequence: its new text (with its logprob entries where asked for) to the
        stream's sink, then, finished, the end or a 500 error item."""
        if ev.finished:
            self.finished(ev.seq)
        st = self.streams.get(ev.seq.id)
        if st is None:
            return
        if st.abandoned:
            del self.streams[ev.seq.id]
            if not ev.seq.finished:
                self._cancel_seq(ev.seq)
            return
        if ev.logprobs is None and not ev.prompt_logprobs:
            if ev.text and not st.sink.write(StreamDelta(ev.text, perf_counter())):
                return self._gone(ev.seq, st)
        elif ev.text or len(ev.logprobs if ev.logprobs is not None else ()) or ev.prompt_logprobs:
            piece = self.scheduler.tok.token_to_piece
            lps = logprob_entries(ev.logprobs, ev.tokens, piece) if ev.logprobs is not None else None
            # echo: the prompt's entries, once, with the first tokens
            plps = (prompt_logprob_entries(ev.prompt_logprobs, ev.seq.req.prompt_tokens, piece)
                    if ev.prompt_logprobs else None)
            if not st.sink.write(StreamDelta(ev.text, perf_counter(), lps, plps)):
                return self._gone(ev.seq, st)
        if ev.finished:
            del self.streams[ev.seq.id]
            if ev.error is None:
                st.sink.end(end_info(ev.seq))
            else:  # a sequence the target could not go on with (a state it could not roll back)
                st.sink.error(StreamError(EngineFailure(ev.error, code="target_state_error")))

    def _gone(self, seq: Sequence, st: Stream) -> None:
        """The sink found nobody reading (the client's connection broken): free the slot now, as a cancel
        would, and end the stream (its loop may not have seen the disconnect yet)."""
        self.streams.pop(seq.id, None)
        if not seq.finished:
            self.rel.cancelled += 1
            self._cancel_seq(seq)
        st.sink.error(StreamError(ClientGone("the client closed the connection")))

    def _cancel_seq(self, seq: Sequence) -> None:
        """Cancel a sequence its caller no longer reads: now, or at the round's end (cancels_later)."""
        if self.cancels_later is not None:
            self.cancels_later.append(seq)
        else:
            self._cancel_now(seq)

    def apply_cancels(self) -> None:
        """The cancels an overlapped round's deliveries held back (cancels_later), applied between rounds."""
        if not self.cancels_later:
            return
        seqs, self.cancels_later = self.cancels_later, []
        for seq in seqs:
            self._cancel_now(seq)

    def _cancel_now(self, seq: Sequence) -> None:
        """Free the slot of a sequence still running (one finished meanwhile keeps its end) and tell the
        observer it ended."""
        if not seq.finished:
            try:
                self.scheduler.cancel(seq)
            except Exception:
                log.exception("cancel failed")
        if seq.finished:
            self.finished(seq)

    def finished(self, seq: Sequence) -> None:
        """Tell the observer once per request (a queued request cancelled never reaches a round)."""
        if self.observer is None or getattr(seq, "observed", False):
            return
        seq.observed = True
        try:
            self.observer.request_finished(seq)
        except Exception:  # metrics never stop the rounds
            log.exception("metrics update failed")

    def fail(self, seqs: list[Sequence], error: ServeError) -> None:
        """End these sequences' streams with `error` and free their slots."""
        for seq in seqs:
            st = self.streams.pop(seq.id, None)
            if st is not None:
                st.sink.error(StreamError(error))
            if not seq.finished:
                try:
                    self.scheduler.cancel(seq)
                except Exception:
                    log.exception("cancel of a failed sequence failed")

    def running(self) -> list[Sequence]:
        """Sequences past the queue whose callers still wait: the active ones, and any a failed
        round finished without delivering its end."""
        seqs = list(self.scheduler.active.values())
        seqs += [st.seq for st in self.streams.values()
                 if st.seq is not None and st.seq.state != SeqState.QUEUED and st.seq not in seqs]
        return seqs
