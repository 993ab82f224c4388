"""How a round's hidden rows travel from the target actor to the companion: one interface, three transports.

The target's runner produces one `HiddenRows` record per round (engine/hidden_rows.py);
the target actor `export()`s it and returns the handle in the step result; the router's
proxy forwards the handle, untouched, in its next companion call; the companion
`open_handle()`s it and, after use, `release()`s it (an ack that may travel back to the
target through the router, see CudaIpcTransport).

- `inline`: the record itself. Co-located (same process) that is the whole story: no copy
  at all. Between actors it is the by-value baseline: Ray copies it into the step result
  and again into the companion call.
- `object_store`: the target `ray.put`s the record and returns the reference; the router
  only holds and forwards the reference (a nested ObjectRef is not resolved on the way),
  the companion `ray.get`s it from the node's shared memory (numpy rows come back as
  zero-copy read-only views).
- `cuda_ipc`: the target copies the rows into a device buffer of its own pool and returns a
  CUDA IPC handle of it (plus the small index arrays by value); the companion, on the same
  node, maps the buffer once (`cudaIpcOpenMemHandle`, cached per buffer) and copies the
  rows out. A buffer is reused only after the companion's ack comes back; with every
  buffer busy, or without CUDA, rows go through the object store instead (counted, with
  the reason). Ray's own GPU tensor transport moves torch tensors only, so this one talks
  to the CUDA runtime directly through ctypes. llama.cpp hands hidden rows out in host
  memory, so on this path they cross the device twice; it pays off when the consumer
  reads them on the device.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import os
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from specray.engine.hidden_rows import ROW_DTYPE, HiddenRows, RowMismatch

TRANSPORTS = ("object_store", "inline", "cuda_ipc")
IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


class TransportUnavailable(RuntimeError):
    """This transport cannot run here (e.g. no CUDA); the message says why."""


@dataclass
class TransportStats:
    exported: int = 0  # records handed out by the target
    exported_bytes: int = 0  # bytes of hidden rows in them
    export_seconds: float = 0.0  # target side: put / device copy
    opened: int = 0  # records opened by the companion
    opened_bytes: int = 0
    open_seconds: float = 0.0  # companion side: get / device copy + map
    fallbacks: int = 0  # cuda_ipc rounds that went through the object store
    fallback_reason: str | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


# ---- handles --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ObjectStoreHandle:
    """A record in Ray's object store (the ref is nested, so nobody on the way resolves it)."""

    ref: Any  # ray.ObjectRef of a HiddenRows
    round_id: int
    nbytes: int
    n_rows: int
    export_seconds: float
    pin_id: str = ""  # the exporting transport, which holds the ref until the companion's ack (below)

    @property
    def ack(self) -> tuple[str, int, int]:
        """Read: the target may drop its pin (the same 3-tuple shape as a CUDA buffer's ack)."""
        return (self.pin_id, -1, self.round_id)


@dataclass(frozen=True)
class CudaIpcHandle:
    """A record whose rows sit in a device buffer of the target's pool; everything else by value."""

    ipc_handle: bytes  # cudaIpcMemHandle_t of the buffer
    device: int
    pool_id: str  # the exporting pool: a consumer caches its mapping per (pool, buffer, ipc_handle)
    buffer: int  # buffer index in the pool
    generation: int  # bumped on every reuse of the buffer; an ack names the generation it frees
    meta: HiddenRows  # the record with an empty rows matrix (index arrays, taps, round)
    n_rows: int
    width: int
    export_seconds: float

    @property
    def nbytes(self) -> int:
        return self.n_rows * self.width * np.dtype(ROW_DTYPE).itemsize

    @property
    def ack(self) -> tuple[str, int, int]:
        return (self.pool_id, self.buffer, self.generation)

    def to_bytes(self) -> bytes:
        """A compact wire form (the record's index arrays included)."""
        import pickle

        if len(self.ipc_handle) != IPC_HANDLE_BYTES:
            raise ValueError(f"an IPC handle has {IPC_HANDLE_BYTES} bytes, got {len(self.ipc_handle)}")
        return pickle.dumps(self, protocol=5)

    @staticmethod
    def from_bytes(data: bytes) -> "CudaIpcHandle":
        import pickle

        h = pickle.loads(data)
        if not isinstance(h, CudaIpcHandle) or len(h.ipc_handle) != IPC_HANDLE_BYTES:
            raise ValueError("not a CUDA IPC hidden-rows handle")
        return h


def _meta_of(record: HiddenRows) -> HiddenRows:
    return replace(record, rows=np.zeros((0, record.width), dtype=ROW_DTYPE))


# ---- CUDA runtime through ctypes --------------------------------------------------------------------------
class _IpcHandleStruct(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * IPC_HANDLE_BYTES)]  # c_ubyte: c_char would stop at a NUL byte


class CudaRuntime:
    """The few CUDA runtime calls the transport needs (libcudart through ctypes)."""

    H2D, D2H = 1, 2
    IPC_LAZY_ENABLE_PEER_ACCESS = 1

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcHandleStruct, ctypes.c_uint]

    @classmethod
    def load(cls) -> "CudaRuntime":
        names = [os.environ.get("SPECRAY_CUDART", ""), ctypes.util.find_library("cudart") or "",
                 "libcudart.so", "libcudart.so.12", "libcudart.so.11.0"]
        errors = []
        for name in [n for n in names if n]:
            try:
                rt = cls(ctypes.CDLL(name))
            except OSError as e:
                errors.append(f"{name}: {e}")
                continue
            n = rt.device_count()
            if n < 1:
                raise TransportUnavailable(f"the CUDA runtime ({name}) sees no GPU")
            return rt
        raise TransportUnavailable("no CUDA runtime library (libcudart) could be loaded" +
                                   (f" ({'; '.join(errors[:2])})" if errors else ""))

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = self.lib.cudaGetErrorString(rc)
            raise RuntimeError(f"{what} failed: {msg.decode() if msg else rc}")

    def device_count(self) -> int:
        n = ctypes.c_int(0)
        rc = self.lib.cudaGetDeviceCount(ctypes.byref(n))
        return n.value if rc == 0 else 0

    def set_device(self, device: int) -> None:
        self._check(self.lib.cudaSetDevice(ctypes.c_int(device)), "cudaSetDevice")

    def malloc(self, nbytes: int) -> int:
        p = ctypes.c_void_p()
        self._check(self.lib.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(nbytes)), "cudaMalloc")
        return int(p.value)

    def free(self, ptr: int) -> None:
        self._check(self.lib.cudaFree(ctypes.c_void_p(ptr)), "cudaFree")

    def memcpy(self, dst: int, src: int, nbytes: int, kind: int) -> None:
        self._check(self.lib.cudaMemcpy(ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(nbytes),
                                        ctypes.c_int(kind)), "cudaMemcpy")

    def ipc_get_handle(self, ptr: int) -> bytes:
        h = _IpcHandleStruct()
        self._check(self.lib.cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(ptr)), "cudaIpcGetMemHandle")
        return bytes(h.reserved)

    def ipc_open(self, handle: bytes) -> int:
        h = _IpcHandleStruct.from_buffer_copy(bytes(handle))
        p = ctypes.c_void_p()
        self._check(self.lib.cudaIpcOpenMemHandle(ctypes.byref(p), h, self.IPC_LAZY_ENABLE_PEER_ACCESS),
                    "cudaIpcOpenMemHandle")
        return int(p.value)

    def ipc_close(self, ptr: int) -> None:
        self._check(self.lib.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr)), "cudaIpcCloseMemHandle")


def cuda_ipc_available() -> tuple[bool, str]:
    """(available, reason)."""
    try:
        CudaRuntime.load()
    except TransportUnavailable as e:
        return False, str(e)
    return True, "ok"


# ---- device buffer bookkeeping (target side) ------------------------------------------------------------
@dataclass
class _Buffer:
    ptr: int
    capacity: int
    ipc_handle: bytes
    generation: int = 0
    busy: bool = False


@dataclass
class DevicePool:
    """Device buffers the target exports rows in; a buffer is reused only after its generation's ack.

    `runtime` is a CudaRuntime (or anything with malloc/free/ipc_get_handle/memcpy: tests use a host fake)."""

    runtime: Any
    max_buffers: int = 4
    device: int = 0
    pool_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    buffers: list[_Buffer] = field(default_factory=list)
    grown: int = 0  # reallocations to a larger size

    def acquire(self, nbytes: int) -> tuple[int, _Buffer] | None:
        """A free buffer of at least nbytes (grown or allocated if needed), marked busy; None if all are busy."""
        free = [i for i, b in enumerate(self.buffers) if not b.busy]
        fit = [i for i in free if self.buffers[i].capacity >= nbytes]
        if fit:
            i = min(fit, key=lambda j: self.buffers[j].capacity)
        elif free:  # grow the largest free one (its old mapping is stale: new handle, consumer re-opens)
            i = max(free, key=lambda j: self.buffers[j].capacity)
            old = self.buffers[i]
            self.runtime.free(old.ptr)
            cap = max(nbytes, 2 * old.capacity)
            ptr = self.runtime.malloc(cap)
            self.buffers[i] = _Buffer(ptr, cap, self.runtime.ipc_get_handle(ptr), old.generation)
            self.grown += 1
        elif len(self.buffers) < self.max_buffers:
            cap = max(nbytes, 1 << 16)
            ptr = self.runtime.malloc(cap)
            self.buffers.append(_Buffer(ptr, cap, self.runtime.ipc_get_handle(ptr)))
            i = len(self.buffers) - 1
        else:
            return None
        b = self.buffers[i]
        b.busy = True
        b.generation += 1
        return i, b

    def release(self, buffer: int, generation: int) -> bool:
        """An ack: the consumer is done with `buffer` as of `generation` (a stale ack is ignored)."""
        if not 0 <= buffer < len(self.buffers):
            return False
        b = self.buffers[buffer]
        if b.generation != generation or not b.busy:
            return False
        b.busy = False
        return True

    @property
    def busy(self) -> int:
        return sum(b.busy for b in self.buffers)

    def close(self) -> None:
        for b in self.buffers:
            try:
                self.runtime.free(b.ptr)
            except Exception:
                pass
        self.buffers.clear()


# ---- transports -----------------------------------------------------------------------------------------
class InlineTransport:
    """The record by value (no copy in-process)."""

    name = "inline"

    def __init__(self) -> None:
        self.stats = TransportStats()

    def export(self, record: HiddenRows) -> HiddenRows:
        self.stats.exported += 1
        self.stats.exported_bytes += record.nbytes
        return record

    def acknowledge(self, acks) -> None:
        pass

    def info(self) -> dict:
        return {"transport": self.name, "inlined": getattr(self, "inlined", 0), **self.stats.to_dict()}

    def close(self) -> None:
        pass


class ObjectStoreTransport(InlineTransport):
    """ray.put on the target; the companion gets the reference. Records under `inline_below` bytes go by value
    (a put has a fixed cost however small the record; a small copy through the router costs far less).

    The target holds each ref it put until the companion's ack (its `open_handle` read the record) comes
    back through the router, at most `max_pinned` of them (the oldest go first; a companion that never asks
    must not fill the object store). An actor call's return would keep the object alive anyway: Ray
    registers the router as a borrower of a ref nested in it. A compiled graph's channel does not, so
    without the pin the object was freed as soon as the step's answer left the target, and the companion
    found its rows gone (`target_hop: compiled`, tests/serve/test_hidden_distributed.py)."""

    name = "object_store"

    def __init__(self, inline_below: int = 0, max_pinned: int = 64) -> None:
        super().__init__()
        self.inline_below = inline_below
        self.inlined = 0
        self.max_pinned = max_pinned
        self.pin_id = f"refs-{uuid.uuid4().hex[:12]}"
        self._pinned: collections.OrderedDict[int, Any] = collections.OrderedDict()  # round -> ref
        self.unpinned_early = 0  # dropped at the cap before their ack
        self._pin_lock = threading.Lock()  # acks arrive with step calls, possibly on another actor thread

    def export(self, record: HiddenRows):
        if record.nbytes < self.inline_below:
            self.inlined += 1
            return super().export(record)
        return self._export_ref(record)

    def _export_ref(self, record: HiddenRows) -> ObjectStoreHandle:
        t0 = time.perf_counter()
        ref = self._put(record)
        with self._pin_lock:
            self._pinned[record.round_id] = ref
            while len(self._pinned) > self.max_pinned:
                self._pinned.popitem(last=False)
                self.unpinned_early += 1
        dt = time.perf_counter() - t0
        self.stats.exported += 1
        self.stats.exported_bytes += record.nbytes
        self.stats.export_seconds += dt
        return ObjectStoreHandle(ref, record.round_id, record.nbytes, record.n_rows, dt, self.pin_id)

    def acknowledge(self, acks) -> None:
        """Acks from the companion, via the router: (pin_id, -1, round) unpins that round's ref."""
        with self._pin_lock:
            for owner, _, key in acks:
                if owner == self.pin_id:
                    self._pinned.pop(key, None)

    def info(self) -> dict:
        return super().info() | {"pinned": len(self._pinned), "unpinned_early": self.unpinned_early}

    def close(self) -> None:
        self._pinned.clear()

    def _put(self, record: HiddenRows):
        import ray

        return ray.put(record)


class CudaIpcTransport(ObjectStoreTransport):
    """Rows in a device buffer, exported as a CUDA IPC handle; the object store when no buffer is free."""

    name = "cuda_ipc"

    def __init__(self, runtime=None, max_buffers: int = 4, device: int = 0, inline_below: int = 0) -> None:
        super().__init__(inline_below)
        self.runtime = runtime if runtime is not None else CudaRuntime.load()
        if hasattr(self.runtime, "set_device"):
            self.runtime.set_device(device)
        self.pool = DevicePool(self.runtime, max_buffers, device)
        self._lock = threading.Lock()  # acks arrive with step calls, possibly on another actor thread

    def export(self, record: HiddenRows):
        if record.nbytes < self.inline_below:
            self.inlined += 1
            return InlineTransport.export(self, record)
        t0 = time.perf_counter()
        rows = np.ascontiguousarray(record.rows, dtype=ROW_DTYPE)
        with self._lock:
            got = self.pool.acquire(max(1, rows.nbytes))
        if got is None:  # every buffer still awaits the companion's ack
            self.stats.fallbacks += 1
            self.stats.fallback_reason = f"all {self.pool.max_buffers} device buffers busy"
            return self._export_ref(record)
        i, buf = got
        if rows.nbytes:
            self.runtime.memcpy(buf.ptr, rows.ctypes.data, rows.nbytes, CudaRuntime.H2D)
        dt = time.perf_counter() - t0
        self.stats.exported += 1
        self.stats.exported_bytes += rows.nbytes
        self.stats.export_seconds += dt
        return CudaIpcHandle(buf.ipc_handle, self.pool.device, self.pool.pool_id, i, buf.generation,
                             _meta_of(record), record.n_rows, record.width, dt)

    def acknowledge(self, acks) -> None:
        """Acks (pool_id, buffer, generation) from the companion, via the router: those buffers are free (and
        the acks of rounds that went through the object store unpin their refs)."""
        super().acknowledge(acks)
        with self._lock:
            for pool_id, buffer, generation in acks:
                if pool_id == self.pool.pool_id:
                    self.pool.release(buffer, generation)

    def info(self) -> dict:
        return super().info() | {"buffers": len(self.pool.buffers), "busy": self.pool.busy, "grown": self.pool.grown}

    def close(self) -> None:
        super().close()
        self.pool.close()


def make_transport(name: str, runtime=None, inline_below: int = 0) -> InlineTransport:
    """The target side of transport `name`; cuda_ipc without CUDA -> object_store, reason in stats."""
    if name not in TRANSPORTS:
        raise ValueError(f"unknown hidden-row transport {name!r}; known: {', '.join(TRANSPORTS)}")
    if name == "inline":
        return InlineTransport()
    if name == "object_store":
        return ObjectStoreTransport(inline_below)
    try:
        return CudaIpcTransport(runtime, inline_below=inline_below)
    except TransportUnavailable as e:
        t = ObjectStoreTransport(inline_below)
        t.stats.fallback_reason = f"cuda_ipc unavailable: {e}"
        return t


# ---- companion side ------------------------------------------------------------------------------------
class HiddenReceiver:
    """Opens any handle into a HiddenRows record (the companion's side of every transport)."""

    def __init__(self, runtime=None) -> None:
        self.stats = TransportStats()
        self._runtime = runtime
        self._mapped: dict[tuple[str, int], tuple[bytes, int]] = {}  # (pool, buffer) -> (ipc handle, device ptr)
        self.acks: list[tuple[str, int, int]] = []  # buffers and pinned refs done with, for the target (via the router)

    def _cuda(self):
        if self._runtime is None:
            self._runtime = CudaRuntime.load()
        return self._runtime

    def open_handle(self, handle) -> HiddenRows:
        t0 = time.perf_counter()
        if isinstance(handle, HiddenRows):
            record = handle
        elif isinstance(handle, ObjectStoreHandle):
            record = self._get(handle.ref)
            if handle.pin_id:
                self.acks.append(handle.ack)  # read: the target may drop its pin
        elif isinstance(handle, CudaIpcHandle):
            record = self._open_ipc(handle)
        else:
            raise RowMismatch(f"not a hidden-rows handle: {type(handle).__name__}")
        record.validate()
        self.stats.opened += 1
        self.stats.opened_bytes += record.nbytes
        self.stats.open_seconds += time.perf_counter() - t0
        if isinstance(handle, (ObjectStoreHandle, CudaIpcHandle)):
            self.stats.export_seconds += handle.export_seconds
        return record

    def _get(self, ref) -> HiddenRows:
        import ray

        return ray.get(ref)

    def _open_ipc(self, h: CudaIpcHandle) -> HiddenRows:
        rt = self._cuda()
        key = (h.pool_id, h.buffer)
        cached = self._mapped.get(key)
        if cached is None or cached[0] != h.ipc_handle:  # first use, or the target grew the buffer
            if cached is not None:
                rt.ipc_close(cached[1])
            cached = self._mapped[key] = (h.ipc_handle, rt.ipc_open(h.ipc_handle))
        rows = np.empty((h.n_rows, h.width), dtype=ROW_DTYPE)
        if rows.nbytes:
            rt.memcpy(rows.ctypes.data, cached[1], rows.nbytes, CudaRuntime.D2H)
        self.acks.append(h.ack)  # copied out: the target may reuse the buffer
        return replace(h.meta, rows=rows)

    def take_acks(self) -> list[tuple[str, int, int]]:
        acks, self.acks = self.acks, []
        return acks

    def close(self) -> None:
        for _, ptr in self._mapped.values():
            try:
                self._runtime.ipc_close(ptr)
            except Exception:
                pass
        self._mapped.clear()
