"""eagle3: an EAGLE-3 draft model drafts from three of the target's layer inputs.

As llama.cpp's `draft-eagle3`: the draft's encoder fuses the target's three
layer-input rows of token q (concatenated, [3 x n_embd_target]) into g_q; its
single decoder layer reads the pair (x_{q+1}, g_q) at KV position q (one
position behind MTP's pairing: `pos_offset` -1), and while drafting it feeds
back its own pre-norm output row instead of g. The pair of the last committed
position needs the next token, so it is the seed of the next draft (llama.cpp's
"deferred boundary"). Row routing and rollback: hidden_base.py; the model:
native/eagle3_backend.py.
"""

from __future__ import annotations

from .hidden_base import HiddenBackend, HiddenDraftParams, HiddenStateSpeculator


class Eagle3Params(HiddenDraftParams):
    """Parameters of the `eagle3` speculator."""


class Eagle3Speculator(HiddenStateSpeculator):
    name = "eagle3"
    pos_offset = -1

    def __init__(self, params: Eagle3Params | None, backend: HiddenBackend) -> None:
        super().__init__(params or Eagle3Params(), backend)
