"""The synthetic llama target of a chosen size (native/synthetic_llama.py, `specray synth-model`, `specray
cost-curve`), at a tiny size: llama.cpp loads it with the requested parameter count, decodes it
deterministically with finite logits, and the cost curve is measured on it and labelled synthetic."""

from __future__ import annotations

import doctest
import json

import numpy as np
import pytest

from specray.bench import cost_curve
from specray.cli.main import main
from specray.native import synthetic_llama
from specray.native.context import Context
from specray.native.model import Model

pytestmark = pytest.mark.model

PARAMS = 16_000_000  # ~10-19 MB on disk (q4_0 / q8_0), mostly the vocabulary's embedding and LM head


def test_doctests():
    for module in (synthetic_llama, cost_curve):
        failed, attempted = doctest.testmod(module)
        assert attempted and not failed


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("synthetic-llama") / "synth.gguf")
    assert main(["synth-model", "--params", "16M", "--out", p, "--type", "q8_0", "--seed", "3"]) == 0
    return p


def greedy(model: Model, n: int = 24) -> tuple[list[int], np.ndarray]:
    ctx = Context(model, n_ctx=256, n_seq_max=1, n_batch=64, n_threads=1)
    try:
        ids = model.tokenize("The quick brown fox")
        batch = ctx.batch
        batch.clear()
        batch.add_seq(0, ids, 0, 1)
        ctx.decode(batch)
        out, pos, rows = [], len(ids), []
        for _ in range(n):
            row = np.array(ctx.logits(1)[-1])
            rows.append(row)
            out.append(int(np.argmax(row)))
            batch.clear()
            batch.add_seq(0, np.array(out[-1:], dtype=np.int32), pos, 1)
            ctx.decode(batch)
            pos += 1
        return out, np.stack(rows)
    finally:
        ctx.close()


def test_llama_cpp_loads_it_with_the_requested_size_and_decodes_it_deterministically(path):
    model = Model(path)
    try:
        assert model.n_vocab == 49152 and synthetic_llama.is_synthetic(path)
        assert abs(model.n_params / PARAMS - 1) < 0.02
        a, logits = greedy(model)
        b, _ = greedy(model)
        assert a == b
        assert np.isfinite(logits).all()
        assert 0.5 < logits.std() < 8  # the head's scale: logits neither flat nor exploding
        assert len(set(a)) > 4  # it wanders, it does not repeat one token (a tied head would)
        assert model.detokenize(a)  # SmolLM2's tokenizer turns it into text
    finally:
        model.close()


def test_same_seed_same_bytes_and_the_flags_are_checked(path, tmp_path, capsys):
    again = str(tmp_path / "again.gguf")
    assert main(["synth-model", "--params", "16M", "--out", again, "--type", "q8_0", "--seed", "3"]) == 0
    assert open(again, "rb").read() == open(path, "rb").read()
    for bad, says in ((["--params", "1.5X"], "expected a parameter count"), (["--params", "50k"], "1M to 20B"),
                      (["--params", "16M", "--type", "q5_k"], "invalid choice: 'q5_k'")):
        with pytest.raises(SystemExit):
            main(["synth-model", "--out", again, *bad])
        assert says in capsys.readouterr().err
    assert main(["cost-curve", "--model", path, "--max-k", "0"]) == 2
    assert "--max-k must be 1-512" in capsys.readouterr().err


def test_the_cost_curve_is_measured_for_every_k_and_labelled_synthetic(path, tmp_path, capsys):
    out = tmp_path / "curve.json"
    assert main(["cost-curve", "--model", path, "--max-k", "4", "--reps", "1", "--threads", "1",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "SYNTHETIC" in printed and "cost(k)/cost(1)" in printed
    r = json.loads(out.read_text())
    assert r["synthetic"] is True and sorted(r["cost_ms"]) == ["1", "2", "3", "4"]
    assert r["ratio"]["1"] == 1.0 and all(v > 0 for v in r["cost_ms"].values())
