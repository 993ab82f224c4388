"""Model-free speculators, one module each, with a registry by name."""
