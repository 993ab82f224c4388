"""A GGUF file's metadata, read directly (no llama.cpp model load, no gguf.GGUFReader).

Used where a process needs a few keys of a GGUF it does not load: the target
reads which layers an EAGLE-3 or DFlash draft wants (`<arch>.target_layers`; a
vocab-only llama.cpp load does not fill them), and the synthetic-model writer
copies a real model's vocabulary. gguf.GGUFReader builds an object per array
element and takes seconds on a 49k-token vocabulary; this takes ~0.1 s.
"""

from __future__ import annotations

import functools
import os
import struct

import numpy as np

from .models import resolve_model

#: GGUF value types (gguf.GGUFValueType)
STRING, ARRAY = 8, 9
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
          12: "<f8"}

Metadata = dict[str, tuple[int, object, "int | None"]]


class _Short(Exception):
    """The buffer ended inside the metadata: read more of the file."""


def _parse(buf: bytes) -> Metadata:
    if buf[:4] != b"GGUF":
        raise ValueError("not a GGUF file")
    off = 4 + 4 + 8  # magic, version, tensor count
    (n_kv,) = struct.unpack_from("<Q", buf, off)
    off += 8
    end = len(buf)

    def take(fmt: str, o: int):
        size = struct.calcsize(fmt)
        if o + size > end:
            raise _Short
        return struct.unpack_from(fmt, buf, o), o + size

    def string(o: int) -> tuple[str, int]:
        (n,), o = take("<Q", o)
        if o + n > end:
            raise _Short
        return buf[o : o + n].decode("utf-8", "surrogateescape"), o + n

    out: Metadata = {}
    for _ in range(n_kv):
        key, off = string(off)
        (vtype,), off = take("<I", off)
        sub = None
        if vtype == ARRAY:
            (sub, n), off = take("<IQ", off)
            if sub == STRING:
                value: object = []
                for _ in range(n):
                    v, off = string(off)
                    value.append(v)
            else:
                size = n * np.dtype(_NUMPY[sub]).itemsize
                if off + size > end:
                    raise _Short
                value = np.frombuffer(buf, dtype=_NUMPY[sub], count=n, offset=off).tolist()
                off += size
        elif vtype == STRING:
            value, off = string(off)
        else:
            (value,), off = take(_SCALARS[vtype], off)
        out[key] = (vtype, value, sub)
    return out


@functools.cache
def _read(path: str, mtime: float) -> Metadata:
    size = 1 << 20
    total = os.path.getsize(path)
    while True:
        with open(path, "rb") as f:
            buf = f.read(size)
        try:
            return _parse(buf)
        except _Short:
            if size >= total:
                raise ValueError(f"{path}: truncated GGUF metadata") from None
            size *= 4
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


def read_metadata(model: str) -> Metadata:
    """key -> (GGUF value type, value, array element type or None) of a GGUF (alias or path)."""
    path = resolve_model(model)
    return _read(path, os.path.getmtime(path))


def meta_value(model: str, key: str, default=None):
    """One metadata value of a GGUF (alias or path), or `default` if the key is absent."""
    entry = read_metadata(model).get(key)
    return default if entry is None else entry[1]


def eagle3_target_layers(model: str) -> tuple[int, ...]:
    """The target layers an EAGLE-3 draft GGUF reads (`<arch>.target_layers`); ValueError if it has none."""
    arch = meta_value(model, "general.architecture")
    layers = meta_value(model, f"{arch}.target_layers")
    if arch != "eagle3" or not layers:
        raise ValueError(f"{model} is not an EAGLE-3 draft (architecture {arch!r}, no {arch}.target_layers)")
    return tuple(int(x) for x in layers)


def dflash_target_layers(model: str) -> tuple[int, ...]:
    """The target layers a DFlash draft GGUF reads (`dflash.target_layers`); ValueError if it has none."""
    arch = meta_value(model, "general.architecture")
    layers = meta_value(model, f"{arch}.target_layers")
    if arch != "dflash" or not layers:
        raise ValueError(f"{model} is not a DFlash draft (architecture {arch!r}, no {arch}.target_layers)")
    return tuple(int(x) for x in layers)
