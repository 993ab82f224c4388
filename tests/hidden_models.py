"""Synthetic models for the hidden-state speculator tests, written once per test process (about 1 s each).

No MTP or EAGLE-3 weights exist offline, so native/synthetic_gguf.py writes
them: a glm4moe target with a NextN head (random, copied from the target's
block, or a noisy copy that is accepted part of the time), an EAGLE-3
draft and DFlash / DFlash2 drafts for SmolLM2-135M. Files go to one temp dir per process; Ray actors on
this machine load them from there.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile

_DIR: str | None = None


def _dir() -> str:
    global _DIR
    if _DIR is None:
        _DIR = tempfile.mkdtemp(prefix="specray-hidden-")
        atexit.register(shutil.rmtree, _DIR, True)
    return _DIR


@functools.cache
def mtp_target(head: str = "noisy") -> str:
    """A 1-block glm4moe target + NextN head: 'copy' (drafts accepted), 'noisy' (~40% accepted), 'random'."""
    from specray.native.synthetic_gguf import MtpTargetSpec, write_mtp_target

    spec = {"copy": MtpTargetSpec(mtp_head="copy_last"),
            "noisy": MtpTargetSpec(mtp_head="copy_last", copy_noise=0.1),
            "random": MtpTargetSpec(mtp_head="random")}[head]
    return write_mtp_target(os.path.join(_dir(), f"mtp-{head}.gguf"), spec)


@functools.cache
def eagle3_draft() -> str:
    """An EAGLE-3 draft for SmolLM2-135M (layers 2, 15, 27)."""
    from specray.native.synthetic_gguf import write_eagle3_draft

    return write_eagle3_draft(os.path.join(_dir(), "eagle3-smollm2.gguf"))


@functools.cache
def dflash_draft(kind: str = "dflash") -> str:
    """A DFlash draft for SmolLM2-135M (layers 1, 15, 27; block 8; mask token 16); 'dflash2': with the top-4
    selector."""
    from specray.native.synthetic_gguf import DFlashDraftSpec, write_dflash_draft

    spec = DFlashDraftSpec(selector_top_k=4 if kind == "dflash2" else 0)
    return write_dflash_draft(os.path.join(_dir(), f"{kind}-smollm2.gguf"), spec)


def solo_rows(model, taps, sequences, *, n_ctx: int, slots: int) -> list:
    """The target's hidden rows for each token sequence decoded alone in one batch, on a context shaped like
    the engine's (exact mode: a row does not depend on what else shares its batch): what the rows of each
    sequence must be."""
    import numpy as np

    from specray.native.context import Context
    from specray.native.hidden import HiddenOutput

    ctx = Context(model, n_ctx=n_ctx, n_seq_max=slots, n_batch=max(512, max(len(t) for t in sequences)), exact=True)
    try:
        out = HiddenOutput(ctx, tuple(taps))
        out.set_enabled(True)
        rows = []
        for tokens in sequences:
            ctx.clear_seq(0)
            ctx.batch.clear()
            ctx.batch.add_seq(0, np.asarray(tokens, dtype=np.int32), 0, 1)
            ctx.decode()
            rows.append(out.rows(len(tokens)).copy())
        return rows
    finally:
        ctx.close()
