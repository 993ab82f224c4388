"""The engine's compiled cores (setup.py builds them): which run compiled here. A core that is not built, or whose
class switch (`SuffixTrie.compiled`, `NgramCountTable.compiled`, `NgramModPool.compiled`, `ValueEstimates.compiled`)
is off, leaves its pure-Python reference running: the same results, more host time a round."""

from __future__ import annotations

from .policy import estimates
from .speculators import ngram_cache, ngram_mod, suffix


def cores_in_use() -> dict[str, bool]:
    """Per module with a compiled core (a speculator, or the policy's estimates): whether its core runs here (built,
    and switched on).

    >>> sorted(cores_in_use())
    ['estimates', 'ngram_cache', 'ngram_mod', 'suffix']
    """
    return {"suffix": suffix.COMPILED_CORE and bool(suffix.SuffixTrie.compiled),
            "ngram_cache": ngram_cache.COMPILED_CORE and bool(ngram_cache.NgramCountTable.compiled),
            "ngram_mod": ngram_mod.COMPILED_CORE and bool(ngram_mod.NgramModPool.compiled),
            "estimates": estimates.COMPILED_CORE and bool(estimates.ValueEstimates.compiled)}
