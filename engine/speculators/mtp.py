"""mtp: the target's own NextN (multi-token prediction) head drafts, fed the target's hidden rows.

As llama.cpp's `draft-mtp` (PR 22673) with parallel slots: an MTP context on
the target's weights (LLAMA_CONTEXT_TYPE_MTP) holds one sequence per slot. Its
KV position q holds the pair (x_q, h_{q-1}): token q with the target's final
hidden state after token q-1 (llama.cpp's h_nextn, zeros before the first
token). Drafting seeds with (last sampled token, hidden state after the last
committed token) and chains the head on its own output row, one batched
decode per step for all slots. Everything else (row routing, deferred
decoding, rollback) is in hidden_base.py; the head is native/mtp_backend.py.
"""

from __future__ import annotations

from .hidden_base import HiddenBackend, HiddenDraftParams, HiddenStateSpeculator


class MtpParams(HiddenDraftParams):
    """Parameters of the `mtp` speculator."""


class MtpSpeculator(HiddenStateSpeculator):
    name = "mtp"
    pos_offset = 0

    def __init__(self, params: MtpParams | None, backend: HiddenBackend) -> None:
        super().__init__(params or MtpParams(), backend)
