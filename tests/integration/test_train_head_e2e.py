"""`specray train-head` end to end on SmolLM2 (a few prompts, a few steps), then the head served as an ordinary
`eagle3` speculator: alone and in a cost-policy chain, four sequences at once, greedy output identical to
the target's alone (exact mode)."""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest

pytest.importorskip("torch")

from specray.deployments.local_engine import LocalEngine  # noqa: E402
from specray.engine.config import ChainConfig, EngineConfig, HiddenStateConfig  # noqa: E402

from ..conftest import spec_bench_prompts, spec_bench_questions  # noqa: E402

pytestmark = pytest.mark.model

SLOTS = 4
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from specray.cli.main import main

    d = tmp_path_factory.mktemp("train-head")
    prompts = d / "prompts.jsonl"
    picked = {}
    for q in spec_bench_questions():
        picked.setdefault(q["category"], q)
    first = list(picked.values())[0]
    # too long to answer under --max-prompt-tokens 200: kept as its prompt's rows only (--learn-prompts)
    long_ = {"category": first["category"], "turns": [" ".join([first["turns"][0]] * 12)]}
    prompts.write_text("\n".join(json.dumps(q) for q in list(picked.values())[:4] + [long_]) + "\n")
    cats = ",".join(list(picked)[:3])  # the 4th category is left out
    # a text file cut into --max-len pieces the head learns on with no answer (--text), first (--rows-minutes)
    (d / "corpus.txt").write_text(" ".join(q["turns"][0] for q in spec_bench_questions()[:12]))
    out = str(d / "head.gguf")
    argv = ["train-head", "--prompts", str(prompts), "--categories", cats, "--out", out, "--max-tokens", "32",
            "--sampled", "1", "--gen-slots", "3", "--self-prompts", "2", "--learn-prompts", "--max-prompt-tokens",
            "200", "--epochs", "3", "--batch-tokens", "1024", "--eval-every", "2",
            "--draft-vocab", "512", "--max-len", "384", "--curve", str(d / "curve.png"), "--seed", "3",
            "--threads", "1", "--torch-threads", "1", "--text", str(d / "corpus.txt"), "--rows-minutes", "5",
            "--soft-labels", "4"]
    assert main(argv) == 0
    return argv, out, d


def test_train_head_writes_an_eagle3_gguf_and_resumes(trained, capsys):
    from specray.cli.main import main
    from specray.native.gguf_meta import eagle3_target_layers
    from specray.train.gguf_io import read_head

    argv, out, d = trained
    work = out + ".work"
    summary = json.loads(open(os.path.join(work, "summary.json")).read())
    # 3 prompts of the file and 2 the target wrote itself, greedy + 1 sampled answer each, the long prompt's rows,
    # and the text file's pieces (its tokens cut into 384-token pieces, a last one under 32 dropped)
    from specray.native.model import Model
    from specray.native.models import resolve_model
    from specray.train.data import load_samples
    from specray.train.text import chunks

    model = Model(resolve_model("smollm2-135m"), vocab_only=True)
    n_text = len(model.tokenize((d / "corpus.txt").read_text(), add_special=True))
    model.close()
    pieces = len(chunks(n_text, 384))
    assert pieces >= 2 and summary["answers"] == 11 + pieces and summary["draft_vocab"] == 512
    samples = load_samples(os.path.join(work, "data"))
    text = [s for s in samples if s.category == "text"]
    assert len(text) == pieces and all(s.prompt < 0 and s.answer_from == len(s.tokens) for s in text)
    # soft labels: 4 tokens a position, most likely first, the first the top token
    for s in samples:
        assert s.soft_ids.shape == (len(s.tokens), 4) and (s.soft_ids[:, 0] == s.labels).all()
        assert (np.diff(s.soft_p.astype(np.float32), axis=1) <= 0).all() and (s.soft_p.sum(1) <= 1.01).all()
    own = [json.loads(line) for line in open(os.path.join(work, "data", "self_prompts.jsonl"))]
    assert len(own) == 2 and all(o["category"] == "self" and len(o["content"]) >= 16 for o in own)
    assert summary["steps"] > 0 and len(summary["curve"]) >= 2
    first, last = summary["curve"][0], summary["curve"][-1]
    assert last["val_loss"] < first["val_loss"]  # it learnt something, even from six short answers
    assert eagle3_target_layers(out) == (2, 15, 27)
    m = read_head(out)
    assert m.d.draft_vocab == 512 and len(set(m.d2t.tolist())) == 512
    assert os.path.getsize(str(d / "curve.png")) > 1000
    shards = sorted(glob.glob(os.path.join(work, "data", "shard-*.npz")))
    mtime = os.path.getmtime(out)
    # the same command again: no new answers, training already done, the head written again
    capsys.readouterr()
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "all 12 answers already in" in err and "resumed from" in err
    assert sorted(glob.glob(os.path.join(work, "data", "shard-*.npz"))) == shards
    assert os.path.getmtime(out) >= mtime
    assert json.loads(open(os.path.join(work, "summary.json")).read())["steps"] == summary["steps"]


def _engine(model, head: str | None) -> LocalEngine:
    cfg = EngineConfig(model="smollm2-135m", slots=SLOTS, n_ctx=512 * SLOTS, exact=True, calibrate=False, threads=1,
                       chain=ChainConfig(speculators=[], policy="first", n_max=4, params={"eagle3": {"n_max": 3}}),
                       hidden=HiddenStateConfig(eagle3_model=head))
    return LocalEngine(cfg, model=model)


def test_trained_head_serves_losslessly_alone_and_in_a_chain(trained, smollm2):
    _, out, _ = trained
    prompts = spec_bench_prompts(SLOTS)

    def run(eng, chain):
        reqs = [eng.request(messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS, chain=chain,
                            ignore_eos=True) for p in prompts]
        return [s.generated for s in eng.run(reqs)]

    base_eng = _engine(smollm2, None)
    base = run(base_eng, ())
    base_eng.close()
    eng = _engine(smollm2, out)
    try:
        # alone, `first` policy: it drafts for every sequence every round
        assert run(eng, ("eagle3",)) == base
        spec = eng.chain.speculator("eagle3")
        assert spec.stats.tokens_generated > 0 and spec.counters.steps > 0
        assert spec.counters.mismatched == spec.counters.lost == 0
        assert eng.runner.max_seqs_in_decode >= SLOTS
        print(f"\ntrained head (6 short answers): {spec.stats.tokens_accepted}/{spec.stats.tokens_generated} "
              "drafted tokens accepted")
        # in the default kind of chain, cost policy, as any speculator (a live chain update)
        eng.set_chain(ChainConfig(speculators=["ngram_mod", "suffix", "eagle3"], policy="cost", n_max=4,
                                  params={"eagle3": {"n_max": 3}}))
        assert run(eng, None) == base
    finally:
        eng.close()


def test_bench_runs_the_trained_head_like_any_speculator(trained):
    """`specray bench --eagle3-model`: the head in a chain of its own and in the default chain, every
    configuration on its own engine (lockstep), each head priced at the first engine's measured step cost."""
    from specray.bench.run import BenchPrompt, run_bench

    _, out, _ = trained
    prompts = [BenchPrompt("chat", messages=[{"role": "user", "content": p}]) for p in spec_bench_prompts(2)]
    rep = run_bench(model="smollm2-135m", configs=["eagle3", ChainConfig().label + ",eagle3"], prompts=prompts,
                    max_tokens=16, slots=1, exact=True, policy="cost", n_max=4, threads=1, n_ctx=1024,
                    progress=lambda s: None, llama_baseline=False, hidden=HiddenStateConfig(eagle3_model=out))
    costs = rep.meta["hidden"]["eagle3"]["decode_cost_ms"]
    assert costs and all(v > 0 for v in costs.values())
    for c in rep.configs[1:]:
        r = rep.results["chat"][c]
        assert r.identical == r.compared == 2, c  # exact mode: the tokens of `none`
