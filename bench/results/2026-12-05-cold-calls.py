"""What a call costs on the round thread right after a decode, against the same call repeated at once: the
logits' address (Context.logits); a one-row batch run written with slices and with Batch.add_seq (item
writes); numpy's argmax method over the logits row and over an array of the same size touched only before the
decode; then np.argmax (numpy's Python wrapper around that method) over the row the method has just read.
SmolLM2, one slot, decoding its own greedy tokens; the variants alternate round by round. Medians in
microseconds, into OUT.json.
    .venv/bin/python bench/results/2026-12-05-cold-calls.py OUT.json [ROUNDS]"""
import json, sys, time

import numpy as np

from specray.native.context import Context
from specray.native.model import Model


def slices(b, seq_id, tokens, pos0, n_logits):  # a run written as Batch.add_seq writes longer ones
    n, i = len(tokens), b.n_tokens
    b.token[i:i + n] = tokens
    b.pos[i:i + n] = np.arange(pos0, pos0 + n, dtype=np.int32)
    b.seq_ids[i:i + n] = seq_id
    b.n_seq_id[i:i + n] = 1
    b.logits[i:i + n] = 0
    b.logits[i + n - n_logits:i + n] = 1
    b.n_tokens += n
    b.n_outputs += n_logits


def main(out, rounds=600):
    model = Model("smollm2-135m")
    ctx = Context(model, n_ctx=4096, n_seq_max=1, n_batch=512, flash_attn=True, n_threads=2)
    prompt = model.tokenize("Write a long story about a dragon who learns to cook pasta in Rome.")
    b = ctx.batch
    b.clear(); b.add_seq(0, prompt, 0, 1); ctx.decode(b)  # noqa: E702
    other = np.random.default_rng(0).random(model.n_vocab, dtype=np.float32)
    pos, tok = len(prompt), int(ctx.logits(1)[0].argmax())
    times = {}

    def timed(name, f):
        t0 = time.perf_counter(); f(); t1 = time.perf_counter(); f(); t2 = time.perf_counter()  # noqa: E702
        times.setdefault(name + ", after a decode", []).append(t1 - t0)
        times.setdefault(name + ", repeated", []).append(t2 - t1)

    for r in range(rounds):
        run = np.array([tok], dtype=np.int32)
        k = r % 2
        if k == 0:
            timed("one-row run: slices", lambda: (b.clear(), slices(b, 0, run, pos, 1)))
        else:
            timed("one-row run: Batch.add_seq", lambda: (b.clear(), b.add_seq(0, run, pos, 1)))
        other.argmax()
        ctx.launch(b)
        timed("logits address: Context.logits", lambda: ctx.logits(1))
        row = ctx.logits(1)[0]
        timed(["argmax: the logits row", "argmax: an array touched before the decode"][k],
              (lambda: row.argmax()) if k == 0 else (lambda: other.argmax()))
        timed("np.argmax(the logits row), after the method", lambda: np.argmax(row))
        tok, pos = int(row.argmax()), pos + 1
    res = {k: round(1e6 * float(np.median(v)), 1) for k, v in times.items()}
    for k, v in res.items():
        print(f"{k:60s} {v:6.1f} us")
    json.dump({"rounds": rounds, "median_us": res}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 600)
