"""specray.engine: the speculative-decoding engine, pure Python + numpy.

Sequences and slots, the speculator interface and every speculator's engine
side, chains (and their live reconfiguration), verification (greedy and
rejection sampling), the round scheduler, the cost model and typed configs.
Imports nothing outside specray.engine: no llama_cpp, no Ray, no pydantic
models of other packages; the target it drives is a protocol (target.py).
"""
