"""native/decode_threads.py: which live threads have decoded (OpenMP pools per calling thread)."""

import logging
import threading

from specray.native import decode_threads


def test_a_second_live_decoding_thread_is_counted_warned_about_and_forgotten_when_it_ends(caplog):
    decode_threads._warned = False
    go, done = threading.Event(), threading.Event()

    def decoder():
        decode_threads.note()
        go.set()
        done.wait()

    decode_threads.note()  # this thread decoded
    t = threading.Thread(target=decoder, name="other-decoder")
    with caplog.at_level(logging.WARNING, logger="specray.native"):
        t.start()
        go.wait()
        live = decode_threads.live()
        assert threading.current_thread().name in live and "other-decoder" in live
        assert decode_threads.last_ident == t.ident
    assert any("live threads" in r.getMessage() for r in caplog.records)
    done.set()
    t.join()
    assert "other-decoder" not in decode_threads.live()
    assert threading.current_thread().name in decode_threads.live()
