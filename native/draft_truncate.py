"""Self-drafting: a copy of a GGUF model that keeps only some of its layers.

The copy shares the target's vocabulary, embeddings and output head, so it
passes the vocabulary check as it is and drafts with no translation; its
decode step costs roughly (kept layers + head) / (all layers + head) of the
target's. No training: how often its guesses survive verification is what
the bench measures. Written with the `gguf` package (a dev dependency).

    path = truncated_copy("smollm2-135m", [0, 1, 2, 3, 4, 5, 6, 7, 29])
    specray bench --model smollm2-135m --configs none draft --draft-model PATH
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

from .models import resolve_model

_BLOCK = re.compile(r"^blk\.(\d+)\.(.*)$")


def cache_dir() -> str:
    d = os.path.join(os.path.expanduser(os.environ.get("XDG_CACHE_HOME", "~/.cache")), "specray", "models")
    os.makedirs(d, exist_ok=True)
    return d


def write_truncated_gguf(src: str, dst: str, layers: Sequence[int]) -> str:
    """Copy GGUF `src` to `dst` keeping the transformer blocks `layers` (renumbered 0..n-1, in the
    given order); metadata and every non-block tensor are copied unchanged except the block count."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    n_old = int(reader.get_field(f"{arch}.block_count").contents())
    layers = [int(x) for x in layers]
    if not layers or any(not 0 <= x < n_old for x in layers) or len(set(layers)) != len(layers):
        raise ValueError(f"layers must be distinct block indices in [0, {n_old}), got {layers}")
    renumber = {old: new for new, old in enumerate(layers)}
    tmp = dst + ".part"
    writer = gguf.GGUFWriter(tmp, arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == f"{arch}.block_count":
            value = len(layers)
        elif isinstance(value, list) and len(value) == n_old and field.name.startswith(f"{arch}."):
            value = [value[i] for i in layers]  # per-layer settings (e.g. head counts) follow their layer
        elif field.name == gguf.Keys.General.NAME:
            value = f"{value} ({len(layers)} of {n_old} layers)"
        writer.add_key_value(field.name, value, val_type, sub_type=sub_type)
    kept = []
    for t in reader.tensors:
        m = _BLOCK.match(t.name)
        if m:
            old = int(m.group(1))
            if old not in renumber:
                continue
            name = f"blk.{renumber[old]}.{m.group(2)}"
        else:
            name = t.name
        kept.append((name, t))
    kept.sort(key=lambda nt: _order(nt[0]))
    for name, t in kept:
        writer.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    os.replace(tmp, dst)
    return dst


def _order(name: str) -> tuple:
    m = _BLOCK.match(name)
    return (1, int(m.group(1)), m.group(2)) if m else (0, 0, name)


def truncated_copy(model: str, layers: Sequence[int]) -> str:
    """Path of a cached copy of `model` (alias or path) keeping `layers`; written on first use."""
    src = resolve_model(model)
    tag = "-".join(str(x) for x in layers)
    base = os.path.splitext(os.path.basename(src))[0]
    dst = os.path.join(cache_dir(), f"{base}.layers-{tag}.gguf")
    if not os.path.exists(dst) or os.path.getmtime(dst) < os.path.getmtime(src):
        write_truncated_gguf(src, dst, layers)
    return dst
