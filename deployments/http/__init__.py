"""HTTP: the OpenAI-compatible ingress (FastAPI on Serve), its request/response schema, auth and limits.

Talks to engine replicas through Serve handles only; imports the A/B arm
table (deployments.ab) and the serve config, never the round core.
"""
