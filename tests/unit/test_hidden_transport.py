"""Hidden-row transports (deployments/actors/row_transport.py) without a GPU and without Ray.

CUDA IPC cannot run on this machine: its bookkeeping (buffer pool, generations,
acks, handle (de)serialisation, the consumer's mapping cache, the fallback to
the object store) runs here over a host-memory stand-in for the CUDA runtime;
the real runtime is exercised by `test_cuda_ipc_between_processes`, which
skips with the reason when CUDA is unavailable. The object store itself runs
for real in tests/serve/test_hidden_distributed.py.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import pickle

import numpy as np
import pytest

from specray.deployments.actors.row_transport import (
    IPC_HANDLE_BYTES, CudaIpcHandle, CudaIpcTransport, CudaRuntime, DevicePool, HiddenReceiver, InlineTransport,
    ObjectStoreHandle, ObjectStoreTransport, cuda_ipc_available, make_transport,
)
from specray.engine.hidden_rows import TAP_NEXTN, RowMismatch, pack_rows


def record(round_id: int, n: int = 3, width: int = 8):
    rows = np.arange(n * width, dtype=np.float32).reshape(n, width) + 1000 * round_id
    return pack_rows(round_id, (TAP_NEXTN,), (width,), [(1, 5, np.arange(n, dtype=np.int32), rows)])


class HostRuntime:
    """Host memory standing in for device memory; an 'IPC handle' names the allocation."""

    H2D, D2H = CudaRuntime.H2D, CudaRuntime.D2H

    def __init__(self):
        self.mem: dict[int, ctypes.Array] = {}
        self.freed: list[int] = []
        self.opened = 0
        self.closed = 0

    def malloc(self, n):
        buf = ctypes.create_string_buffer(n)
        self.mem[ctypes.addressof(buf)] = buf
        return ctypes.addressof(buf)

    def free(self, ptr):
        self.freed.append(ptr)
        del self.mem[ptr]

    def memcpy(self, dst, src, n, kind):
        ctypes.memmove(dst, src, n)

    def ipc_get_handle(self, ptr):
        return ptr.to_bytes(8, "little") + b"\0" * (IPC_HANDLE_BYTES - 8)

    def ipc_open(self, handle):
        self.opened += 1
        ptr = int.from_bytes(handle[:8], "little")
        assert ptr in self.mem, "opening a freed buffer"
        return ptr

    def ipc_close(self, ptr):
        self.closed += 1


class DictStore(ObjectStoreTransport):
    """The object store's put without Ray (refs are keys of a dict)."""

    store: dict = {}

    def _put(self, rec):
        key = f"ref-{len(self.store)}"
        self.store[key] = pickle.loads(pickle.dumps(rec, protocol=5))
        return key


class DictReceiver(HiddenReceiver):
    def _get(self, ref):
        return DictStore.store[ref]


def test_pool_generations_acks_and_growth():
    rt = HostRuntime()
    pool = DevicePool(rt, max_buffers=2)
    i0, b0 = pool.acquire(100)
    i1, b1 = pool.acquire(100)
    assert (i0, i1) == (0, 1) and pool.busy == 2 and b0.generation == b1.generation == 1
    assert pool.acquire(10) is None  # all busy: the caller falls back
    assert not pool.release(0, 7)  # a stale generation frees nothing
    assert pool.release(0, 1) and not pool.release(0, 1)  # once
    i, b = pool.acquire(50)
    assert i == 0 and b.generation == 2
    pool.release(0, 2)
    i, b = pool.acquire(1 << 20)  # larger than any free buffer: grown, new handle, old memory freed
    assert i == 0 and b.capacity >= 1 << 20 and pool.grown == 1 and rt.freed == [b0.ptr]
    pool.close()
    assert rt.mem == {}


def test_cuda_ipc_roundtrip_acks_and_fallback_to_the_object_store():
    rt = HostRuntime()
    tx = CudaIpcTransport(runtime=rt, max_buffers=2)
    rx = DictReceiver(runtime=rt)
    tx._put = DictStore()._put
    h1, h2 = tx.export(record(1)), tx.export(record(2))
    assert isinstance(h1, CudaIpcHandle) and isinstance(h2, CudaIpcHandle) and h1.buffer != h2.buffer
    assert h1.meta.rows.shape == (0, 8)  # rows travel in device memory only
    h3 = tx.export(record(3))  # both buffers await acks
    assert isinstance(h3, ObjectStoreHandle) and tx.stats.fallbacks == 1 and "busy" in tx.stats.fallback_reason
    for h, r in ((h1, 1), (h2, 2), (h3, 3)):
        got = rx.open_handle(h)
        np.testing.assert_array_equal(got.rows, record(r).rows)
        assert got.for_seq(1).pos0 == 5
    acks = rx.take_acks()
    assert sorted(acks) == sorted([h1.ack, h2.ack, h3.ack]) and rx.take_acks() == []
    assert tx.info()["pinned"] == 1  # the fallback's ref, held until its ack
    tx.acknowledge(acks)
    assert tx.pool.busy == 0 and tx.info()["pinned"] == 0
    h4 = tx.export(record(4))
    assert isinstance(h4, CudaIpcHandle) and h4.generation == 2
    np.testing.assert_array_equal(rx.open_handle(h4).rows, record(4).rows)
    assert rt.opened == 2  # the consumer maps each buffer once and reuses the mapping
    tx.acknowledge([("another-pool", 0, 2)])  # acks of an older target actor are ignored
    assert tx.pool.busy == 1
    # a buffer grown by the target has a new handle: the consumer re-opens it
    tx.acknowledge(rx.take_acks())
    big = record(5, n=4096)
    h5 = tx.export(big)
    np.testing.assert_array_equal(rx.open_handle(h5).rows, big.rows)
    assert tx.pool.grown == 1 and rt.opened == 3 and rt.closed == 1
    stats = rx.stats.to_dict()
    assert stats["opened"] == 5 and stats["opened_bytes"] == sum(record(r).nbytes for r in (1, 2, 3, 4)) + big.nbytes


def test_ipc_handle_serialises_with_its_record_index():
    rt = HostRuntime()
    h = CudaIpcTransport(runtime=rt).export(record(7))
    back = CudaIpcHandle.from_bytes(h.to_bytes())
    assert back.ipc_handle == h.ipc_handle and len(back.ipc_handle) == IPC_HANDLE_BYTES
    assert back.ack == h.ack and back.n_rows == 3 and back.width == 8 and back.nbytes == 3 * 8 * 4
    assert back.meta.seq_ids.tolist() == [1] and back.meta.round_id == 7
    with pytest.raises(ValueError):
        CudaIpcHandle.from_bytes(pickle.dumps({"not": "a handle"}))
    bad = CudaIpcHandle(b"short", 0, "p", 0, 1, h.meta, 3, 8, 0.0)
    with pytest.raises(ValueError):
        bad.to_bytes()


def test_without_cuda_cuda_ipc_reports_why_and_falls_back():
    ok, why = cuda_ipc_available()
    if ok:
        pytest.skip("CUDA is available here: no fallback to check")
    assert why and ("CUDA" in why or "cudart" in why or "GPU" in why)
    t = make_transport("cuda_ipc")
    assert type(t) is ObjectStoreTransport and t.stats.fallback_reason.startswith("cuda_ipc unavailable")
    assert "fallback_reason" in t.info()


def test_inline_and_object_store_transports():
    rec = record(1)
    assert InlineTransport().export(rec) is rec  # in-process: the record itself, no copy
    assert HiddenReceiver().open_handle(rec) is rec
    tx = DictStore()
    h = tx.export(rec)
    assert isinstance(h, ObjectStoreHandle) and h.nbytes == rec.nbytes and h.n_rows == 3
    got = DictReceiver().open_handle(h)
    np.testing.assert_array_equal(got.rows, rec.rows)
    small = DictStore(inline_below=rec.nbytes + 1)  # a record under the threshold goes by value
    assert small.export(rec) is rec and small.inlined == 1
    assert isinstance(DictStore(inline_below=rec.nbytes).export(rec), ObjectStoreHandle)
    with pytest.raises(ValueError):
        make_transport("carrier_pigeon")
    with pytest.raises(RowMismatch):
        HiddenReceiver().open_handle({"rows": 1})


def test_the_target_holds_each_ref_until_the_companion_has_read_it():
    # a compiled graph's channel registers no borrower of a ref nested in the step's answer: the target's pin
    # is what keeps the rows alive until the companion's ack (tests/serve/test_hidden_distributed.py, compiled)
    tx, rx = DictStore(max_pinned=3), DictReceiver()
    handles = [tx.export(record(r)) for r in (1, 2)]
    assert tx.info()["pinned"] == 2 and all(h.pin_id == tx.pin_id for h in handles)
    rx.open_handle(handles[0])
    acks = rx.take_acks()
    assert acks == [(tx.pin_id, -1, 1)]
    tx.acknowledge(acks + [("refs-of-an-older-target", -1, 2)])  # another transport's ack unpins nothing here
    assert tx.info()["pinned"] == 1
    for r in (3, 4, 5):  # nobody reads: at the cap the oldest pin goes, counted
        tx.export(record(r))
    info = tx.info()
    assert info["pinned"] == 3 and info["unpinned_early"] == 1
    tx.acknowledge([(tx.pin_id, -1, 2)])  # round 2 fell out at the cap: its late ack is a no-op
    assert tx.info()["pinned"] == 3
    tx.close()
    assert tx.info()["pinned"] == 0


def _ipc_child(handle_bytes, q):  # pragma: no cover - runs only with CUDA
    rx = HiddenReceiver()
    rec = rx.open_handle(CudaIpcHandle.from_bytes(handle_bytes))
    q.put((rec.rows.tolist(), rx.take_acks()))


def test_cuda_ipc_between_processes():
    ok, why = cuda_ipc_available()
    if not ok:
        pytest.skip(f"cuda_ipc unavailable: {why}")
    tx = make_transport("cuda_ipc")  # pragma: no cover - needs a GPU
    assert isinstance(tx, CudaIpcTransport)
    rec = record(9)
    h = tx.export(rec)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_ipc_child, args=(h.to_bytes(), q))
    p.start()
    rows, acks = q.get(timeout=120)
    p.join(60)
    np.testing.assert_array_equal(np.array(rows, np.float32), rec.rows)
    assert acks == [h.ack]
    tx.close()


class FakeClient:
    """CompanionClient stand-in: records each call's payload, answers like the companion."""

    epoch = 1

    def __init__(self, acks=()):
        self.payloads = []
        self.acks = list(acks)

    def call(self, method, payload, default=None):
        assert method == "hidden_round"
        self.payloads.append(payload)
        drafts = [np.array([7, 8], np.int32) for _ in payload["requests"]]
        return {"drafts": drafts, "unsynced": [], "inside_s": 0.0, "step_costs": {1: 0.001}, "acks": self.acks}

    def submit(self, method, payload):
        """Sent now, answered when read (CompanionClient.Pending)."""
        answer = self.call(method, payload)
        client = self

        class Pending:
            def result(self):
                client.read += 1
                return answer

        return Pending()

    read = 0


def test_router_proxy_keeps_event_order_sends_once_per_round_and_returns_acks():
    from specray.deployments.actors.companion_hidden import FLUSH_RECORDS, CompanionHiddenProxy
    from specray.engine.speculator import DraftRequest
    from specray.engine.speculators.mtp import MtpParams

    client = FakeClient(acks=[("pool", 0, 1)])
    client.flush_behind = True
    got_acks = []
    proxy = CompanionHiddenProxy("mtp", MtpParams(), client, ack_sink=got_acks.extend)
    proxy.begin(0, np.array([1, 2], np.int32))
    proxy.take_hidden("handle-1")
    proxy.process(0, np.array([1, 2], np.int32), 0)
    proxy.end(0)
    proxy.begin(0, np.array([3], np.int32))  # the slot reused by the next sequence
    assert client.payloads == []  # nothing sent until a round asks for drafts
    (d,) = proxy.draft([DraftRequest(0, np.array([3, 4], np.int32), 4)])
    assert d.tolist() == [7, 8] and len(client.payloads) == 1
    kinds = [e[0] for e in client.payloads[0]["events"]]
    assert kinds == ["begin", "rows", "commit", "end", "begin"]  # the companion replays them in this order
    assert client.payloads[0]["requests"] == [(0, 4, 2, 4)] and got_acks == [("pool", 0, 1)]
    for i in range(FLUSH_RECORDS):  # rounds without drafts: flushed, the object store holds few rounds
        proxy.take_hidden(f"h{i}")
    assert len(client.payloads) == 2 and client.payloads[1]["requests"] == [] and proxy.flushes == 1
    # the flush went without waiting: its answer (acks) is read before the next call, in order
    assert client.read == 0 and len(got_acks) == 1
    proxy.draft([DraftRequest(0, np.array([3, 4, 5], np.int32), 4)])
    assert client.read == 1 and len(client.payloads) == 3 and len(got_acks) == 3


def test_without_room_for_it_a_flush_waits_for_the_companion():
    # engine.hidden.flush_behind None on a node without a spare core (this 2-core box): the replay would compete
    # with the target's decode, so the flush is an ordinary call
    from specray.deployments.actors.companion_hidden import FLUSH_RECORDS, CompanionHiddenProxy
    from specray.engine.speculators.mtp import MtpParams

    client = FakeClient(acks=[("pool", 0, 1)])
    got_acks = []
    proxy = CompanionHiddenProxy("mtp", MtpParams(), client, ack_sink=got_acks.extend)
    assert not proxy.flush_behind
    for i in range(FLUSH_RECORDS):
        proxy.take_hidden(f"h{i}")
    assert len(client.payloads) == 1 and client.read == 0 and got_acks == [("pool", 0, 1)]
