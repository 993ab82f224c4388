"""specray.cli: the `specray` command (main.py) and its `serve` subcommand (serve.py).

Parses flags into the typed configs and hands them to deployments and bench;
holds no engine logic of its own.
"""
