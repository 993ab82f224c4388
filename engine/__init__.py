"""specray.engine: pure Python + numpy (no llama.cpp import).

Sequences and slots, the speculator interface and every model-free speculator,
chains and their selection policies, verification (greedy and rejection
sampling), the round scheduler, stats and typed configs.
"""
