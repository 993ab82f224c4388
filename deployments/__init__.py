"""specray.deployments: the Ray Serve application, one sub-package per concern.

http/ (ingress, OpenAI schema, guards), replica/ (admission, the round loop,
faults, stats), actors/ (target, companions, supervisor, row transport), ab/
(arms and their statistics); app.py holds the builders Serve imports and
builder.py the one place an engine is assembled. Uses engine and native.
"""
