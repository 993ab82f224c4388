"""The bench's verify-shape axis: a configuration `CHAIN@bucketed` runs CHAIN with shape-stable verifies.

`specray bench --verify-shape both` runs every chain both ways in one run (each on its own engine, in
lockstep), so what padding costs on this machine is measured against the same prompts, at the same time.
`none` stays the one baseline: it never drafts, and with the default buckets (1 among them) a plain
decode is never padded.
"""

from __future__ import annotations

from specray.engine.config import parse_chain

SHAPES = ("exact", "bucketed", "both")
SUFFIX = "@bucketed"
#: a configuration `CHAIN@overlap` runs CHAIN with overlapped rounds (EngineConfig.overlap), on its own engine
OVERLAP = "@overlap"


def overlap_of(name: str) -> tuple[str, bool]:
    """A bench configuration without its overlap suffix, and whether it runs overlapped rounds.

    >>> overlap_of("ngram_mod,suffix@bucketed@overlap"), overlap_of("none")
    (('ngram_mod,suffix@bucketed', True), ('none', False))
    """
    return (name[: -len(OVERLAP)], True) if name.endswith(OVERLAP) else (name, False)


def split_config(name: str) -> tuple[str, str]:
    """A bench configuration's chain label and verify shape.

    >>> split_config("ngram_mod,suffix@bucketed"), split_config("suffix@overlap")
    (('ngram_mod,suffix', 'bucketed'), ('suffix', 'exact'))
    """
    name = overlap_of(name)[0]
    if name.endswith(SUFFIX):
        return name[: -len(SUFFIX)], "bucketed"
    return name, "exact"


def chain_of(name: str) -> list[str]:
    """The speculator names of a bench configuration.

    >>> chain_of("ngram_mod,suffix@bucketed"), chain_of("suffix/suffix.p_min=0.2"), chain_of("suffix+tune")
    (['ngram_mod', 'suffix'], ['suffix'], ['suffix'])
    >>> chain_of("ngram_mod,suffix+trees")
    ['ngram_mod', 'suffix']
    """
    from .variants import tree_mode, variant

    return parse_chain(variant(tree_mode(split_config(name)[0])[0])[0])


def expand_configs(configs: list[str], verify_shape: str) -> list[str]:
    """The configurations to run for --verify-shape: exact (as given), bucketed (each chain bucketed instead)
    or both (each chain both ways); `none` and names already suffixed stay as they are.

    >>> expand_configs(["none", "ngram_mod,suffix"], "both")
    ['none', 'ngram_mod,suffix', 'ngram_mod,suffix@bucketed']
    >>> expand_configs(["none", "suffix", "suffix@overlap"], "bucketed")
    ['none', 'suffix@bucketed', 'suffix@bucketed@overlap']
    """
    if verify_shape not in SHAPES:
        raise ValueError(f"verify_shape must be one of {', '.join(SHAPES)}, got {verify_shape!r}")
    out: list[str] = []
    for c in configs:
        base, overlap = overlap_of(c)
        if base == "none" or base.endswith(SUFFIX) or verify_shape == "exact":
            names = [base]
        elif verify_shape == "bucketed":
            names = [base + SUFFIX]
        else:
            names = [base, base + SUFFIX]
        out.extend(n + OVERLAP * overlap for n in names if n + OVERLAP * overlap not in out)
    return out
