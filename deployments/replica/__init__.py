"""The engine replica: the Serve deployment, admission and slots, the round loop, faults and statistics.

One round thread per replica drives the engine that deployments/builder.py
assembles; it hands each request's typed stream items (stream_items.py) to the
request's sink (sinks.py), and refuses or fails requests with typed errors
(errors.py). Uses engine, the actors' clients and the serve config.
"""
