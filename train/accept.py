"""How often the target accepts a head's drafts, by draft position, on prompts it was not trained on.

    python -m specray.train.accept --head head.gguf --categories writing,roleplay --per-category 10

The head drafts alone (`eagle3` chain, `first` policy: every round, every
sequence, `--n-max` tokens unless it stops on end-of-generation), greedy, so
what is counted is the head's own quality, not the cost policy's choices.
Per position i: P(accepted) = drafts whose first i+1 tokens were all kept /
drafts, and the conditional rate given position i-1 was kept; the mean
acceptance length is 1 + accepted tokens / drafts (tokens per target verify).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from importlib import resources

from .prompts import read_prompts


def acceptance_by_position(accepted_per_pos: list[int], drafts: int) -> list[dict]:
    """Per draft position: P(this and every earlier token accepted) and the rate given the one before was.

    >>> acceptance_by_position([8, 4, 1], 10)
    [{'pos': 1, 'p_accepted': 0.8, 'p_given_previous': 0.8}, {'pos': 2, 'p_accepted': 0.4, 'p_given_previous': 0.5}, {'pos': 3, 'p_accepted': 0.1, 'p_given_previous': 0.25}]
    """
    out, prev = [], drafts
    for i, a in enumerate(accepted_per_pos):
        out.append({"pos": i + 1, "p_accepted": a / drafts if drafts else 0.0,
                    "p_given_previous": a / prev if prev else 0.0})
        prev = a
    return out


def measure(target: str, head: str, prompts, *, n_max: int, max_tokens: int, slots: int, threads: int) -> dict:
    from specray.deployments.local_engine import LocalEngine
    from specray.engine.config import ChainConfig, EngineConfig, HiddenStateConfig

    eng = LocalEngine(EngineConfig(
        model=target, slots=slots, n_ctx=slots * 2048, threads=threads, prompt_cache=False,
        chain=ChainConfig(speculators=["eagle3"], policy="first", n_max=n_max,
                          params={"eagle3": {"n_max": n_max}}),
        hidden=HiddenStateConfig(eagle3_model=head)))
    try:
        by_cat: dict[str, list] = defaultdict(list)
        t0 = time.monotonic()
        for cat in dict.fromkeys(p.category for p in prompts):
            reqs = [eng.request(p.prompt, p.messages, max_tokens=max_tokens) for p in prompts if p.category == cat]
            by_cat[cat] = eng.run(reqs)
            print(f"accept: {cat} done ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
        spec = eng.chain.speculator("eagle3")
        st = spec.stats
        drafts = st.drafted_per_pos[0] if st.drafted_per_pos else 0
        res = {"head": head, "n_max": n_max, "drafts": drafts, "drafted_tokens": st.tokens_generated,
               "accepted_tokens": st.tokens_accepted,
               "mean_acceptance_length": 1 + st.tokens_accepted / drafts if drafts else 1.0,
               "by_position": acceptance_by_position(list(st.accepted_per_pos), drafts),
               "head_step_ms_by_batch": {k: v * 1000 for k, v in spec.backend.decode_costs().items()},
               "target_decode_ms_by_batch": {k: v * 1000 for k, v in eng.scheduler.cost.table().items()},
               "categories": {}}
        for cat, seqs in by_cat.items():
            d = sum(s.spec_total.drafts for s in seqs)
            a = sum(s.spec_total.accepted for s in seqs)
            res["categories"][cat] = {"drafts": d, "mean_acceptance_length": 1 + a / d if d else 1.0}
        return res
    finally:
        eng.close()


def default_prompts_path() -> str:
    """The prompts read without --prompts, the same file as `specray bench`'s default
    (specray.bench.prompts.default_prompts_path, which train may not import: docs/architecture.md):
    $SPECRAY_SPEC_BENCH when set, else Spec-Bench as the specray.bench package ships it (bench/data).

    >>> path = default_prompts_path()
    >>> path == os.environ.get("SPECRAY_SPEC_BENCH") or path.endswith("spec_bench.jsonl")
    True
    """
    # a resource of the package, not an import of its code
    return os.environ.get("SPECRAY_SPEC_BENCH") or str(resources.files("specray.bench") / "data" / "spec_bench.jsonl")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specray.train.accept", description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", required=True, metavar="HEAD.gguf", help="the EAGLE-3 head to measure")
    ap.add_argument("--target", default="smollm2-135m", help="target model (default: %(default)s)")
    ap.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                    help="prompts (default: $SPECRAY_SPEC_BENCH, else Spec-Bench's questions shipped in the package, "
                         "bench/data/spec_bench.jsonl)")
    ap.add_argument("--categories", default=None, help="comma-separated categories (default: all)")
    ap.add_argument("--per-category", type=int, default=10, help="prompts per category (default: %(default)s)")
    ap.add_argument("--n-max", type=int, default=3, help="draft tokens per round (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per answer (default: %(default)s)")
    ap.add_argument("--slots", type=int, default=1, help="sequences at once (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default: %(default)s)")
    ap.add_argument("--json", default=None, help="write the figures to this file")
    args = ap.parse_args(argv)
    path = args.prompts or default_prompts_path()
    cats = [c for c in (args.categories or "").split(",") if c] or None
    prompts, seen = [], defaultdict(int)
    for p in read_prompts(path, cats):
        if seen[p.category] < args.per_category:
            seen[p.category] += 1
            prompts.append(p)
    res = measure(args.target, args.head, prompts, n_max=args.n_max, max_tokens=args.max_tokens, slots=args.slots,
                  threads=args.threads)
    print(f"{res['drafts']} drafts of up to {res['n_max']} tokens; mean acceptance length "
          f"{res['mean_acceptance_length']:.3f}")
    for p in res["by_position"]:
        print(f"  position {p['pos']}: P(accepted) {p['p_accepted']:.3f}, given the previous {p['p_given_previous']:.3f}")
    for cat, c in res["categories"].items():
        print(f"  {cat}: mean acceptance length {c['mean_acceptance_length']:.3f} over {c['drafts']} drafts")
    print("  head step ms by batch size", {k: round(v, 2) for k, v in res["head_step_ms_by_batch"].items()})
    print("  target decode ms by batch size", {k: round(v, 2) for k, v in res["target_decode_ms_by_batch"].items()})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
