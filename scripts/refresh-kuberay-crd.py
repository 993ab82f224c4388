#!/usr/bin/env python3
"""Extract the RayService schema that tests/unit/test_cluster_manifests.py validates the KubeRay manifests
against, from KubeRay's own CustomResourceDefinition.

    python3 scripts/refresh-kuberay-crd.py KUBERAY/ray-operator/config/crd/bases/ray.io_rayservices.yaml
    python3 scripts/refresh-kuberay-crd.py CRD.yaml --check     # exit 1 if the checked-in file differs

It writes the CRD's `ray.io/v1` version's `schema.openAPIV3Schema`, unchanged (Kubernetes' `x-kubernetes-*`
extensions included; the test turns them into plain JSON Schema), as compact JSON with sorted keys, gzipped
without a timestamp: the same CRD always gives the same bytes, so a refresh shows up in a diff only when the
schema changed. Record the CRD's commit in cluster/kuberay/crd/README.md. Needs PyYAML (in the venv).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import yaml

OUT = Path(__file__).resolve().parents[1] / "cluster" / "kuberay" / "crd" / "rayservice.v1.schema.json.gz"
VERSION = "v1"  # the apiVersion the manifests use: ray.io/v1


def extract(crd: dict, version: str = VERSION) -> dict:
    """The openAPIV3Schema of one version of a CustomResourceDefinition.

    >>> extract({"kind": "CustomResourceDefinition", "spec": {"versions": [
    ...     {"name": "v1", "schema": {"openAPIV3Schema": {"type": "object"}}}]}})
    {'type': 'object'}
    """
    if crd.get("kind") != "CustomResourceDefinition":
        raise SystemExit(f"not a CustomResourceDefinition: kind {crd.get('kind')!r}")
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return v["schema"]["openAPIV3Schema"]
    raise SystemExit(f"no version {version!r} in the CRD: {[v['name'] for v in crd['spec']['versions']]}")


def encode(schema: dict) -> bytes:
    """Compact, key-sorted JSON, gzipped with mtime 0 (reproducible bytes)."""
    text = json.dumps(schema, sort_keys=True, separators=(",", ":")).encode()
    return gzip.compress(text, compresslevel=9, mtime=0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("crd", type=Path, help="KubeRay's ray.io_rayservices.yaml")
    ap.add_argument("--out", type=Path, default=OUT, help=f"where to write (default {OUT.name} in the repo)")
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = ap.parse_args(argv)
    data = encode(extract(yaml.load(args.crd.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))))
    if args.check:
        same = args.out.exists() and args.out.read_bytes() == data
        print(f"{args.out}: {'up to date' if same else 'differs from ' + str(args.crd)}")
        return 0 if same else 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(data)
    print(f"wrote {args.out} ({len(data)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
