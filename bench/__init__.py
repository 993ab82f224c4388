"""specray.bench: measuring tools, not deployments.

`specray bench` in-process (run.py drives it: prompts.py, lockstep.py runs
configurations side by side, probes.py measures the tie bound, divergence.py
classifies mismatches, report.py/plot.py/progress.py show it), over HTTP
(http_*.py, against specray and llama-server; multiturn.py: multi-turn chat
time to first token with and without the prompt cache), the hidden-row transport bench
(hidden.py) and the A/B report (ab_report.py). Uses engine, native and
deployments (engines come from deployments/builder.py); only the CLI and tests
import bench.
"""
