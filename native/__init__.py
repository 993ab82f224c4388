"""specray.native: the only code that touches llama.cpp (through llama_cpp)."""

import os

# Before anything imports llama_cpp (its OpenMP runtime reads this once):
# ggml's OpenMP threads busy-wait between ops by default; with a router, Ray
# actors or anything else sharing the cores, that spinning starves the thread
# doing real work (measured here: several- to tenfold slower decodes under
# load). Passive waiting is the safer default; export OMP_WAIT_POLICY to override.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
