"""Host-tier buffers (native/host_memory.py): mapped or plain, they are zero-filled, writable, the size asked,
and they outlive every name but their own."""

from __future__ import annotations

import ctypes
import doctest
import gc
import mmap

import pytest

from specray.native import host_memory
from specray.native.host_memory import MAPPED_MIN_BYTES, host_buffer


def test_doctests():
    assert doctest.testmod(host_memory).failed == 0


def test_a_mapped_buffer_is_zeroed_writable_and_whole():
    size = 5 * MAPPED_MIN_BYTES + 123  # not a multiple of any page size
    buf = host_buffer(size)
    assert isinstance(buf, ctypes.Array) and len(buf) == size and ctypes.sizeof(buf) == size
    assert bytes(buf[:4096]) == bytes(4096) and bytes(buf[size - 4096:]) == bytes(4096)
    buf[0], buf[size - 1] = 7, 9
    ctypes.memset(ctypes.addressof(buf) + MAPPED_MIN_BYTES, 0xAB, 4096)  # as llama.cpp writes: through the address
    assert (buf[0], buf[size - 1], buf[MAPPED_MIN_BYTES], buf[MAPPED_MIN_BYTES + 4095]) == (7, 9, 0xAB, 0xAB)
    # a save shorter than its size is kept as a view (Context.save_seq): it reads the same memory
    view = (ctypes.c_uint8 * 16).from_buffer(buf)
    assert view[0] == 7


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
    buf = host_buffer(2 * MAPPED_MIN_BYTES)
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
