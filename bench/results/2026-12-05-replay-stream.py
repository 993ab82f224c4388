"""`specray bench --host-replay` with the wait streaming 96 MiB of memory (WAIT=stream), as a CPU decode streams
SmolLM2's weights through the caches, instead of spinning as a host waiting on its GPU does (benchmarks page,
"Host work after a wait").

    WAIT=stream .venv/bin/python bench/results/2026-12-05-replay-stream.py bench --host-replay measured ... --json OUT
"""
import os
import sys
import time

import numpy as np

from specray.bench import host_replay

BIG = np.ones((96 << 20) // 4, dtype=np.float32)  # more than the 32 MiB L3, like the model's weights
CHUNK = 1 << 18
_pos = 0


def stream(seconds: float) -> None:
    global _pos
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        np.add.reduce(BIG[_pos : _pos + CHUNK])
        _pos = (_pos + CHUNK) % len(BIG)


if os.environ.get("WAIT") == "stream":
    host_replay.spin = stream  # ReplayDecode.logits waits out the decode's time with it

from specray.cli.main import main  # noqa: E402

sys.argv = ["specray", *sys.argv[1:]]
sys.exit(main())
