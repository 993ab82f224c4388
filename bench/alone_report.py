"""The table of scripts/bench-alone.sh: specray's tok/s over llama-server's, per pass and stream count.

Each pass ran both servers alone, one after the other, and wrote one `specray bench --url --json` file per
server (`specray-N.json`, `llama-server-N.json` in one folder). A ratio is only ever taken within a pass: on a
small shared box the speed drifts between minutes, and two servers timed minutes apart compare well
only when they are neighbours. The summary adds the median over passes.

    .venv/bin/python -m specray.bench.alone_report OUT_DIR --passes 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def tok_s_by_streams(bench_json: dict) -> dict[int, float]:
    """A `specray bench --url` JSON of one server: aggregate tok/s by stream count.

    >>> tok_s_by_streams({"rows": [{"streams": 1, "tokens_per_s": 71.8}, {"streams": 4, "tokens_per_s": 117.7}]})
    {1: 71.8, 4: 117.7}
    """
    return {int(r["streams"]): float(r["tokens_per_s"]) for r in bench_json["rows"] if r.get("tokens_per_s")}


def pass_ratios(passes: list[tuple[dict[int, float], dict[int, float]]]) -> dict:
    """(specray, llama-server) tok/s by streams, one pair per pass -> rows per pass and the median ratio.

    >>> out = pass_ratios([({1: 72.0, 4: 118.0}, {1: 84.0, 4: 111.0}), ({1: 68.0, 4: 114.0}, {1: 80.0, 4: 100.0})])
    >>> [(r["pass"], r["streams"], r["ratio"]) for r in out["rows"]]
    [(1, 1, 0.857), (1, 4, 1.063), (2, 1, 0.85), (2, 4, 1.14)]
    >>> out["median_ratio"]
    {1: 0.853, 4: 1.101}
    """
    rows = []
    for n, (ours, theirs) in enumerate(passes, 1):
        for streams in sorted(set(ours) & set(theirs)):
            rows.append({"pass": n, "streams": streams, "specray_tok_s": ours[streams],
                         "llama_server_tok_s": theirs[streams], "ratio": round(ours[streams] / theirs[streams], 3)})
    by_streams: dict[int, list[float]] = {}
    for r in rows:
        by_streams.setdefault(r["streams"], []).append(r["ratio"])
    return {"rows": rows, "median_ratio": {s: round(statistics.median(v), 3) for s, v in sorted(by_streams.items())}}


def load(out_dir: Path, passes: int) -> list[tuple[dict[int, float], dict[int, float]]]:
    """Both servers' tok/s by streams for passes 1..passes; a missing file is an error naming it."""
    pairs = []
    for n in range(1, passes + 1):
        pair = []
        for name in ("specray", "llama-server"):
            path = out_dir / f"{name}-{n}.json"
            if not path.is_file():
                raise FileNotFoundError(f"no {path}: pass {n} of {name} did not finish")
            pair.append(tok_s_by_streams(json.loads(path.read_text())))
        pairs.append((pair[0], pair[1]))
    return pairs


def table(summary: dict) -> str:
    lines = ["pass  streams  specray tok/s  llama-server tok/s  ratio"]
    lines += [f"{r['pass']:4}  {r['streams']:7}  {r['specray_tok_s']:13.1f}  {r['llama_server_tok_s']:18.1f}  "
              f"{r['ratio']:.3f}x" for r in summary["rows"]]
    lines.append("median ratio: " + ", ".join(f"{s} streams {v:.3f}x" for s, v in summary["median_ratio"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path, help="scripts/bench-alone.sh's OUT_DIR")
    ap.add_argument("--passes", type=int, required=True, help="passes to read (specray-1.json ... llama-server-N.json)")
    args = ap.parse_args(argv)
    if args.passes < 1:
        ap.error(f"--passes must be at least 1, got {args.passes}")
    try:
        summary = pass_ratios(load(args.out_dir, args.passes))
    except (FileNotFoundError, KeyError, ValueError) as e:
        print(f"alone_report: {e}", file=sys.stderr)
        return 2
    (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
