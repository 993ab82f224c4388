"""The engine replica: the Serve deployment, admission and slots, the round loop, faults and statistics.

One round thread per replica drives the engine that deployments/builder.py
assembles; asyncio callers get per-request streams. Uses engine, the actors'
clients and the serve config.
"""
