"""specray.cluster: serve config YAMLs, cluster manifests and resource helpers."""
