"""specray.engine: the speculative-decoding engine, pure Python + numpy.

Sequences and slots, the speculator interface and every speculator's engine
side, chains (and their live reconfiguration), the draft policy (policy/:
which drafts a round sends, and their prices), verification (greedy and
rejection sampling), the round scheduler, the decode's cost model and typed
configs.
Imports nothing outside specray.engine: no llama_cpp, no Ray, no pydantic
models of other packages; the target it drives is a protocol (target.py).
"""
