"""specray.native: the only code that touches llama.cpp (through llama_cpp).

Model, context with N slots, batches, logits and hidden-row views, KV ops,
state checkpoints, bindings llama-cpp-python lacks, synthetic test GGUFs. It
may import specray.engine (for the types it fills), never deployments or bench.

OpenMP waiting is left to libgomp's default (spin a little at a barrier, then
sleep). OMP_WAIT_POLICY=passive (every barrier pays a futex wake-up) helps
when other processes keep the cores busy but makes an idle machine's decodes
several times slower; active (spin) is a little faster on dedicated cores. A
dedicated machine should not pay for the oversubscribed case: export
OMP_WAIT_POLICY (or set ServeConfig.worker_env) to choose.
"""
