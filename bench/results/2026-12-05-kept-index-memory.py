"""What a kept index holds in memory per token it indexed (engine/speculators/kept_states.py): one request of
1,700 tokens of Spec-Bench prompts begun and ended on a fresh ngram_cache (no dynamic table) and a fresh suffix
(no global trie), the allocations the kept state keeps measured with tracemalloc.

Run: .venv/bin/python bench/results/2026-12-05-kept-index-memory.py
"""
import tracemalloc

import numpy as np

from specray.bench.prompts import default_prompts_path, load_prompts
from specray.engine.speculators.ngram_cache import NgramCacheParams, NgramCacheSpeculator
from specray.engine.speculators.suffix import SuffixParams, SuffixSpeculator
from specray.native.model import Model

m = Model("smollm2-135m")
ps = load_prompts(default_prompts_path(), ["rag", "summarization", "coding", "qa"], 3)
toks = np.concatenate([m.tokenize(m.apply_chat_template(p.messages) if p.messages else p.prompt) for p in ps])[:1700]
for sp in (NgramCacheSpeculator(NgramCacheParams(update_dynamic=False)),
           SuffixSpeculator(SuffixParams(global_max_seqs=0))):
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    sp.begin(0, toks)
    sp.prefilling(0, len(toks))  # the prompt is indexed as the target prefills it
    sp.end(0)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    print(f"{sp.name}: {len(sp.kept)} kept, {grown / len(toks):.0f} bytes per token indexed")
