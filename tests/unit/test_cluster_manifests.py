"""The cluster manifests validate: every serve config (the files and the RayServices' serveConfigV2) parses
with Ray's ServeDeploySchema and its args with specray's ServeConfig; the RayServices against a checked-in
subset of KubeRay's CRD (cluster/kuberay/rayservice.schema.json); the launcher config against the schema the
`ray` package ships (ray/autoscaler/ray-schema.json). A misspelled field fails."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from ray.serve.schema import ServeDeploySchema

from specray.deployments.app import replica_options
from specray.deployments.config import ServeConfig

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "cluster"
RAYSERVICES = sorted((CLUSTER / "kuberay").glob("rayservice*.yaml"))
SERVE_CONFIGS = sorted(CLUSTER.glob("serve-*.yaml"))
CRD_SUBSET = json.loads((CLUSTER / "kuberay" / "rayservice.schema.json").read_text())
LAUNCHER_SCHEMA = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())


def _check_serve_config(doc: dict) -> list[ServeConfig]:
    ServeDeploySchema.model_validate(doc)
    out = []
    for app in doc["applications"]:
        assert app["import_path"] == "specray.deployments.app:build_app"
        out.append(ServeConfig.model_validate(app["args"]))
    return out


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_serve_configs_parse(path):
    assert _check_serve_config(yaml.safe_load(path.read_text()))


@pytest.mark.parametrize("path", RAYSERVICES, ids=lambda p: p.name)
def test_rayservices_validate_and_carry_a_valid_serve_config(path):
    doc = yaml.safe_load(path.read_text())
    jsonschema.validate(doc, CRD_SUBSET)
    (cfg,) = _check_serve_config(yaml.safe_load(doc["spec"]["serveConfigV2"]))
    cluster = doc["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    (workers,) = cluster["workerGroupSpecs"]
    gpus = int(workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    assert cfg.target_gpus == gpus  # the target actor holds the pod's GPUs
    # one `specray_replica` per worker pod, asked for by each replica: replicas land on different pods
    assert json.loads(json.loads(workers["rayStartParams"]["resources"])) == {"specray_replica": 1}
    assert cfg.replica_resources == {"specray_replica": 1.0}
    assert cfg.autoscaling["max_replicas"] <= workers["maxReplicas"]
    # the ingress on the head (a resource only the head has), which has the CPU it asks for
    head = cluster["headGroupSpec"]["rayStartParams"]
    assert HEAD_ONLY in cfg.ingress_resources and float(head["num-cpus"]) >= cfg.ingress_cpus
    if gpus > 1:
        assert cfg.engine.tensor_split is not None and len(cfg.engine.tensor_split) == gpus


#: the resource Ray gives the head node only (ray._common.constants.HEAD_NODE_RESOURCE_NAME)
HEAD_ONLY = "node:__internal_head__"


def test_a_misspelled_field_fails_the_checks():
    doc = yaml.safe_load(RAYSERVICES[0].read_text())
    bad = copy.deepcopy(doc)
    bad["spec"]["rayClusterConfig"]["workerGroupSpec"] = bad["spec"]["rayClusterConfig"].pop("workerGroupSpecs")
    with pytest.raises(jsonschema.ValidationError, match="workerGroupSpec"):
        jsonschema.validate(bad, CRD_SUBSET)
    launcher = yaml.safe_load((CLUSTER / "launcher" / "specray-gpu.yaml").read_text())
    launcher["head_node_typ"] = "head"
    with pytest.raises(jsonschema.ValidationError, match="head_node_typ"):
        jsonschema.validate(launcher, LAUNCHER_SCHEMA)
    serve = yaml.safe_load(doc["spec"]["serveConfigV2"])
    serve["applications"][0]["args"]["replica_resource"] = {"x": 1}
    with pytest.raises(ValueError, match="replica_resource"):
        _check_serve_config(serve)


def test_the_launcher_config_validates_and_deploys_the_gpu_serve_config():
    doc = yaml.safe_load((CLUSTER / "launcher" / "specray-gpu.yaml").read_text())
    jsonschema.validate(doc, LAUNCHER_SCHEMA)
    assert doc["available_node_types"][doc["head_node_type"]]["resources"] == {"CPU": 0}
    assert any("setup.sh --cuda" in c for c in doc["setup_commands"])
    assert any("serve deploy" in c and "cluster/serve-gpu.yaml" in c for c in doc["head_start_ray_commands"])


def test_replica_resources_go_into_the_replicas_own_bundle():
    cfg = ServeConfig.model_validate(yaml.safe_load((CLUSTER / "serve-cluster.yaml").read_text())
                                     ["applications"][0]["args"])
    opts = replica_options(cfg)
    assert opts["placement_group_bundles"][0] == {"CPU": 0.5, "specray_replica": 1.0}
    assert opts["placement_group_strategy"] == "STRICT_PACK" and opts["num_replicas"] == 2
    colo = replica_options(cfg.model_copy(update={"mode": "colocated"}))
    assert colo["ray_actor_options"]["resources"] == {"specray_replica": 1.0}


def test_the_cluster_configs_ingress_stays_on_the_head():
    """serve-cluster.yaml: split layout, its Ingress deployment asks for the head's own resource, so a lost
    worker takes engine replicas only (tests/cluster/test_multinode.py removes one under load)."""
    from specray.deployments.app import build_app_from_config, uses_fused

    cfg = ServeConfig.model_validate(yaml.safe_load((CLUSTER / "serve-cluster.yaml").read_text())
                                     ["applications"][0]["args"])
    assert not uses_fused(cfg)
    ingress = build_app_from_config(cfg)._bound_deployment
    assert ingress.name == "Ingress"
    assert ingress.ray_actor_options["resources"] == {HEAD_ONLY: 0.001}
    plain = build_app_from_config(cfg.model_copy(update={"ingress_resources": {}}))._bound_deployment
    assert "resources" not in plain.ray_actor_options
