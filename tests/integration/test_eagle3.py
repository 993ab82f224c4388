"""The `eagle3` speculator co-located: SmolLM2-135M as the target, a synthetic EAGLE-3 draft for it.

The draft has random weights, so its drafts are (almost) never accepted: the
test is about losslessness and plumbing. Exact mode; the three layer inputs
(layers 2, 15, 27) the target hands the draft are checked position by
position against the rows of each sequence decoded alone.
"""

from __future__ import annotations

import numpy as np
import pytest

from specray.deployments.local_engine import LocalEngine
from specray.engine.config import ChainConfig, EngineConfig, HiddenStateConfig
from specray.engine.request import SeqState

from ..conftest import spec_bench_prompts
from ..hidden_models import eagle3_draft, solo_rows

pytestmark = pytest.mark.model

SLOTS = 4
N_PROMPTS = 4
MAX_TOKENS = 16
N_CTX = 512 * SLOTS


def engine(model, e3: str | None) -> LocalEngine:
    cfg = EngineConfig(model="smollm2-135m", slots=SLOTS, n_ctx=N_CTX, exact=True, calibrate=False,
                       chain=ChainConfig(speculators=[], policy="first", n_max=8,
                                         params={"eagle3": {"n_max": 3, "audit": True}}),
                       hidden=HiddenStateConfig(eagle3_model=e3))
    return LocalEngine(cfg, model=model)


def requests(eng, prompts, chain):
    return [eng.request(messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS, chain=chain,
                        ignore_eos=True) for p in prompts]


def test_eagle3_lossless_with_three_layer_rows_routed(smollm2):
    prompts = spec_bench_prompts(N_PROMPTS)
    base_eng = engine(smollm2, None)
    base = [s.generated for s in base_eng.run(requests(base_eng, prompts, ()))]
    base_eng.close()
    eng = engine(smollm2, eagle3_draft())
    try:
        head = eng.hidden_heads.named()["eagle3"]
        assert head.taps == (2, 15, 27) and eng.runner.hidden_out.tap_widths == (576, 576, 576)
        reqs = requests(eng, prompts, ("eagle3",))
        seqs = [eng.submit(r) for r in reqs]
        solo = solo_rows(smollm2, head.taps, [np.concatenate([r.prompt_tokens, base[i]]) for i, r in enumerate(reqs)],
                         n_ctx=N_CTX, slots=SLOTS)
        index = {s.id: i for i, s in enumerate(seqs)}
        spec = eng.chain.speculator("eagle3")
        checked = 0
        while eng.scheduler.has_work():
            eng.step()
            for slot, seq in eng.scheduler.active.items():
                if seq.state != SeqState.DECODING:
                    continue
                audit, want, hist = spec.audit[slot], solo[index[seq.id]], seq.history_view()
                assert sorted(audit) == list(range(seq.n_past))
                for pos in (0, seq.n_past // 2, seq.n_past - 1):
                    assert audit[pos][0] == hist[pos] and np.array_equal(audit[pos][1], want[pos])
                # EAGLE-3 pairs (x_{q+1}, g_q) at q: the KV holds committed tokens 1..n-1 (+ the seed)
                kv = spec.kv_tokens(slot)
                assert head.pos_max(slot) + 1 == len(kv) <= seq.n_past
                assert kv.tolist() == hist[1 : 1 + len(kv)].tolist()
                checked += 1
        assert checked > 0
        assert [s.generated for s in seqs] == base
        assert eng.runner.max_seqs_in_decode >= SLOTS
        st, c = spec.stats, spec.counters
        assert st.tokens_generated > 0 and c.steps > 0 and head.encodes > 0
        assert c.mismatched == c.unsynced == c.lost == c.failures == 0
        print(f"\neagle3: {st.tokens_accepted}/{st.tokens_generated} accepted (random draft), counters {c}")
    finally:
        eng.close()
