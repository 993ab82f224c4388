"""Several models in one app: each model's config (config.py) and how a request's `model` finds it
(directory.py)."""
