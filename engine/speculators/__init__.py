"""Every speculator type, one module each, and the registry that builds them by name.

Model-free (pure Python + numpy, drafting in-process): ngram_simple, ngram_map_k,
ngram_map_k4v, ngram_mod, ngram_cache, suffix. Model speculators (draft, mtp,
eagle3, dflash): the engine-side halves only, written against a backend protocol
(draft_base.py, hidden_base.py, dflash.py); the model itself runs in native/ (in-process)
or in the companion actor (deployments/actors/), which the registry's caller
supplies. Imports nothing outside specray.engine. suffix's trie, ngram_cache's
count tables and ngram_mod's pool have compiled cores (_suffix_core.c, _ngram_core.c,
_ngram_mod_core.c, built by setup.py; engine/cores.py says which run), each held equal
to a pure-Python reference in its module.
"""
