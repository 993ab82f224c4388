"""A llama_batch over numpy buffers, holding rows of many sequences.

llama_batch_init mallocs one seq_id array per token, which makes filling a
batch a per-token Python loop. Here every buffer is a numpy array and
`seq_id[i]` points at element i of one int32 array, so a whole sequence's rows
are written with slice assignments.
"""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np


class Batch:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.token = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        self.seq_ids = np.zeros(capacity, dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        base = self.seq_ids.ctypes.data
        self._seq_ptrs = (ctypes.POINTER(llama_cpp.llama_seq_id) * capacity)(
            *[ctypes.cast(base + 4 * i, ctypes.POINTER(llama_cpp.llama_seq_id)) for i in range(capacity)]
        )
        self.n_tokens = 0
        self.n_outputs = 0
        self.struct = llama_cpp.llama_batch()
        self.struct.token = self.token.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token))
        self.struct.embd = ctypes.POINTER(ctypes.c_float)()
        self.struct.pos = self.pos.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_pos))
        self.struct.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.struct.seq_id = self._seq_ptrs
        self.struct.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))

    def clear(self) -> None:
        self.n_tokens = 0
        self.n_outputs = 0

    def add_seq(self, seq_id: int, tokens: np.ndarray, pos0: int, n_logits: int) -> int:
        """Append a run of one sequence's tokens at positions pos0...; the last
        n_logits rows output logits. Returns the batch index of the run's first row."""
        n = len(tokens)
        i = self.n_tokens
        if i + n > self.capacity:
            raise ValueError(f"batch overflow: {i + n} tokens > capacity {self.capacity}")
        self.token[i : i + n] = tokens
        self.pos[i : i + n] = np.arange(pos0, pos0 + n, dtype=np.int32)
        self.seq_ids[i : i + n] = seq_id
        self.logits[i : i + n] = 0
        if n_logits:
            self.logits[i + n - n_logits : i + n] = 1
        self.n_tokens += n
        self.n_outputs += n_logits
        return i

    def as_struct(self) -> llama_cpp.llama_batch:
        self.struct.n_tokens = self.n_tokens
        return self.struct
