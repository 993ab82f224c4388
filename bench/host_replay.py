"""`specray bench --host-replay TABLE`: the round's host cost with the target's decode replayed, not run.

Why: on a small shared CPU VM the host work of a round runs several times slower inside a real run than the
same code run back to back. It is not llama_decode's weight streaming alone: any pause of a CPU decode's
length, even a busy spin that touches no memory, leaves the next round's Python and numpy work slower (the
VM's caches do not stay ours while the round waits; a GPU host waiting the short time of its decode keeps
them). So the host figures of a CPU run are mostly that machine's, and the "host cost per round on a GPU"
question needs the decode replaced by a wait of the GPU's length.

How: one real `none` pass records every prompt's greedy tokens. Then each configuration runs the same prompts
on its own engine whose context's `decode` is a `ReplayDecode`: it busy-waits the table's time for the batch's
rows (a CUDA host thread spins in its stream sync likewise) and returns logits rows whose argmax is the
recorded next token of each row's sequence. Verification then accepts exactly the draft tokens the real
target would have (greedy: the token at a position depends only on the committed tokens before it), so every
configuration's output must equal the recording (checked), and the drafts, the planner, the acceptance
trackers and the bookkeeping all do what they would do against a target that fast. The cost model is the
table itself (not learnt), so the planner prices drafts at the replayed decode's cost.

It replays greedy decoding of attention targets only: hidden-state heads need the target's hidden rows,
which no stand-in has (refused).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

#: an H100's SmolLM2-135M decode time in ms by batch rows (`--host-replay h100`; the GPU runs in
#: docs/benchmarks.md)
H100_MS = {1: 1.6, 2: 2.5, 4: 2.5, 8: 2.5, 16: 4.0, 32: 7.0, 256: 30.0}


def parse_table(text: str, measured: dict[int, float] | None = None) -> dict[int, float]:
    """Milliseconds of one decode by batch rows: `h100` (H100_MS), `measured` (this run's calibrated CPU
    decode: `measured`, in ms) or `ROWS:MS,...`. ValueError names what is wrong.

    >>> parse_table("1:2,8:3.5")
    {1: 2.0, 8: 3.5}
    >>> parse_table("h100")[1]
    1.6
    """
    if text == "h100":
        return dict(H100_MS)
    if text == "measured":
        if not measured:
            raise ValueError("--host-replay measured: no calibrated decode costs (calibration is off)")
        return dict(measured)
    table = {}
    for part in text.split(","):
        rows, sep, ms = part.partition(":")
        try:
            n, v = int(rows), float(ms)
        except ValueError:
            n, v = 0, -1.0
        if not sep or n < 1 or v <= 0:
            raise ValueError(f"--host-replay {text!r}: expected h100, measured or ROWS:MS,... with ROWS >= 1 "
                             f"and MS > 0 (bad part {part!r})")
        table[n] = v
    return dict(sorted(table.items()))


def spin(seconds: float) -> None:
    """Busy-wait: what a host thread waiting on its GPU stream does (and it keeps the core's caches)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class ReplayDecode:
    """A stand-in for Context.decode: waits `wait(n_tokens)` seconds, then returns one logits row per output
    row of the batch, whose argmax is the next recorded token of that row's sequence (`eos` past the end).

    >>> class B:  # a llama batch: tokens 5, 6 of sequence 0 at positions 2, 3, both with logits
    ...     n_tokens = 2; pos = np.array([2, 3]); seq_ids = np.array([0, 0]); logits = np.array([1, 1])
    >>> d = ReplayDecode(n_vocab=10, n_batch=4, eos=9, wait=lambda n: 0.0)
    >>> d.expect(0, np.array([1, 2, 5, 7]))
    >>> d(B()).argmax(axis=1).tolist()   # position 2 predicts position 3's token, position 3 is the last
    [7, 9]
    """

    def __init__(self, n_vocab: int, n_batch: int, eos: int, wait: Callable[[int], float]) -> None:
        self.eos, self.wait = eos, wait
        self.buf = np.zeros((n_batch, n_vocab), dtype=np.float32)
        self.truth: dict[int, np.ndarray] = {}
        self._hot: list[tuple[int, int]] = []  # cells set to 1 by the last call, zeroed by the next
        self._until = 0.0  # when the launched decode's time is up
        self.decodes = 0

    def expect(self, seq_id: int, tokens: np.ndarray) -> None:
        """The whole token stream (prompt, then output) the sequence in `seq_id` will produce."""
        self.truth[seq_id] = np.asarray(tokens)

    def share(self, src: int, dst: int) -> None:
        """Sequence `dst` sees `src`'s cells (a draft tree's branch id, copied from its slot each round): its
        rows are that sequence's. A node off the recorded path gets a row no walk reads: a verify enters a
        branch only where its token is the recorded one."""
        if src in self.truth:
            self.truth[dst] = self.truth[src]

    def __call__(self, batch) -> np.ndarray:
        self.launch(batch)
        return self.logits(len(self._hot))

    def launch(self, batch) -> None:
        """Context.launch: the decode starts (a GPU's returns once queued); `logits` waits out its time."""
        self._until = time.perf_counter() + self.wait(batch.n_tokens)
        for r, c in self._hot:
            self.buf[r, c] = 0.0
        self._hot.clear()
        rows = np.flatnonzero(batch.logits[: batch.n_tokens])
        for r, i in enumerate(rows):
            t = self.truth[int(batch.seq_ids[i])]
            p = int(batch.pos[i]) + 1
            c = int(t[p]) if p < len(t) else self.eos
            self.buf[r, c] = 1.0
            self._hot.append((r, c))
        self.decodes += 1

    def logits(self, n_outputs: int) -> np.ndarray:
        """Context.logits: busy-waits until the launched decode's time is up (a host thread waiting on its
        GPU stream), then its rows."""
        spin(self._until - time.perf_counter())
        return self.buf[:n_outputs]


@dataclass
class ReplayResult:
    config: str
    tokens: int = 0
    seconds: float = 0.0
    identical: int = 0
    compared: int = 0
    stages: dict = field(default_factory=dict)  # round_stages.breakdown of the replayed rounds
    rounds: int = 0
    drafted: int = 0  # draft rows sent to the target (a tree's nodes)
    tree_share: float = 0.0  # of the rounds with a draft, those that sent a draft tree
    runner_ups_taken: int = 0  # trees whose accepted path left the main draft

    def to_dict(self) -> dict:
        return {"config": self.config, "tokens": self.tokens, "seconds": self.seconds,
                "tokens_per_s": self.tokens / self.seconds if self.seconds else None,
                "identical": self.identical, "compared": self.compared, "rounds": self.rounds,
                "drafted": self.drafted, "tree_round_share": self.tree_share,
                "runner_ups_taken": self.runner_ups_taken, **self.stages}


def replay_config(engine, name: str, requests: list, truth: list[np.ndarray], table: dict[int, float],
                  profiler=None) -> ReplayResult:
    """Run `requests` on `engine` (its own chain, nothing run on it yet) with its decode replayed from `truth`
    (each request's recorded prompt + output) at the table's times. `profiler` (round_profile.RoundProfiler):
    cProfile on during each round."""
    from specray.engine.cost import DecodeCostModel
    from specray.engine.round_stages import breakdown

    by_prompt = {r.prompt_tokens.tobytes(): t for r, t in zip(requests, truth)}
    # one model for the wait and the planner's price: the engine's own interpolation of a decode table
    cost = DecodeCostModel({n: ms / 1e3 for n, ms in table.items()}, learn=False)
    decode = ReplayDecode(engine.model.n_vocab, engine.ctx.n_batch, engine.model.eos, cost.cost)
    runner = engine.runner
    start = runner.start

    def start_expecting(seq_id, params, prompt, *rest, **named):
        decode.expect(seq_id, by_prompt[np.asarray(prompt, dtype=np.int32).tobytes()])
        return start(seq_id, params, prompt, *rest, **named)

    runner.start = start_expecting
    # instance attributes shadow the methods: TargetRunner calls ctx.decode(batch), or launch then logits
    engine.ctx.decode, engine.ctx.launch, engine.ctx.logits = decode, decode.launch, decode.logits
    if engine.scheduler.overlap:  # a GPU's decode returns once queued: the overlapped work runs on this thread
        engine.scheduler.use_overlap(decode_blocks=False)
    seq_cp, slots = engine.ctx.seq_cp, engine.config.slots

    def seq_cp_sharing(src, dst, p0=-1, p1=-1):
        if dst >= slots:  # a tree's branch id (slot to slot copies are the prefix cache's, off in the bench)
            decode.share(src, dst)
        return seq_cp(src, dst, p0, p1)

    engine.ctx.seq_cp = seq_cp_sharing
    engine.scheduler.cost = cost
    st = engine.scheduler.stats
    t0 = time.perf_counter()
    if profiler is None:
        seqs = engine.run(requests)
    else:
        seqs = [engine.submit(r) for r in requests]
        while engine.scheduler.has_work():
            with profiler.round(name):
                engine.step()
    res = ReplayResult(name, seconds=time.perf_counter() - t0)
    res.tokens = sum(len(s.generated) for s in seqs)
    res.compared = len(seqs)
    res.identical = sum(np.array_equal(s.generated, t[len(r.prompt_tokens):])
                        for s, r, t in zip(seqs, requests, truth))
    res.stages = breakdown(st.stage_seconds, st.rounds, st.seq_rounds)
    res.rounds, res.drafted = st.rounds, sum(s.spec_total.drafted for s in seqs)
    trees = engine.scheduler.policy.trees.snapshot()
    res.tree_share = trees["tree_round_share"]
    res.runner_ups_taken = sum(sum(c["accepted_by_rank"][1:]) for c in trees["by_speculator"].values())
    return res


def table_text(results: list[ReplayResult], table: dict[int, float]) -> str:
    from specray.engine.round_stages import STAGES

    stages = [s for s in STAGES if s != "decode"]
    head = (f"== host replay: the target's decode replaced by a wait of "
            f"{', '.join(f'{n} rows {ms:g} ms' for n, ms in table.items())}; host ms per round by stage ==")
    lines = [head, f"{'config':<38}{'tok/s':>8}{'same':>6}{'drafted':>8}{'rounds':>7}{'trees':>6}"
             + "".join(f"{s:>{max(9, len(s) + 1)}}" for s in stages) + f"{'host':>8}{'host/seq':>9}"]
    for r in results:
        ms = r.stages.get("ms_per_round", {})
        lines.append(f"{r.config:<38}{r.tokens / r.seconds if r.seconds else 0:>8.1f}"
                     f"{f'{r.identical}/{r.compared}':>6}{r.drafted:>8}{r.rounds:>7}"
                     f"{f'{100 * r.tree_share:.0f}%' if r.tree_share else '-':>6}"
                     + "".join(f"{ms.get(s, 0.0):>{max(9, len(s) + 1)}.3f}" for s in stages)
                     + f"{r.stages.get('host_ms_per_round') or 0:>8.3f}{r.stages.get('host_ms_per_seq_round') or 0:>9.3f}")
    return "\n".join(lines)


def run_host_replay(engine, configs: list[str], prompts: list, max_tokens: int, table: dict[int, float],
                    config_engine: Callable[[str], object], progress=print, profiler=None) -> list[ReplayResult]:
    """The replay bench: `engine` (no speculators) records every prompt's greedy output for real, then each
    configuration runs them all, queued, on `config_engine(config)` (a fresh engine on the same model) with
    its decode replayed (`profiler`: cProfile on during each replayed round, not the recording). ValueError
    for what cannot be replayed."""
    if engine.model.memory_kind != "attention":
        raise ValueError("--host-replay replays attention targets only (a recurrent state cannot be replayed)")
    if any(p.json_schema is not None or p.grammar is not None for p in prompts):
        raise ValueError("--host-replay runs prompts without grammars only")
    requests = lambda eng: [eng.request(p.prompt, p.messages, max_tokens=max_tokens) for p in prompts]
    t0 = time.perf_counter()
    reqs = requests(engine)
    seqs = engine.run(reqs)
    truth = [np.concatenate([r.prompt_tokens, np.asarray(s.generated, dtype=np.int32)]) for r, s in zip(reqs, seqs)]
    progress(f"host replay: recorded {len(seqs)} prompts' greedy output for real in {time.perf_counter() - t0:.1f} s")
    results = []
    for c in configs:
        eng = config_engine(c)
        try:
            if eng.chain.needs_hidden(tuple(eng.config.chain.speculators)):
                raise ValueError(f"--host-replay cannot replay {c}: hidden-state heads need the target's hidden rows")
            results.append(replay_config(eng, c, requests(eng), truth, table, profiler))
        finally:
            eng.close()
        r = results[-1]
        progress(f"host replay: {c}: {r.tokens / r.seconds:.1f} tok/s, host {r.stages['host_ms_per_round'] or 0:.3f} "
                 f"ms a round, identical {r.identical}/{r.compared}")
    return results
