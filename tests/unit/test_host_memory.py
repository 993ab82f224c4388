"""Host-tier buffers (native/host_memory.py): mapped or plain, they are zero-filled, writable, the size asked,
and they outlive every name but their own; the pool hands a dropped save's buffer to a later save it fits."""

from __future__ import annotations

import ctypes
import doctest
import gc
import mmap

import pytest

from specray.native import host_memory
from specray.native.host_memory import (MAPPED_MIN_BYTES, POOL_SLACK, HostBufferPool, SavedCells, host_buffer,
                                         size_class)


def test_doctests():
    assert doctest.testmod(host_memory).failed == 0


def test_a_mapped_buffer_is_zeroed_writable_and_whole():
    size = MAPPED_MIN_BYTES + 123  # not a multiple of any page size
    buf = host_buffer(size)
    assert isinstance(buf, ctypes.Array) and len(buf) == size and ctypes.sizeof(buf) == size
    assert bytes(buf[:4096]) == bytes(4096) and bytes(buf[size - 4096:]) == bytes(4096)
    buf[0], buf[size - 1] = 7, 9
    ctypes.memset(ctypes.addressof(buf) + size // 2, 0xAB, 4096)  # as llama.cpp writes: through the address
    assert (buf[0], buf[size - 1], buf[size // 2], buf[size // 2 + 4095]) == (7, 9, 0xAB, 0xAB)
    # a save shorter than its buffer (a reused one) reads the same memory
    saved = SavedCells(buf, 16)
    assert len(saved) == size and saved.to_bytes()[0] == 7 and len(saved.to_bytes()) == 16


def test_a_large_buffer_is_mapped_with_its_pages_in(monkeypatch):
    calls = []
    real = host_memory.mmap.mmap

    def recording(*args, **kwargs):
        calls.append(kwargs.get("flags", 0))
        return real(*args, **kwargs)

    monkeypatch.setattr(host_memory.mmap, "mmap", recording)
    assert len(host_buffer(MAPPED_MIN_BYTES)) == MAPPED_MIN_BYTES
    if not hasattr(mmap, "MAP_POPULATE"):
        pytest.skip("no MAP_POPULATE here: plain arrays only")
    assert len(calls) == 1 and calls[0] & mmap.MAP_POPULATE and calls[0] & mmap.MAP_ANONYMOUS


def test_the_buffer_keeps_its_mapping_alive():
    buf = host_buffer(MAPPED_MIN_BYTES)
    addr = ctypes.addressof(buf)
    buf[100] = 42
    gc.collect()  # nothing else names the mapping now
    assert ctypes.c_uint8.from_address(addr + 100).value == 42


def test_small_buffers_are_plain_arrays(monkeypatch):
    def no_mapping(*args, **kwargs):
        raise AssertionError("a small buffer must not be mapped")

    monkeypatch.setattr(host_memory.mmap, "mmap", no_mapping)
    buf = host_buffer(MAPPED_MIN_BYTES - 1)
    assert len(buf) == MAPPED_MIN_BYTES - 1 and bytes(buf[:8]) == bytes(8)


def test_saved_cells_refuse_a_length_their_buffer_cannot_hold():
    buf = host_buffer(64)
    for n in (0, 65):
        with pytest.raises(ValueError, match="bytes saved in a buffer of 64"):
            SavedCells(buf, n)


def test_the_pool_gives_the_smallest_kept_buffer_a_save_fits_within_the_slack():
    pool = HostBufferPool(max_buffers=3)
    bufs = [host_buffer(n) for n in (1000, 1200, 5000)]
    for b in bufs:
        pool.give(SavedCells(b, len(b)))
    assert pool.held_bytes == 7200
    assert pool.take(990) is bufs[0]            # 1000 and 1200 both fit: the smaller
    assert pool.take(990) is bufs[1]            # then the next that fits
    big = pool.take(3000)                        # 5000 is beyond 3000 x the slack: a new buffer
    assert big is not bufs[2] and len(big) == size_class(3000) == 3072 and 5000 > 3000 * POOL_SLACK
    assert pool.take(4500) is bufs[2] and pool.reused == 3 and pool.held_bytes == 0


def test_the_pool_keeps_only_the_latest_buffers():
    pool = HostBufferPool(max_buffers=2)
    bufs = [host_buffer(100) for _ in range(3)]
    for b in bufs:
        pool.give(SavedCells(b, 100))
    assert pool.held_bytes == 200
    assert {id(pool.take(100)), id(pool.take(100))} == {id(bufs[1]), id(bufs[2])}
    assert pool.take(100) is not bufs[0] and pool.reused == 2


def test_a_size_class_is_at_most_an_eighth_more():
    for n in [9, 15, 16, 17, 100, 4095, 4097, 10**6, 37_373_680, 2**31 + 1]:
        c = size_class(n)
        assert n <= c <= n * 1.125 and size_class(c) == c, n
