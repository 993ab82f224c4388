"""HTTP: the OpenAI-compatible ingress (FastAPI on Serve), its request/response schema, auth and limits.

Reaches engine replicas through engine links (engine_link.py: Serve handles
here; the fused layout's in-process link lives in deployments/fused.py);
imports the A/B arm table (deployments.ab) and the serve config, never the
round core.
"""
