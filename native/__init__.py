"""specray.native: the only code that touches llama.cpp (through llama_cpp).

Model, context with N slots, batches, logits and hidden-row views, KV ops,
state checkpoints, bindings llama-cpp-python lacks, synthetic test GGUFs. It
may import specray.engine (for the types it fills), never deployments or bench.

OpenMP waiting is left to libgomp's default (spin a little at a barrier, then
sleep). Measured here on SmolLM2 (2 threads, idle machine): default 83 tok/s,
OMP_WAIT_POLICY=active 90, passive 20 (every barrier then pays a futex
wake-up); with one other busy process on the 2 cores: 22 / 25 / 31. A
dedicated box should not pay 4x for the oversubscribed case: export
OMP_WAIT_POLICY (or set ServeConfig.worker_env) to choose.
"""
