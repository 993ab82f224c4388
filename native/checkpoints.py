"""Saved recurrent states of a context's sequences, in buffers reused round after round.

A recurrent layer (Mamba, RWKV, LFM2's short convolution) keeps one state per
sequence and cannot drop the tokens of a rejected draft from it. Before a
verify that carries drafts the target saves the drafted sequences' states
here; after a partial acceptance it restores them and replays the accepted
tokens (engine/rollback.py). Only the recurrent part is copied
(LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY): a hybrid's attention KV is trimmed with
seq_rm as usual. Each sequence's buffer is sized once (the state's size does
not change with the context's length) and reused: no allocation per round.
"""

from __future__ import annotations

import ctypes

import llama_cpp

#: only the partial (recurrent) part of a sequence's state: never the attention KV of a hybrid
PARTIAL_ONLY = 1


class StateError(RuntimeError):
    """llama.cpp refused to save or restore a sequence's state: that sequence cannot go on."""


class SeqCheckpoints:
    def __init__(self, ctx) -> None:
        self.ctx = ctx  # specray.native.Context
        self._bufs: dict[int, ctypes.Array] = {}
        self._used: dict[int, int] = {}  # seq_id -> bytes of its saved state (0: none saved)

    def save(self, seq_id: int) -> int:
        """Save seq_id's recurrent state; returns its size in bytes. Raises StateError."""
        buf = self._bufs.get(seq_id)
        n = self._write(seq_id, buf) if buf is not None else 0
        if n == 0:  # first save of this sequence, or its state grew: size the buffer and try again
            size = int(llama_cpp.llama_state_seq_get_size_ext(self.ctx.ptr, seq_id, PARTIAL_ONLY))
            if size == 0:
                raise StateError(f"llama.cpp reports no recurrent state to save for sequence {seq_id}")
            buf = self._bufs[seq_id] = (ctypes.c_uint8 * size)()
            n = self._write(seq_id, buf)
            if n == 0:
                raise StateError(f"llama.cpp failed to save the recurrent state of sequence {seq_id}")
        self._used[seq_id] = n
        return n

    def _write(self, seq_id: int, buf: ctypes.Array) -> int:
        return int(llama_cpp.llama_state_seq_get_data_ext(self.ctx.ptr, buf, len(buf), seq_id, PARTIAL_ONLY))

    def restore(self, seq_id: int) -> None:
        """Put seq_id's saved recurrent state back (the attention KV, if any, is the caller's to trim).
        Raises StateError: nothing saved, or llama.cpp refused it."""
        n = self._used.get(seq_id, 0)
        if n == 0:
            raise StateError(f"no saved state to restore for sequence {seq_id}")
        read = int(llama_cpp.llama_state_seq_set_data_ext(self.ctx.ptr, self._bufs[seq_id], n, seq_id, PARTIAL_ONLY))
        if read == 0:
            raise StateError(f"llama.cpp failed to restore the recurrent state of sequence {seq_id}")

    def drop(self, seq_id: int) -> None:
        """Forget seq_id's saved state (its buffer stays for the slot's next sequence)."""
        self._used[seq_id] = 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(len(b) for b in self._bufs.values())
