"""The few-row Q8_0/Q4_1 kernel (native/patches/ggml-cpu-verify-cols.patch) changes speed, never results.

A speculative verify decodes a few rows at once; the patched kernel loads each weight block once for all
of them. Its per-row arithmetic is the 1-row kernel's, so logits must be bitwise the same with it on or off,
in fast mode and in exact mode, on both packaged models (SmolLM2: Q4_1 body and Q8_0 output layer;
Gemma 3: a Q8_0 output layer over a 262k vocabulary).
"""

from __future__ import annotations

import platform

import numpy as np
import pytest

from specray.native import lib
from specray.native.context import Context

pytestmark = pytest.mark.model

ROWS = (2, 3, 5, 8, 13, 20, 40)  # Q8_0 takes the kernel up to 31 rows with llamafile on, Q4_1 always


def _cpu_has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx2" in line for line in f)
    except OSError:
        return False


@pytest.fixture
def cols_switch():
    if not (platform.machine() in ("x86_64", "AMD64") and _cpu_has_avx2()):
        pytest.skip("the few-row kernel is x86 AVX2 only")
    # specray's install builds it on every AVX2 machine: its absence there is a broken install
    assert lib.verify_cols_available(), "patched ggml-cpu without the few-row kernel"
    assert lib.verify_cols_enabled(), "the few-row kernel should be on by default"
    yield lib.set_verify_cols
    lib.set_verify_cols(True)


def _batched_logits(model, exact: bool, set_cols, enabled: bool) -> dict[int, np.ndarray]:
    ctx = Context(model, n_ctx=1024, n_seq_max=1, n_batch=256, exact=exact)
    prefix = model.tokenize("Speculative decoding verifies a draft in one batched decode. " * 12)[:120]
    nxt = (np.arange(max(ROWS), dtype=np.int32) * 37 + 500) % 5000 + 100
    b = ctx.batch
    b.clear(); b.add_seq(0, prefix, 0, 1); ctx.decode()  # noqa: E702
    out = {}
    set_cols(enabled)
    assert lib.verify_cols_enabled() is enabled  # the state ggml-cpu consults, not a private copy
    for n in ROWS:
        b.clear(); b.add_seq(0, nxt[:n], len(prefix), n)  # noqa: E702
        out[n] = ctx.decode().copy()
        ctx.seq_rm(0, len(prefix), -1)
    ctx.close()
    return out


@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
@pytest.mark.parametrize("model_name", ["smollm2", "gemma3"])
def test_the_few_row_kernel_gives_bitwise_the_same_logits(request, cols_switch, model_name, exact):
    model = request.getfixturevalue(model_name)
    on = _batched_logits(model, exact, cols_switch, True)
    off = _batched_logits(model, exact, cols_switch, False)
    for n in ROWS:
        assert on[n].shape == off[n].shape == (n, model.n_vocab)
        assert np.isfinite(on[n]).all()
        diff = float(np.abs(on[n] - off[n]).max())
        assert diff == 0.0, f"{model_name}, {n} rows: logits differ by {diff} with the few-row kernel"
