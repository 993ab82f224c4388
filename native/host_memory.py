"""Host memory for saved KV cells (the prompt cache's host tier): buffers whose pages are in before the copy.

A sequence's saved cells take tens of MiB, and the save runs on the round thread, so every decoding sequence
waits for it. Most of a save into new memory is the kernel supplying that memory's pages; the copy itself is
a fraction of it. So:

- `HostBufferPool` keeps the buffers of the last entries the host tier dropped (at most `POOL_BUFFERS`) and
  gives one to the next save it fits (no more than `POOL_SLACK` times the save's size: the tier counts whole
  buffers). A tier at its budget drops an entry about as often as it saves one, and a dropped buffer waits
  here for the next save, so in a long run most saves reuse a buffer. A new buffer is a `size_class` (up to
  an eighth larger than its save), so a conversation's next, somewhat longer turn fits in the buffer of its
  last one. The tier counts the kept buffers against its budget (engine/host_tier.py `kept_bytes`).
- Otherwise `host_buffer`. Below `MAPPED_MIN_BYTES` it is a plain ctypes array: the C library serves it from
  memory freed before where it can (glibc's threshold for mapping a block of its own grows up to 32 MiB as
  big blocks are freed). From there on the C library maps new memory for every block, which ctypes then
  clears page fault by page fault; `host_buffer` maps it with `MAP_POPULATE` instead, so the pages come in
  one system call, zero-filled by the kernel. (Transparent huge pages would fault less still, but once the
  kernel runs out of free 2 MiB pages each fault waits for it to compact memory: slower than either.)
  Platforms without `MAP_POPULATE` get a plain ctypes array.

A buffer is a ctypes array of bytes: it keeps its mapping alive, and the mapping goes back to the system
when the last reference to the array goes.

>>> buf = host_buffer(3 << 20)
>>> len(buf), bytes(buf[:4])          # zero-filled, as a new ctypes array is
(3145728, b'\\x00\\x00\\x00\\x00')
>>> pool = HostBufferPool()
>>> saved = SavedCells(buf, 3_000_000)               # a save that wrote 3,000,000 bytes into it
>>> pool.give(saved)
>>> pool.take(2_900_000) is buf, pool.held_bytes     # reused for a save it fits
(True, 0)
>>> len(pool.take(1_000_000))                        # none fits: a new one, of its size class
1048576
"""

from __future__ import annotations

import ctypes
import mmap

#: from this size on a mapping of its own (module docstring): glibc's largest threshold for mapping a block
MAPPED_MIN_BYTES = 32 << 20
#: dropped entries' buffers kept for the next saves
POOL_BUFFERS = 2
#: a kept buffer serves a save of at least 1 / POOL_SLACK of its size
POOL_SLACK = 1.25


def host_buffer(size: int) -> ctypes.Array:
    """A writable, zero-filled `size`-byte ctypes array, its pages present (module docstring)."""
    populate = getattr(mmap, "MAP_POPULATE", None)
    if size < MAPPED_MIN_BYTES or populate is None:
        return (ctypes.c_uint8 * max(size, 0))()
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
    return (ctypes.c_uint8 * size).from_buffer(mapping)


def size_class(size: int) -> int:
    """`size` rounded up to one of 8 steps per doubling: at most an eighth more.

    >>> [size_class(n) for n in (5, 100, 1000, 1025, 3 << 20)]
    [5, 104, 1024, 1152, 3145728]
    """
    if size <= 8:
        return size
    step = 1 << (size.bit_length() - 4)
    return -(-size // step) * step


class SavedCells:
    """A sequence's cells saved to host memory (Context.save_seq): the first `n_bytes` of `buffer`, which may
    be larger (a reused one). len() is the host memory it holds: the whole buffer."""

    __slots__ = ("buffer", "n_bytes")

    def __init__(self, buffer: ctypes.Array, n_bytes: int) -> None:
        if not 0 < n_bytes <= len(buffer):
            raise ValueError(f"{n_bytes} bytes saved in a buffer of {len(buffer)}")
        self.buffer, self.n_bytes = buffer, n_bytes

    def __len__(self) -> int:
        return len(self.buffer)

    def to_bytes(self) -> bytes:
        """The saved bytes, copied."""
        return bytes(memoryview(self.buffer)[: self.n_bytes])


class HostBufferPool:
    """Buffers of dropped saves, handed to the next saves they fit (module docstring). Not thread-safe: its
    Context's callers serialise (one round thread)."""

    def __init__(self, max_buffers: int = POOL_BUFFERS, slack: float = POOL_SLACK) -> None:
        self.max_buffers, self.slack = max_buffers, slack
        self._free: list[ctypes.Array] = []  # oldest first
        self.reused = 0  # saves that got a kept buffer

    @property
    def held_bytes(self) -> int:
        """Host memory in the buffers kept."""
        return sum(len(b) for b in self._free)

    def take(self, size: int) -> ctypes.Array:
        """The smallest kept buffer that holds `size` bytes within the slack, else a new `host_buffer` of
        `size_class(size)` bytes."""
        fits = [b for b in self._free if size <= len(b) <= size * self.slack]
        if not fits:
            return host_buffer(size_class(size))
        buf = min(fits, key=len)
        self._free = [b for b in self._free if b is not buf]
        self.reused += 1
        return buf

    def give(self, saved: SavedCells) -> None:
        """A save the host tier no longer holds: its buffer is kept for a later save (the oldest kept goes
        beyond `max_buffers`). Its bytes must not be read after this."""
        self._free.append(saved.buffer)
        del self._free[: max(0, len(self._free) - self.max_buffers)]
