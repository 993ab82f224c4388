"""Where a streamed request's time goes: the per-stage breakdown `specray bench --url/--http` prints.

Every request the HTTP bench sends carries `X-Specray-Timing: 1`; the server
answers with `specray_timing` in the final chunk (deployments/http/timing.py
says what each stage covers). The client adds `proxy` (its own end-to-end,
request sent -> final chunk read, minus the ingress's total), so the stages
of a request add up to what the client saw. Per bench row: each stage's mean
and median per request (ms) and per generated token (ms / completion tokens
of that request), its share of the client's time, and the per-chunk figures
(emit, SSE write, the handle's first-chunk round trip) that overlap rounds.
"""

from __future__ import annotations

import numpy as np

#: additive stages in request order: the server's (deployments/http/timing.py SERVER_STAGES) + the client's
STAGES = ("ingress_parse", "handle", "tokenize", "admission", "prefill", "decode", "emit_tail", "sse_tail", "proxy")
#: per-chunk figures (means over a request's chunks) and counts: not additive, they overlap the rounds
PER_CHUNK = ("emit_mean_ms", "emit_chunks", "sse_mean_ms", "sse_chunks", "handle_first_ms", "direct_mean_ms",
             "direct_chunks")


def request_stages(timing: dict, client_ms: float) -> dict:
    """One request's stages (ms) from the server's `specray_timing` and the client's end-to-end.

    >>> t = {"ingress_parse_ms": 1, "handle_ms": 2, "tokenize_ms": 1, "admission_ms": 1, "prefill_ms": 20,
    ...      "decode_ms": 200, "emit_tail_ms": 0.5, "sse_tail_ms": 0.5, "ingress_ms": 226.0, "emit_chunks": 9}
    >>> s = request_stages(t, 230.0)
    >>> s["proxy"], s["total"], sum(s[k] for k in STAGES)
    (4.0, 230.0, 230.0)
    """
    out = {k: float(timing.get(k + "_ms", 0.0)) for k in STAGES if k != "proxy"}
    out["proxy"] = round(client_ms - float(timing.get("ingress_ms", 0.0)), 3)
    out["total"] = round(client_ms, 3)
    out |= {k: timing[k] for k in PER_CHUNK if k in timing}
    return out


def summarize(per_request: list[tuple[dict, int]]) -> dict | None:
    """[(request_stages, completion tokens)] -> {stage: {mean, p50, mean_per_token, p50_per_token}}, plus
    `per_chunk` means and `requests`. None when no request carried a timing (an older server)."""
    if not per_request:
        return None
    out: dict = {"requests": len(per_request)}
    for k in (*STAGES, "total"):
        vals = np.array([s[k] for s, _ in per_request], dtype=float)
        per_tok = np.array([s[k] / max(1, n) for s, n in per_request], dtype=float)
        out[k] = {"mean": round(float(vals.mean()), 3), "p50": round(float(np.median(vals)), 3),
                  "mean_per_token": round(float(per_tok.mean()), 4),
                  "p50_per_token": round(float(np.median(per_tok)), 4)}
    out["per_chunk"] = {k: round(float(np.mean([s[k] for s, _ in per_request if k in s])), 4)
                        for k in PER_CHUNK if any(k in s for s, _ in per_request)}
    return out


def table(label: str, streams: int, st: dict) -> str:
    total = st["total"]["mean"] or 1.0
    lines = [f"stages: {label}, {streams} stream{'s' if streams != 1 else ''}, {st['requests']} requests "
             f"(ms per request; per token = ms / completion tokens of the request)",
             f"  {'stage':<14}{'mean':>10}{'p50':>10}{'mean/tok':>10}{'p50/tok':>10}{'share':>8}"]
    for k in (*STAGES, "total"):
        s = st[k]
        lines.append(f"  {k:<14}{s['mean']:>10.3f}{s['p50']:>10.3f}{s['mean_per_token']:>10.4f}"
                     f"{s['p50_per_token']:>10.4f}{100 * s['mean'] / total:>7.1f}%")
    pc = st.get("per_chunk") or {}
    if pc:
        lines.append(f"  per chunk: emit {pc.get('emit_mean_ms', 0):.3f} ms x {pc.get('emit_chunks', 0):.1f} chunks, "
                     f"SSE write {pc.get('sse_mean_ms', 0):.3f} ms x {pc.get('sse_chunks', 0):.1f} chunks, "
                     f"handle first-chunk round trip {pc.get('handle_first_ms', 0):.3f} ms"
                     + (f", written by the round thread {pc['direct_mean_ms']:.3f} ms x {pc['direct_chunks']:.1f} chunks"
                        if pc.get("direct_chunks") else ""))
    return "\n".join(lines)
