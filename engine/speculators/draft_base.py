"""What model-based speculators share: their parameters and a price per draft.

A model-free speculator drafts for free (microseconds of Python); a draft
model pays one batched decode per draft step. The chain's cost policy asks a
`ModelSpeculator` how long a draft would take (`draft_seconds`) before it
asks for one, so a model draft is only made where its expected accepted
tokens beat both a cheaper speculator's draft and plain decoding.
"""

from __future__ import annotations

from abc import abstractmethod

import numpy as np

from pydantic import BaseModel, ConfigDict, Field

from specray.engine.speculator import TOKEN_DTYPE, Speculator


class ModelDraftParams(BaseModel):
    """What every model speculator takes (llama.cpp's --draft-max/-min/-p-min defaults)."""

    model_config = ConfigDict(extra="forbid")

    n_max: int = Field(3, ge=1, le=64, description="draft steps (model decodes) per sequence per round at most")
    n_min: int = Field(0, ge=0, le=64, description="drafts shorter than this many tokens are dropped")
    p_min: float = Field(
        0.0, ge=0.0, le=1.0,
        description="a sequence stops drafting when the model's probability of its next token is below this",
    )


class DraftParams(ModelDraftParams):
    """Parameters of the `draft` speculator (a separate draft model)."""

    window: int = Field(
        16, ge=1, le=256, description="cross-vocab: draft-vocab tokens at the end of the text retokenised per round"
    )
    keep_last: bool | None = Field(
        True,
        description="cross-vocab: keep the last target token of a translated draft although more text could merge "
        "into it (such a token is kept by the target about as often as the draft's others); False drops it; None "
        "keeps it only when it ends in punctuation or a newline",
    )


class ModelSpeculator(Speculator):
    """A speculator whose drafts cost model time; the chain prices them before asking."""

    #: draft steps a draft of this speculator takes at most
    max_steps: int = 1

    @abstractmethod
    def draft_seconds(self, n_seqs: int, n_steps: int) -> float:
        """Expected wall time of drafting n_steps tokens for n_seqs sequences at once, in the steady state
        (each sequence's draft cache one or two tokens behind its history)."""

    def shift(self, seq_id: int, n_keep: int, n_discard: int) -> None:
        """Context shift: a model speculator's cache holds positions. This default starts the sequence afresh;
        its next draft catches up on the shifted tokens (subclasses shift their own cache where they can)."""
        self.end(seq_id)
        self.begin(seq_id, np.zeros(0, dtype=TOKEN_DTYPE))

    def catchup_seconds(self, seq_id: int, history) -> float:
        """Extra time before seq_id can draft: its draft cache lags its history by more than the steady
        state (a model drafts lazily: a sequence not drafted for a while, or never, must be caught up,
        up to a whole prompt)."""
        return 0.0


class SlotMirror:
    """Accessors of a model speculator that mirrors each sequence into its own KV cache: `self.seqs` maps a
    sequence id to its state, with the target tokens mirrored (`committed`) and the tokens in the cache
    (`kv`: draft-vocab tokens for a draft model, head input tokens for a head), both token buffers."""

    seqs: dict

    def committed(self, seq_id: int) -> np.ndarray:
        """The target tokens mirrored for seq_id (what the target's KV cache holds)."""
        st = self.seqs.get(seq_id)
        return st.committed.view().copy() if st else np.zeros(0, dtype=TOKEN_DTYPE)

    def kv_tokens(self, seq_id: int) -> np.ndarray:
        """Tokens in this speculator's KV cache for seq_id, by position."""
        st = self.seqs.get(seq_id)
        return st.kv.view().copy() if st else np.zeros(0, dtype=TOKEN_DTYPE)
