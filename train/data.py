"""Self-distillation data: what the target says, and what it computes while saying it.

1. Answers: every training prompt goes through specray's own engine (the
   default chain: speculation is lossless, so the answers are the target's),
   once greedy and `gen.sampled` times sampled at `gen.temperature`, in a
   seeded shuffled order so that a time budget cut still covers every category.
   Prompts over `gen.max_prompt` tokens get no answer (each would be decoded
   twice for one).
2. Rows: each prompt + answer is decoded once more in a plain context with the
   hidden-row taps of the head's three layers on (native/hidden.py, as the
   serving target does) and logits on: per position the three layer inputs
   (float16) and the target's top token (the label: greedy drafts are accepted
   when they are the target's top tokens). With `gen.learn_prompts` the head
   also learns on prompt positions (the target's top tokens after text it
   did not write, the way EAGLE trained on a fixed data set's
   conversations), and once the answers are done a prompt too long to answer
   is decoded alone while the budget lasts.

Shards (`work_dir/data/shard-NNNNN.npz`) are written every few answers; a run
that finds them skips the answers they hold (resume).
"""

from __future__ import annotations

import glob
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .config import TrainConfig
from .prompts import TrainPrompt

F16_MAX = 65000.0  # the target's residual stream has outliers near 2.5e4 (SmolLM2 layer 27): clip, not inf


@dataclass
class Sample:
    """One training sequence: tokens x_0..x_{T-1}, the target's rows at each position, its top token there."""

    tokens: np.ndarray  # int32 [T]
    feats: np.ndarray  # float16 [T, 3 x target width]
    labels: np.ndarray  # int32 [T]: the target's top token at each position (it predicts x_{p+1})
    answer_from: int  # the first position whose label predicts an answer token (prompt length - 1, cut; the
    # sequence's length for a prompt kept with no answer)
    category: str = ""
    prompt: int = -1  # the prompt's index in the run's list: its answers share a side of the validation split


def jobs_for(prompts: list[TrainPrompt], sampled: int, seed: int) -> list[tuple[int, int]]:
    """(prompt index, answer kind: 0 greedy, k >= 1 the k-th sampled) for every answer, shuffled by `seed`.

    >>> sorted(jobs_for([TrainPrompt("a"), TrainPrompt("b")], 1, 0))
    [(0, 0), (0, 1), (1, 0), (1, 1)]
    """
    jobs = [(i, k) for i in range(len(prompts)) for k in range(sampled + 1)]
    random.Random(seed).shuffle(jobs)
    return jobs


def done_jobs(data_dir: str, sampled: int) -> set[tuple[int, int]]:
    """The answer jobs the shards hold; a prompt kept with no answer (too long, `gen.learn_prompts`) stands for
    all of its jobs."""
    done = set()
    for path in sorted(glob.glob(os.path.join(data_dir, "shard-*.npz"))):
        with np.load(path) as z:
            for (a, b), n, start in zip(z["jobs"], z["lens"], z["answer_from"]):
                done.update(((int(a), k) for k in range(sampled + 1)) if start >= n else [(int(a), int(b))])
    return done


def generate(cfg: TrainConfig, prompts: list[TrainPrompt], layers: tuple[int, ...], data_dir: str,
             progress=print) -> None:
    """Write the shards of every answer not written yet (stops at the gen.minutes budget), to the prompts and to
    gen.self_prompts more the target writes itself first (self_prompts.py; their time counts in the budget).
    Prompts longer than gen.max_prompt are skipped; one longer than gen.max_len - 64 tokens keeps its end."""
    from specray.deployments.local_engine import LocalEngine
    from specray.engine.config import ChainConfig, EngineConfig
    from specray.engine.sampling import SamplingParams

    from .self_prompts import write_self_prompts

    os.makedirs(data_dir, exist_ok=True)
    # the budget counts every run's generating time: a run that resumes to train more does not generate again
    clock = os.path.join(data_dir, "generating_seconds.txt")
    spent = float(open(clock).read()) if os.path.exists(clock) else 0.0
    own_path = os.path.join(data_dir, "self_prompts.jsonl")
    if not cfg.gen.self_prompts or os.path.exists(own_path):
        jobs = jobs_for(_with_own(prompts, cfg, own_path), cfg.gen.sampled, cfg.seed)
        todo = [j for j in jobs if j not in done_jobs(data_dir, cfg.gen.sampled)]
        if not todo:
            progress(f"data: all {len(jobs)} answers already in {data_dir}")
            return
    if cfg.gen.minutes and spent >= 60 * cfg.gen.minutes:
        progress(f"data: the {cfg.gen.minutes:g} min generating budget is spent")
        return
    max_prompt = cfg.gen.max_len - 64
    seq_cells = max_prompt + cfg.gen.max_tokens + 64  # a prompt and its answer
    # flash attention: in one unified KV cache a row attends every slot's cells unless it is on (llama.cpp's CPU
    # kernel skips masked cells), and long prompts in 8 slots made generation 10x slower without it (measured).
    # Plain decoding: 8 slots of sampled 256-token answers made 120 tok/s here, 128 with the default chain
    # (a wash: a verify row costs nearly a sequence's next token at 8 rows), and 16-48 slots 87-100 (each row
    # of the flash-attention kernel walks the whole unified cache)
    eng = LocalEngine(EngineConfig(model=cfg.target, slots=cfg.gen.slots, n_ctx=cfg.gen.slots * seq_cells,
                                   threads=cfg.threads, prompt_cache=False, flash_attn=True,
                                   chain=ChainConfig(speculators=[])))
    t0 = time.monotonic()
    rows = None
    try:
        if cfg.gen.self_prompts and not os.path.exists(own_path):
            write_self_prompts(eng, cfg.gen.self_prompts, own_path, seed=cfg.seed, temperature=cfg.gen.temperature,
                               deadline=t0 + 60 * cfg.gen.minutes - spent if cfg.gen.minutes else None,
                               progress=progress)
        prompts = _with_own(prompts, cfg, own_path)
        jobs = jobs_for(prompts, cfg.gen.sampled, cfg.seed)
        done = done_jobs(data_dir, cfg.gen.sampled)
        todo = [j for j in jobs if j not in done]
        progress(f"data: {len(done)} of {len(jobs)} answers already there; generating {len(todo)} "
                 f"({cfg.gen.slots} at once, at most {cfg.gen.max_tokens} tokens each"
                 + (f", {cfg.gen.minutes:g} min budget)" if cfg.gen.minutes else ")"))
        rows = RowReader(eng.model, layers, seq_cells, cfg.threads)
        shard = len(glob.glob(os.path.join(data_dir, "shard-*.npz")))
        made, tokens, rows_only = 0, 0, []
        if cfg.gen.max_prompt:
            # a long prompt is paid twice (prefill, then the rows pass) for one answer: Spec-Bench's summarization
            # and rag prompts (~800 tokens) held answers to 38 tok/s on 2 cores, against 100+ with short prompts
            plen = {pi: len(eng.prompt_tokens(prompts[pi].prompt, prompts[pi].messages))
                    for pi in {j[0] for j in todo}}
            long_ = {pi for pi, n in plen.items() if n > cfg.gen.max_prompt}
            if long_ and cfg.gen.learn_prompts:
                rows_only = sorted({pi for pi, kind in todo if pi in long_})
            if long_:
                todo = [j for j in todo if j[0] not in long_]
                progress(f"data: no answers to {len(long_)} prompts longer than {cfg.gen.max_prompt} tokens "
                         f"(--max-prompt-tokens); {len(todo)} answers to generate")
        chunk = 3 * cfg.gen.slots  # queued beyond the slots: a finished answer's slot is refilled at once
        t_ans = time.monotonic()
        for c in range(0, len(todo), chunk):
            if cfg.gen.minutes and spent + time.monotonic() - t0 > 60 * cfg.gen.minutes:
                progress(f"data: time budget reached after {made} answers")
                break
            part = todo[c : c + chunk]
            reqs = []
            for pi, kind in part:
                p = prompts[pi]
                s = SamplingParams(temperature=0.0) if kind == 0 else SamplingParams(
                    temperature=cfg.gen.temperature, seed=cfg.seed * 100003 + pi * 17 + kind)
                req = eng.request(p.prompt, p.messages, max_tokens=cfg.gen.max_tokens, sampling=s)
                if len(req.prompt_tokens) > max_prompt:
                    req.prompt_tokens = req.prompt_tokens[-max_prompt:]
                reqs.append(req)
            seqs = eng.run(reqs)
            samples = []
            for (pi, _), req, seq in zip(part, reqs, seqs):
                toks = np.concatenate([req.prompt_tokens, np.asarray(seq.generated, dtype=np.int32)])
                samples.append(rows.sample(toks, len(req.prompt_tokens), cfg.gen.max_len, prompts[pi].category))
                tokens += len(seq.generated)
            save_shard(os.path.join(data_dir, f"shard-{shard:05d}.npz"), samples, part)
            with open(clock, "w") as f:
                f.write(f"{spent + time.monotonic() - t0:.1f}")
            shard += 1
            made += len(part)
            dt = time.monotonic() - t_ans
            eta = dt / made * (len(todo) - made)
            progress(f"data: {len(done) + made}/{len(jobs)} answers, {tokens} tokens this run, "
                     f"{tokens / dt:.0f} tok/s, elapsed {dt / 60:.1f} min, ETA {eta / 60:.1f} min")
        # after the answers, with what is left of the budget: the target's own text comes first
        kept = _prompts_only(eng, rows, prompts, rows_only, cfg.gen.max_len, data_dir, shard,
                             lambda: bool(cfg.gen.minutes) and spent + time.monotonic() - t0 > 60 * cfg.gen.minutes)
        if rows_only:
            progress(f"data: {kept} of {len(rows_only)} prompts longer than {cfg.gen.max_prompt} tokens "
                     f"(--max-prompt-tokens) kept as prompts only, with no answer")
    finally:
        with open(clock, "w") as f:
            f.write(f"{spent + time.monotonic() - t0:.1f}")
        if rows is not None:
            rows.close()
        eng.close()


def _prompts_only(eng, rows: RowReader, prompts: list[TrainPrompt], pis: list[int], max_len: int, data_dir: str,
                  shard: int, over: Callable[[], bool]) -> int:
    """Shards of prompts with no answer (their first max_len tokens: one rows pass, a prefill, each), whose
    positions the head learns on with gen.learn_prompts, until `over()`. Returns how many were kept.

    A prefill with every position's logits and rows ran at about 210 tokens/s here (SmolLM2, 2 cores), an
    answer at about 80 with its rows pass: cheaper text, but not the target's own."""
    kept = 0
    for c in range(0, len(pis), 16):
        if over():
            break
        part = [(pi, 0) for pi in pis[c : c + 16]]
        samples = []
        for pi, _ in part:
            toks = eng.prompt_tokens(prompts[pi].prompt, prompts[pi].messages)[:max_len]
            samples.append(rows.sample(toks, len(toks) + 1, max_len, prompts[pi].category))
        save_shard(os.path.join(data_dir, f"shard-{shard + c // 16:05d}.npz"), samples, part)
        kept += len(part)
    return kept


def _with_own(prompts: list[TrainPrompt], cfg: TrainConfig, own_path: str) -> list[TrainPrompt]:
    """The run's prompts: the file's, then the target's own (once written)."""
    from .self_prompts import read_self_prompts

    if cfg.gen.self_prompts and os.path.exists(own_path):
        return prompts + read_self_prompts(own_path)
    return prompts


class RowReader:
    """The target's layer-input rows and top tokens of whole sequences, in a context of its own."""

    def __init__(self, model, layers: tuple[int, ...], n_ctx: int, threads: int, n_batch: int = 512) -> None:
        from specray.native.context import Context
        from specray.native.hidden import HiddenOutput

        self.ctx = Context(model, n_ctx=n_ctx, n_seq_max=1, n_batch=n_batch, n_threads=threads)
        self.out = HiddenOutput(self.ctx, tuple(layers))
        self.out.set_enabled(True)
        self.n_batch = n_batch

    def rows(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows [T, width] float32, the target's top token [T]) of `tokens` decoded from position 0."""
        ctx = self.ctx
        ctx.clear_seq(0)
        feats = np.empty((len(tokens), self.out.width), dtype=np.float32)
        top = np.empty(len(tokens), dtype=np.int32)
        for i in range(0, len(tokens), self.n_batch):
            part = tokens[i : i + self.n_batch]
            ctx.batch.clear()
            ctx.batch.add_seq(0, np.asarray(part, dtype=np.int32), i, len(part))
            logits = ctx.decode()
            top[i : i + len(part)] = logits.argmax(axis=1)
            feats[i : i + len(part)] = self.out.rows(len(part))
        return feats, top

    def sample(self, tokens: np.ndarray, prompt_len: int, max_len: int, category: str) -> Sample:
        feats, top = self.rows(tokens)
        cut = max(0, len(tokens) - max_len)
        return Sample(tokens=np.asarray(tokens[cut:], dtype=np.int32),
                      feats=np.clip(feats[cut:], -F16_MAX, F16_MAX).astype(np.float16),
                      labels=top[cut:], answer_from=max(0, prompt_len - 1 - cut), category=category)

    def close(self) -> None:
        self.ctx.close()


def save_shard(path: str, samples: list[Sample], jobs: list[tuple[int, int]]) -> None:
    lens = np.array([len(s.tokens) for s in samples], dtype=np.int64)
    tmp = path + ".part.npz"
    np.savez(tmp, jobs=np.array(jobs, dtype=np.int64).reshape(-1, 2), lens=lens,
             tokens=np.concatenate([s.tokens for s in samples]), feats=np.concatenate([s.feats for s in samples]),
             labels=np.concatenate([s.labels for s in samples]),
             answer_from=np.array([s.answer_from for s in samples], dtype=np.int64),
             categories=np.array([s.category for s in samples]))
    os.replace(tmp, path)


def load_samples(data_dir: str) -> list[Sample]:
    out = []
    for path in sorted(glob.glob(os.path.join(data_dir, "shard-*.npz"))):
        with np.load(path) as z:
            ends = np.cumsum(z["lens"])
            starts = ends - z["lens"]
            tokens, feats, labels = z["tokens"], z["feats"], z["labels"]
            for i, (a, b) in enumerate(zip(starts, ends)):
                out.append(Sample(tokens[a:b], feats[a:b], labels[a:b], int(z["answer_from"][i]),
                                  str(z["categories"][i]), int(z["jobs"][i][0])))
    return out
