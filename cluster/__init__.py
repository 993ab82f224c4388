"""specray.cluster: what an operator applies to run specray on a Ray cluster.

Serve config YAMLs (`serve run` / `specray serve --config`) and the placement
helpers that give each engine replica its own bundle group. Imports nothing of
specray's but is imported by deployments.
"""
