"""The least host work a Python loop can do around plain greedy decoding, in place on this CPU (experiments page,
"The floor under a plain round's host time").

Each step of the loop does what any server must between two decodes of S sequences, and nothing else: read the
logits rows, take each row's argmax, turn each token into its bytes, check it for end of generation, keep it,
and fill the next batch. No scheduler, no stats, no streaming. The host time of a step is the step's wall time
less the decode call (`Context.launch`, whose few Python checks around llama_decode count as decode here, which
flatters the floor a little). That is the figure `specray bench` reports as `round_ms - decode`.

Three ways are timed, interleaved prompt by prompt:
- `decode`: the host work right after each real decode (in place);
- `spin`: the decode replaced by a busy wait of the same length as the last real one, so the host work runs
  after a wait of that length in which the thread touched almost nothing (the host replay's conditions);
  each spin step ends with the same host work over the last real decode's logits;
- `h100`: the same with the wait an H100's decode of those rows takes (the host replay's h100 table).
Each step also runs the host work a second time right after the first (`warm`), over the same logits and the
same tokens (into lists of its own), timed apart and left out of the step.

    .venv/bin/python bench/results/2026-12-05-floor-loop.py OUT.json [--slots 1 4] [--tokens 64] [--reps 3]
"""

import argparse
import json
import platform
import statistics
import sys
import time

import numpy as np

from specray.bench.host_replay import H100_MS, spin
from specray.bench.prompts import default_prompts_path, load_prompts
from specray.native.context import Context
from specray.native.model import Model

MAX_PROMPT = 1536  # tokens kept of a prompt: every slot's fits the context with the tokens it decodes
CATEGORIES = ("coding", "math_reasoning", "qa", "rag", "summarization", "translation")


def host_work(ctx: Context, model: Model, slots: int, pos: list[int], out: list[list[int]], text: list[bytearray],
              ended: list[bool]) -> np.ndarray:
    """One step's host work after a decode of `slots` rows: argmax, bytes, end of generation, kept; the next
    batch filled. Returns the tokens the next decode takes."""
    logits = ctx.logits(slots)
    toks = np.empty(slots, dtype=np.int32)
    for s in range(slots):
        t = int(logits[s].argmax())
        toks[s] = t
        if not ended[s]:
            if model.is_eog(t):
                ended[s] = True
            else:
                out[s].append(t)
                text[s] += model.token_to_piece(t)
    b = ctx.batch
    b.clear()
    for s in range(slots):
        b.add_seq(s, toks[s : s + 1], pos[s], 1)
    return toks


def run(ctx: Context, model: Model, prompts: list[np.ndarray], slots: int, tokens: int, way: str) -> dict:
    ctx.clear_all()
    b = ctx.batch
    first = np.empty(slots, dtype=np.int32)  # each slot's first token, from its prompt's last row
    for s in range(slots):  # each slot prefills its own prompt, in chunks of the batch's size
        p = prompts[s]
        for c in range(0, len(p), ctx.n_batch):
            b.clear()
            b.add_seq(s, p[c : c + ctx.n_batch], c, 1 if c + ctx.n_batch >= len(p) else 0)
            ctx.decode(b)
        first[s] = int(ctx.logits(1)[0].argmax())
    pos = [len(p) for p in prompts[:slots]]  # each slot's next position
    b.clear()
    for s in range(slots):
        b.add_seq(s, first[s : s + 1], pos[s], 1)
    out, text, ended = [[] for _ in range(slots)], [bytearray() for _ in range(slots)], [False] * slots
    host, warm, decode = [], [], []
    last_decode = 0.0
    for step in range(tokens):
        t0 = time.perf_counter()
        if way == "decode" or step == 0:
            ctx.launch(b)
        else:  # the last decode's logits stay in llama.cpp's buffer: the spin replaces the decode, not its output
            spin(last_decode if way == "spin" else H100_MS[min(r for r in H100_MS if r >= slots)] / 1e3)
        t1 = time.perf_counter()
        nxt = [p + step + 1 for p in pos]
        host_work(ctx, model, slots, nxt, out, text, ended)
        t2 = time.perf_counter()
        host_work(ctx, model, slots, nxt, [[] for _ in range(slots)], [bytearray() for _ in range(slots)],
                  list(ended))
        t3 = time.perf_counter()
        if step:
            host.append(t2 - t1)
            warm.append(t3 - t2)
            decode.append(t1 - t0)
        if way == "decode" or step == 0:
            last_decode = t1 - t0
    return {"host_us": [x * 1e6 for x in host], "warm_us": [x * 1e6 for x in warm],
            "decode_ms": [x * 1e3 for x in decode]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="write every step's figures here (JSON)")
    ap.add_argument("--model", default="smollm2-135m", help="model path or alias (default: %(default)s)")
    ap.add_argument("--slots", type=int, nargs="+", default=[1, 4], help="sequences a decode (default: 1 4)")
    ap.add_argument("--tokens", type=int, default=64, help="decodes a run (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=3, help="passes over the prompts (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    model = Model(a.model)
    # Spec-Bench's held-out categories, a prompt each, its user turn as raw text: the host work does not depend
    # on the text, but the decode's length does (the cached cells it attends), and so does how cold the host's
    # data comes back (benchmarks page, "Host work after a wait")
    held_out = load_prompts(default_prompts_path(), list(CATEGORIES), 1)
    prompts = [model.tokenize(p.messages[0]["content"] if p.messages else p.prompt)[:MAX_PROMPT] for p in held_out]
    result = {"machine": platform.processor() or platform.machine(), "python": sys.version.split()[0],
              "model": a.model, "threads": a.threads, "tokens": a.tokens, "runs": {}}
    for slots in a.slots:
        ctx = Context(model, n_ctx=max(4096, slots * (MAX_PROMPT + a.tokens + 64)), n_seq_max=slots, n_batch=512,
                      flash_attn=True, n_threads=a.threads)
        runs = {"decode": [], "spin": [], "h100": []}
        for rep in range(a.reps):
            for i in range(len(prompts)):
                group = [prompts[(i + j) % len(prompts)] for j in range(slots)]
                ways = ("decode", "spin", "h100")
                for way in (ways if (rep + i) % 2 == 0 else ways[::-1]):
                    runs[way].append(run(ctx, model, group, slots, a.tokens, way))
        ctx.close()
        summary = {}
        for way, rs in runs.items():
            host = [x for r in rs for x in r["host_us"]]
            warm = [x for r in rs for x in r["warm_us"]]
            dec = [x for r in rs for x in r["decode_ms"]]
            summary[way] = {"steps": len(host), "host_us_mean": statistics.fmean(host),
                            "host_us_median": statistics.median(host), "warm_us_mean": statistics.fmean(warm),
                            "warm_us_median": statistics.median(warm), "wait_ms_mean": statistics.fmean(dec)}
            print(f"{slots} slot(s), {way:6s}: host {summary[way]['host_us_mean']:.1f} us a step "
                  f"(median {summary[way]['host_us_median']:.1f}), the same work again at once "
                  f"{summary[way]['warm_us_mean']:.1f} us, wait {summary[way]['wait_ms_mean']:.2f} ms, "
                  f"{len(host)} steps", flush=True)
        result["runs"][str(slots)] = {"summary": summary, "steps": runs}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
