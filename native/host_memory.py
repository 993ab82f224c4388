"""Host memory for saved KV cells (the prompt cache's host tier): buffers whose pages are in before the copy.

A sequence's saved cells take tens of MiB, and the save runs on the round thread, so every decoding sequence
waits for it. A zero-filled ctypes array takes a page fault for each of its 4 KiB pages and then clears them
all again. Anonymous memory mapped with `MAP_POPULATE` comes in whole, zero-filled by the kernel, in one
system call, and llama.cpp's copy then only writes. (Transparent huge pages would fault less still, but once
the kernel runs out of free 2 MiB pages each fault waits for it to compact memory: slower than either.)
Small buffers, and platforms without `MAP_POPULATE`, get a plain ctypes array.

The buffer is a ctypes array of bytes: it keeps its mapping alive, and the mapping goes back to the system
when the last reference to the array goes.

>>> buf = host_buffer(3 << 20)
>>> len(buf), bytes(buf[:4])          # zero-filled, like a new ctypes array
(3145728, b'\\x00\\x00\\x00\\x00')
>>> buf[7] = 255; buf[7]
255
>>> len(host_buffer(16)), len(host_buffer(0))
(16, 0)
"""

from __future__ import annotations

import ctypes
import mmap

#: below this size a plain ctypes array: a mapping per buffer pays a system call and rounds up to a page
MAPPED_MIN_BYTES = 1 << 20


def host_buffer(size: int) -> ctypes.Array:
    """A writable, zero-filled `size`-byte ctypes array, its pages present (module docstring)."""
    populate = getattr(mmap, "MAP_POPULATE", None)
    if size < MAPPED_MIN_BYTES or populate is None:
        return (ctypes.c_uint8 * max(size, 0))()
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
    return (ctypes.c_uint8 * size).from_buffer(mapping)
