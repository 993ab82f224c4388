"""A/B arms: several chains served side by side, traffic split by weight and session, and the per-arm
statistics (counters, intervals) the ingress aggregates. Pure Python on configs; no model, no Ray.
"""
