"""specray.deployments: CLI, benchmark and (Ray Serve) deployments."""
