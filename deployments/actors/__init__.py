"""Ray actors beside a replica: the target context, the draft/hidden-head companion, their supervisor,
and the transport of hidden rows between them (object store, inline, CUDA IPC).

Each actor opens its llama.cpp contexts through deployments/builder.py.
"""
