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
    """`max_seqs`: the most sequence ids one row may carry (a draft tree's row shared by several branches:
    `add_rows`); 1 for batches whose rows each belong to one sequence."""

    def __init__(self, capacity: int, max_seqs: int = 1) -> None:
        self.capacity = capacity
        self.max_seqs = max_seqs
        self.token = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        self._ids = np.zeros((capacity, max_seqs), dtype=np.int32)  # row i's ids: _ids[i, :n_seq_id[i]]
        self.seq_ids = self._ids[:, 0]  # each row's first id (a view)
        self.logits = np.zeros(capacity, dtype=np.int8)
        base, stride = self._ids.ctypes.data, 4 * max_seqs
        self._seq_ptrs = (ctypes.POINTER(llama_cpp.llama_seq_id) * capacity)(
            *[ctypes.cast(base + stride * i, ctypes.POINTER(llama_cpp.llama_seq_id)) for i in range(capacity)]
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
        if n == 1:  # most runs (plain decoding, no draft sent): item writes run far less of numpy than slices
            self.token[i] = tokens[0]
            self.pos[i] = pos0
            self.seq_ids[i] = seq_id
            self.n_seq_id[i] = 1
            self.logits[i] = 1 if n_logits else 0
            self.n_tokens += 1
            self.n_outputs += n_logits
            return i
        self.token[i : i + n] = tokens
        self.pos[i : i + n] = np.arange(pos0, pos0 + n, dtype=np.int32)
        self.seq_ids[i : i + n] = seq_id
        self.n_seq_id[i : i + n] = 1
        self.logits[i : i + n] = 0
        if n_logits:
            self.logits[i + n - n_logits : i + n] = 1
        self.n_tokens += n
        self.n_outputs += n_logits
        return i

    def add_rows(self, tokens: np.ndarray, pos: np.ndarray, seqs: list[list[int]]) -> int:
        """Append rows, row j at position pos[j] in every sequence of seqs[j] (its first id decides what it
        attends: llama.cpp masks by a row's first sequence), all with logits. Returns the first row's index."""
        n = len(tokens)
        i = self.n_tokens
        if i + n > self.capacity:
            raise ValueError(f"batch overflow: {i + n} tokens > capacity {self.capacity}")
        self.token[i : i + n] = tokens
        self.pos[i : i + n] = pos
        for j, ids in enumerate(seqs):
            if not 0 < len(ids) <= self.max_seqs:
                raise ValueError(f"a row carries 1 to {self.max_seqs} sequence ids, got {len(ids)}")
            self._ids[i + j, : len(ids)] = ids
            self.n_seq_id[i + j] = len(ids)
        self.logits[i : i + n] = 1
        self.n_tokens += n
        self.n_outputs += n
        return i

    def as_struct(self) -> llama_cpp.llama_batch:
        self.struct.n_tokens = self.n_tokens
        return self.struct
