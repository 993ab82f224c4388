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
    # (a --text piece's is negative: text_piece_id)
    soft_ids: np.ndarray | None = None  # int32 [T, K]: with gen.soft_labels, the target's K likeliest tokens
    soft_p: np.ndarray | None = None  # float16 [T, K]: their probabilities


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
    # kernel skips masked cells): without it long prompts in many slots make generation many times slower.
    # Plain decoding, not the default chain: at 8 slots a verify row costs nearly a sequence's next token, so
    # drafts gain little; and more slots do not pay (each row of the flash-attention kernel walks the whole
    # unified cache)
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
        already = len(jobs) - len(todo)
        progress(f"data: {already} of {len(jobs)} answers already there; generating {len(todo)} "
                 f"({cfg.gen.slots} at once, at most {cfg.gen.max_tokens} tokens each"
                 + (f", {cfg.gen.minutes:g} min budget)" if cfg.gen.minutes else ")"))
        rows = RowReader(eng.model, layers, seq_cells, cfg.threads, soft_k=cfg.gen.soft_labels)
        shard = len(glob.glob(os.path.join(data_dir, "shard-*.npz")))
        made, tokens, rows_only = 0, 0, []
        if cfg.gen.max_prompt:
            # a long prompt is paid twice (prefill, then the rows pass) for one answer: long prompts (Spec-Bench's
            # summarization and rag, ~800 tokens) make answers come several times slower than short ones
            plen = {pi: len(eng.prompt_tokens(prompts[pi].prompt, prompts[pi].messages))
                    for pi in {j[0] for j in todo}}
            long_ = {pi for pi, n in plen.items() if n > cfg.gen.max_prompt}
            if long_ and cfg.gen.learn_prompts:
                rows_only = sorted({pi for pi, kind in todo if pi in long_})
            if long_:
                todo = [j for j in todo if j[0] not in long_]
                progress(f"data: no answers to {len(long_)} prompts longer than {cfg.gen.max_prompt} tokens "
                         f"(--max-prompt-tokens); {len(todo)} answers to generate")
        pieces = _text_pieces(eng.model, cfg, done) if cfg.gen.text else iter(())

        def over() -> bool:  # the generating budget (gen.minutes) is spent
            return bool(cfg.gen.minutes) and spent + time.monotonic() - t0 > 60 * cfg.gen.minutes

        if cfg.gen.rows_minutes:  # text with no answer first, for its own share of the budget
            rows_clock = os.path.join(data_dir, "rows_seconds.txt")
            rows_spent = float(open(rows_clock).read()) if os.path.exists(rows_clock) else 0.0
            t_rows = time.monotonic()

            def rows_over() -> bool:
                used = rows_spent + time.monotonic() - t_rows
                with open(rows_clock, "w") as f:
                    f.write(f"{used:.1f}")
                return over() or used > 60 * cfg.gen.rows_minutes

            shard, n_rows = _rows_only(eng, rows, prompts, rows_only, pieces, cfg.gen.max_len, data_dir, shard,
                                       rows_over, progress)
            rows_only = []
            progress(f"data: {n_rows} tokens of text with no answer in {(time.monotonic() - t_rows) / 60:.1f} min "
                     f"(--rows-minutes)")
        chunk = 3 * cfg.gen.slots  # queued beyond the slots: a finished answer's slot is refilled at once
        t_ans = time.monotonic()
        for c in range(0, len(todo), chunk):
            if over():
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
            progress(f"data: {already + made}/{len(jobs)} answers, {tokens} tokens this run, "
                     f"{tokens / dt:.0f} tok/s, elapsed {dt / 60:.1f} min, ETA {eta / 60:.1f} min")
        # after the answers, with what is left of the budget: the target's own text comes first
        if rows_only or cfg.gen.text:
            t_rows = time.monotonic()
            shard, n_rows = _rows_only(eng, rows, prompts, rows_only, pieces, cfg.gen.max_len, data_dir, shard,
                                       over, progress)
            progress(f"data: {n_rows} tokens of text with no answer after the answers, in "
                     f"{(time.monotonic() - t_rows) / 60:.1f} min")
    finally:
        with open(clock, "w") as f:
            f.write(f"{spent + time.monotonic() - t0:.1f}")
        if rows is not None:
            rows.close()
        eng.close()


def _rows_only(eng, rows: RowReader, prompts: list[TrainPrompt], pis: list[int], pieces, max_len: int,
              data_dir: str, shard: int, over: Callable[[], bool], progress) -> tuple[int, int]:
    """Shards of text with no answer, whose positions the head learns on with gen.learn_prompts, until `over()`:
    first the prompts `pis` (their first max_len tokens), then `pieces` ((prompt id, category, tokens) of the
    --text files, _text_pieces). One rows pass, a prefill, each. Returns (the next shard number, tokens kept).

    A prefill with every position's logits and rows is much faster per token than an answer with its rows
    pass: cheaper text, but not the target's own."""
    def items():
        for pi in pis:
            yield pi, prompts[pi].category, eng.prompt_tokens(prompts[pi].prompt, prompts[pi].messages)[:max_len]
        yield from pieces

    n_tokens, part, samples, t0 = 0, [], [], time.monotonic()
    todo = items()
    # the budget is checked before an item is taken: `pieces` goes on after the answers, and an item taken but
    # not decoded would be skipped there
    while not over():
        item = next(todo, None)
        if item is None:
            break
        pid, cat, toks = item
        samples.append(rows.sample(toks, len(toks) + 1, max_len, cat))
        part.append((pid, 0))
        n_tokens += len(toks)
        if len(part) == 16:
            save_shard(os.path.join(data_dir, f"shard-{shard:05d}.npz"), samples, part)
            shard, part, samples = shard + 1, [], []
            progress(f"data: {n_tokens} tokens of text with no answer, {n_tokens / (time.monotonic() - t0):.0f} "
                     "tok/s")
    if part:
        save_shard(os.path.join(data_dir, f"shard-{shard:05d}.npz"), samples, part)
        shard += 1
    return shard, n_tokens


def text_piece_id(file_index: int, piece: int) -> int:
    """The (negative) prompt id of piece `piece` of the run's file `file_index` (--text): stable across runs, so
    a resumed run skips the pieces its shards hold.

    >>> text_piece_id(0, 0), text_piece_id(2, 5)
    (-1, -2097158)
    """
    return -1 - ((file_index << 20) | piece)


def _text_pieces(model, cfg: TrainConfig, done: set[tuple[int, int]]):
    """(prompt id, category, tokens) of every --text piece not in `done`, files in a seeded order (a budget cut
    still samples all of them), each cut into gen.max_len-token pieces."""
    from .text import chunks, read_text, text_files

    files = text_files(cfg.gen.text)
    order = list(range(len(files)))
    random.Random(cfg.seed).shuffle(order)
    for fi in order:
        toks = model.tokenize(read_text(files[fi]), add_special=True)
        for ci, (a, b) in enumerate(chunks(len(toks), cfg.gen.max_len)):
            pid = text_piece_id(fi, ci)
            if (pid, 0) not in done:
                yield pid, "text", np.asarray(toks[a:b], dtype=np.int32)


def _with_own(prompts: list[TrainPrompt], cfg: TrainConfig, own_path: str) -> list[TrainPrompt]:
    """The run's prompts: the file's, then the target's own (once written)."""
    from .self_prompts import read_self_prompts

    if cfg.gen.self_prompts and os.path.exists(own_path):
        return prompts + read_self_prompts(own_path)
    return prompts


class RowReader:
    """The target's layer-input rows and top tokens of whole sequences, in a context of its own."""

    def __init__(self, model, layers: tuple[int, ...], n_ctx: int, threads: int, n_batch: int = 512,
                 soft_k: int = 0) -> None:
        from specray.native.context import Context
        from specray.native.hidden import HiddenOutput

        self.ctx = Context(model, n_ctx=n_ctx, n_seq_max=1, n_batch=n_batch, n_threads=threads)
        self.out = HiddenOutput(self.ctx, tuple(layers))
        self.out.set_enabled(True)
        self.n_batch = n_batch
        self.soft_k = soft_k

    def rows(self, tokens: np.ndarray):
        """(rows [T, width] float32, the target's top token [T], and with soft_k its top soft_k tokens [T, k]
        and their probabilities [T, k], else None, None) of `tokens` decoded from position 0."""
        from .labels import top_k_probs

        ctx = self.ctx
        ctx.clear_seq(0)
        n, k = len(tokens), self.soft_k
        feats = np.empty((n, self.out.width), dtype=np.float32)
        top = np.empty(n, dtype=np.int32)
        ids = np.empty((n, k), dtype=np.int32) if k else None
        probs = np.empty((n, k), dtype=np.float16) if k else None
        for i in range(0, n, self.n_batch):
            part = tokens[i : i + self.n_batch]
            ctx.batch.clear()
            ctx.batch.add_seq(0, np.asarray(part, dtype=np.int32), i, len(part))
            logits = ctx.decode()
            if k:
                ids[i : i + len(part)], probs[i : i + len(part)] = top_k_probs(logits, k)
                top[i : i + len(part)] = ids[i : i + len(part), 0]
            else:
                top[i : i + len(part)] = logits.argmax(axis=1)
            feats[i : i + len(part)] = self.out.rows(len(part))
        return feats, top, ids, probs

    def sample(self, tokens: np.ndarray, prompt_len: int, max_len: int, category: str) -> Sample:
        feats, top, ids, probs = self.rows(tokens)
        cut = max(0, len(tokens) - max_len)
        return Sample(tokens=np.asarray(tokens[cut:], dtype=np.int32),
                      feats=np.clip(feats[cut:], -F16_MAX, F16_MAX).astype(np.float16),
                      labels=top[cut:], answer_from=max(0, prompt_len - 1 - cut), category=category,
                      soft_ids=None if ids is None else ids[cut:], soft_p=None if probs is None else probs[cut:])

    def close(self) -> None:
        self.ctx.close()


def save_shard(path: str, samples: list[Sample], jobs: list[tuple[int, int]]) -> None:
    lens = np.array([len(s.tokens) for s in samples], dtype=np.int64)
    tmp = path + ".part.npz"
    soft = {}
    if all(s.soft_ids is not None for s in samples):
        soft = {"soft_ids": np.concatenate([s.soft_ids for s in samples]),
                "soft_p": np.concatenate([s.soft_p for s in samples])}
    np.savez(tmp, jobs=np.array(jobs, dtype=np.int64).reshape(-1, 2), lens=lens,
             tokens=np.concatenate([s.tokens for s in samples]), feats=np.concatenate([s.feats for s in samples]),
             labels=np.concatenate([s.labels for s in samples]),
             answer_from=np.array([s.answer_from for s in samples], dtype=np.int64),
             categories=np.array([s.category for s in samples]), **soft)
    os.replace(tmp, path)


def load_samples(data_dir: str) -> list[Sample]:
    out = []
    for path in sorted(glob.glob(os.path.join(data_dir, "shard-*.npz"))):
        with np.load(path) as z:
            ends = np.cumsum(z["lens"])
            starts = ends - z["lens"]
            tokens, feats, labels = z["tokens"], z["feats"], z["labels"]
            ids, probs = (z["soft_ids"], z["soft_p"]) if "soft_ids" in z else (None, None)
            for i, (a, b) in enumerate(zip(starts, ends)):
                out.append(Sample(tokens[a:b], feats[a:b], labels[a:b], int(z["answer_from"][i]),
                                  str(z["categories"][i]), int(z["jobs"][i][0]),
                                  None if ids is None else ids[a:b], None if probs is None else probs[a:b]))
    return out
