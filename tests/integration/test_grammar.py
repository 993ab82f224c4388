"""Grammar-constrained decoding (structured outputs) with speculation on: SmolLM2, 4 slots, exact mode.

The verify picks, at each row, the best token the grammar allows after the tokens before it, and advances
the grammar only with emitted tokens; so speculative output must equal target-only constrained output token
for token, with every speculator, greedy and seeded sampling alike. The prompts are the JSON-extraction set
`specray bench` measures (bench/data/json_extraction.jsonl).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from specray.bench.prompts import bundled_prompts, load_prompts, prompt_grammar
from specray.deployments.local_engine import LocalEngine
from specray.engine.config import ChainConfig, EngineConfig
from specray.engine.sampling import SamplingParams
from specray.native.grammar import JSON_OBJECT_GBNF, GrammarCompiler, GrammarError, schema_to_gbnf

from .test_lossless import ALL, PARAMS

pytestmark = pytest.mark.model

PROMPTS = load_prompts(bundled_prompts("json_extraction.jsonl"), None, 2)  # 8 prompts
MAX_TOKENS = 128
DEFAULT = tuple(ChainConfig().speculators)


@pytest.fixture(scope="module")
def engine(smollm2):
    cfg = EngineConfig(model="smollm2-135m", slots=4, n_ctx=4096, exact=True, calibrate=False,
                       chain=ChainConfig(speculators=[], params=PARAMS, policy="first", n_max=8))
    eng = LocalEngine(cfg, model=smollm2)
    yield eng
    eng.close()


def _run(engine, chain, sampling=None, prompts=PROMPTS, max_tokens=MAX_TOKENS):
    reqs = []
    for p in prompts:
        sp = (sampling or SamplingParams()).model_copy(update={"grammar": prompt_grammar(p)})
        reqs.append(engine.request(messages=p.messages, max_tokens=max_tokens, chain=chain, sampling=sp))
    return engine.run(reqs)


def _check_json(seq, schema):
    """The text is one JSON object with the schema's required keys (where the model finished within max_tokens;
    else the beginning of one)."""
    if seq.finish_reason == "length":
        assert seq.text.lstrip().startswith("{")
        return None
    assert seq.finish_reason == "stop", (seq.finish_reason, seq.text)
    obj = json.loads(seq.text)
    assert set(schema["required"]) <= set(obj), seq.text
    return obj


@pytest.fixture(scope="module")
def plain(engine):
    return [s.generated for s in _run(engine, ())]


def test_constrained_output_follows_the_schema(engine):
    seqs = _run(engine, ())
    objs = [_check_json(s, p.json_schema) for p, s in zip(PROMPTS, seqs)]
    assert sum(o is not None for o in objs) >= len(PROMPTS) - 2
    for p, obj in zip(PROMPTS, objs):
        if obj is None:
            continue
        for key, sub in p.json_schema["properties"].items():
            if sub["type"] == "integer":
                assert isinstance(obj[key], int)
            elif sub["type"] == "string" and "enum" in sub:
                assert obj[key] in sub["enum"]
    free = [s.text for s in engine.run([engine.request(messages=p.messages, max_tokens=MAX_TOKENS, chain=())
                                        for p in PROMPTS])]
    assert any(t != s.text for t, s in zip(free, seqs))  # the grammar changed something


@pytest.mark.parametrize("chain", [(n,) for n in ALL] + [("grammar",), ALL + ("grammar",), DEFAULT],
                         ids=lambda c: ",".join(c))
def test_speculation_under_a_grammar_equals_target_only(engine, plain, chain):
    seqs = _run(engine, chain)
    assert [s.generated for s in seqs] == plain
    drafted = sum(s.spec_total.drafted for s in seqs)
    accepted = sum(s.spec_total.accepted for s in seqs)
    assert drafted > accepted > 0, (drafted, accepted)  # drafts were verified, and some rejected


def test_the_grammar_speculator_drafts_the_forced_text(engine, plain):
    spec = engine.scheduler.chain.speculator("grammar")
    before = spec.stats.to_dict()
    seqs = _run(engine, ("grammar",))
    after = spec.stats.to_dict()
    sent = after["drafts_chosen"] - before["drafts_chosen"]
    kept = after["tokens_accepted"] - before["tokens_accepted"]
    made = after["tokens_generated"] - before["tokens_generated"]
    n_out = sum(len(s.generated) for s in seqs)
    # keys, quotes, colons, commas: most of a short extraction's tokens are forced
    assert sent > len(PROMPTS) and kept > n_out / 4 and kept / made > 0.5, (sent, kept, made, n_out)
    # free text: the grammar speculator is asked but never drafts
    before = spec.stats.drafts_generated
    engine.run([engine.request(messages=p.messages, max_tokens=24, chain=("grammar",)) for p in PROMPTS[:4]])
    assert spec.stats.drafts_generated == before


def test_seeded_sampling_under_a_grammar_equals_target_only(engine):
    sp = SamplingParams(temperature=0.8, top_k=40, seed=1234)
    base = _run(engine, (), sp)
    spec = _run(engine, ALL + ("grammar",), sp)
    assert [s.generated for s in spec] == [s.generated for s in base]
    assert sum(s.spec_total.accepted for s in spec) > 0
    for s in spec:
        if s.finish_reason == "stop":
            json.loads(s.text)  # sampled text still follows the grammar


def test_penalties_and_bias_under_a_grammar_equal_target_only(engine):
    sp = SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, logit_bias={28: 3.0})
    base = [s.generated for s in _run(engine, (), sp)]
    assert [s.generated for s in _run(engine, DEFAULT, sp)] == base


def test_json_object_and_a_custom_gbnf(engine):
    msgs = [{"role": "user", "content": "Describe a cat as JSON."}]
    reqs = [engine.request(messages=msgs, max_tokens=160, chain=c, sampling=SamplingParams(grammar=JSON_OBJECT_GBNF))
            for c in ((), DEFAULT)]
    a, b = engine.run(reqs)
    assert a.generated == b.generated
    if a.finish_reason == "stop":
        assert isinstance(json.loads(a.text), dict)
    else:  # cut by max_tokens: still a JSON object's beginning
        assert a.text.lstrip().startswith("{")
    yes_no = 'root ::= ("yes" | "no") "."'
    seqs = engine.run([engine.request(messages=[{"role": "user", "content": q}], max_tokens=8, chain=c,
                                      sampling=SamplingParams(grammar=yes_no))
                       for q in ("Is the sky blue?", "Is fire cold?") for c in ((), DEFAULT)])
    assert all(s.text in ("yes.", "no.") for s in seqs), [s.text for s in seqs]
    assert seqs[0].generated == seqs[1].generated and seqs[2].generated == seqs[3].generated


def test_a_bad_grammar_is_refused_at_submit_and_the_engine_goes_on(engine, plain):
    for bad in ("root ::= undefined_rule", 'root ::= "open'):
        with pytest.raises(ValueError, match="does not compile"):
            engine.submit(engine.request(prompt="hi", max_tokens=4, sampling=SamplingParams(grammar=bad)))
    with pytest.raises(GrammarError, match="schema"):
        schema_to_gbnf({"type": "object", "properties": {"x": {"$ref": "#/definitions/missing"}}})
    assert [s.generated for s in _run(engine, ())] == plain  # nothing else disturbed


def test_grammar_state_checks_tokens_and_clones(smollm2):
    gc = GrammarCompiler(smollm2)
    g = gc(schema_to_gbnf({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}))
    toks = gc.tokenize('{"a": 12}')
    c = g.clone()
    for t in toks:
        assert g.allows(int(t))
        g.accept(int(t))
    assert not c.allows(gc.tokenize("}")[0]) and c.allows(gc.tokenize("{")[0])  # the clone did not move
    row = np.zeros(smollm2.n_vocab, dtype=np.float32)
    masked = g.mask(row)  # the object is complete: only an end of generation (or trailing space) may follow
    allowed = np.flatnonzero(np.isfinite(masked))
    assert 0 < len(allowed) < 10 and any(smollm2.is_eog(int(t)) for t in allowed)
    assert g.allowed(np.array(list(gc.char_tokens("a1{").values()), dtype=np.int32)).tolist() == [False] * 3
    g.close()
    c.close()


def test_a_grammar_is_parsed_once_per_compiler_and_each_use_gets_its_own_state(smollm2):
    """A request's grammar is checked at admission and at submit, then built for the sequence and the grammar
    speculator: one parse, every state a clone of the kept template, independent of the others."""
    gc = GrammarCompiler.of(smollm2)
    assert GrammarCompiler.of(smollm2) is gc  # the engine's parts share the model's compiler
    gbnf = schema_to_gbnf({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    before = gc.compiled
    gc.check(gbnf)
    a, b = gc(gbnf), gc(gbnf)
    assert gc.compiled == before + 1
    open_brace = int(gc.tokenize("{")[0])
    a.accept(open_brace)
    assert not a.allows(open_brace) and b.allows(open_brace)  # b is not moved by a
    with pytest.raises(GrammarError, match="does not compile"):
        gc.check("root ::= nothing_defined")
    assert gc.compiled == before + 1  # a failure is not kept
    for i in range(GrammarCompiler.TEMPLATES + 1):  # the oldest template is dropped; states in use stay valid
        gc.check(f'root ::= "x{i}"')
    assert (gbnf, "root") not in gc._templates and b.allows(open_brace)
    a.close()
    b.close()
