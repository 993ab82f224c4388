"""deployments/replica/streams.py flush(): a paced flush signals once the woken stream tasks have run."""

import asyncio
import threading

from specray.deployments.replica.streams import flush


def _loop_thread():
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return loop


def test_a_paced_flush_signals_after_the_stream_tasks_it_woke_have_written():
    loop, written = _loop_thread(), []

    async def consumer(q):
        while True:
            item = await q.get()
            written.append(item["text"])  # what the SSE writer does with a delta: write it out

    async def start() -> asyncio.Queue:
        q = asyncio.Queue()
        asyncio.get_running_loop().create_task(consumer(q))
        await asyncio.sleep(0)  # the consumer is waiting on the queue
        return q

    qs = [asyncio.run_coroutine_threadsafe(start(), loop).result() for _ in range(3)]
    for n in range(1, 4):
        done = threading.Event()
        assert flush({loop: [(q, {"type": "delta", "text": f"{i}.{n}"}) for i, q in enumerate(qs)]}, done)
        assert done.wait(5)
        assert written[-3:] == [f"0.{n}", f"1.{n}", f"2.{n}"]  # every stream wrote before the signal
    other = _loop_thread()
    q2 = asyncio.run_coroutine_threadsafe(start(), other).result()
    # two event loops (not the fused layout): nothing to wait for, no signal promised
    assert not flush({loop: [(qs[0], {"type": "delta", "text": "x"})], other: [(q2, {"type": "delta", "text": "y"})]},
                     threading.Event())
    assert not flush({loop: [(qs[0], {"type": "delta", "text": "z"})]}, None)
    for lp in (loop, other):
        lp.call_soon_threadsafe(lp.stop)
