"""specray.deployments: the Ray Serve application, one sub-package per concern.

http/ (ingress, OpenAI schema, guards), replica/ (admission, the round loop,
faults, stats), actors/ (target, companions, supervisor, row transport), ab/
(arms and their statistics); app.py holds the builders Serve imports (split
or fused layout), fused.py the one-arm deployment that is engine replica and
HTTP ingress at once, builder.py the one place an engine is assembled. Uses
engine and native.
"""
