"""The cluster manifests validate: every serve config (the files and the RayServices' serveConfigV2) parses
with Ray's ServeDeploySchema and its args with specray's ServeConfig; the RayServices against KubeRay's own
RayService CRD (cluster/kuberay/crd/, strict about field names as the API server is); the launcher config
against the schema the `ray` package ships (ray/autoscaler/ray-schema.json). A misspelled field fails. Each
RayService's GPU worker group holds every model's engine replicas at their max replicas."""

from __future__ import annotations

import copy
import doctest
import gzip
import importlib.util
import json
from collections import Counter
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from ray.serve.schema import ServeDeploySchema

from specray.deployments.ab.arms import resolve_arms
from specray.deployments.app import arm_serve_config, replica_options
from specray.deployments.config import ServeConfig
from specray.deployments.models.config import model_configs
from specray.deployments.models.directory import ModelDirectory

from . import _kube_schema

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "cluster"
RAYSERVICES = sorted((CLUSTER / "kuberay").glob("rayservice*.yaml"))
SERVE_CONFIGS = sorted(CLUSTER.glob("serve-*.yaml"))
CRD_FILE = CLUSTER / "kuberay" / "crd" / "rayservice.v1.schema.json.gz"
# validators built once: jsonschema.validate() checks the (large) schema itself on every call
CRD = jsonschema.Draft202012Validator(
    _kube_schema.to_json_schema(json.loads(gzip.decompress(CRD_FILE.read_bytes()))))
#: KubeRay's CRD as the workspace holds it (absent on a clean checkout: the test that compares is skipped)
UPSTREAM_CRD = REPO.parent / "shared" / "kuberay" / "ray.io_rayservices.yaml"
_LAUNCHER_SCHEMA = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
LAUNCHER = jsonschema.validators.validator_for(_LAUNCHER_SCHEMA)(_LAUNCHER_SCHEMA)


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


def _replica_demand(cfg: ServeConfig) -> dict[str, float]:
    """The Ray resources one engine replica of `cfg` takes: its placement group's bundles summed (distributed),
    or its actor's (co-located)."""
    opts = replica_options(cfg)
    bundles = opts.get("placement_group_bundles")
    if bundles is None:
        actor = opts["ray_actor_options"]
        bundles = [{"CPU": actor["num_cpus"], "GPU": actor.get("num_gpus", 0)} | actor.get("resources", {})]
    total: Counter = Counter()
    for bundle in bundles:
        total.update(bundle)
    return dict(total)


def _max_replicas(cfg: ServeConfig) -> int:
    return cfg.autoscaling.get("max_replicas", 1) if cfg.autoscaling else cfg.num_replicas


def _engine_deployments(cfg: ServeConfig):
    """(model id, the config of one engine deployment): every arm of every model."""
    for model, mcfg in model_configs(cfg).items():
        for arm in resolve_arms(mcfg):
            yield model, arm_serve_config(mcfg, arm)


@pytest.mark.parametrize("path", RAYSERVICES, ids=lambda p: p.name)
def test_rayservices_validate_and_carry_a_valid_serve_config(path):
    doc = yaml.safe_load(path.read_text())
    CRD.validate(doc)
    (cfg,) = _check_serve_config(yaml.safe_load(doc["spec"]["serveConfigV2"]))
    cluster = doc["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    (workers,) = cluster["workerGroupSpecs"]
    pod = workers["template"]["spec"]["containers"][0]["resources"]["limits"]
    gpus, cpus = int(pod["nvidia.com/gpu"]), float(pod["cpu"])
    # one `specray_replica` per worker pod, asked for by each replica: replicas land on different pods
    assert json.loads(json.loads(workers["rayStartParams"]["resources"])) == {"specray_replica": 1}
    pods_at_max = gpus_at_max = 0
    for model, dcfg in _engine_deployments(cfg):
        need = _replica_demand(dcfg)
        assert dcfg.replica_resources == {"specray_replica": 1.0}, model
        # a replica (target actor and companion) holds the pod's GPUs, and fits in its CPUs
        assert need.get("GPU", 0) == gpus and need["CPU"] <= cpus, (model, need)
        if dcfg.target_gpus > 1:
            assert dcfg.engine.tensor_split is not None and len(dcfg.engine.tensor_split) == dcfg.target_gpus
        pods_at_max += _max_replicas(dcfg)
        gpus_at_max += _max_replicas(dcfg) * need.get("GPU", 0)
    # every model at its max replicas at once, each replica on a pod of its own
    assert pods_at_max <= workers["maxReplicas"]
    assert gpus_at_max <= workers["maxReplicas"] * gpus
    # the ingress on the head (a resource only the head has), which has the CPU it asks for
    head = cluster["headGroupSpec"]["rayStartParams"]
    assert HEAD_ONLY in cfg.ingress_resources and float(head["num-cpus"]) >= cfg.ingress_cpus


def test_the_multi_model_files_serve_two_models_with_aliases_and_a_default():
    multi = yaml.safe_load((CLUSTER / "kuberay" / "rayservice-multi.yaml").read_text())
    for doc in (yaml.safe_load((CLUSTER / "serve-multi.yaml").read_text()),
                yaml.safe_load(multi["spec"]["serveConfigV2"])):
        (cfg,) = _check_serve_config(doc)
        configs = model_configs(cfg)
        assert len(configs) == 2 and all(m.aliases for m in cfg.models)
        directory = ModelDirectory(cfg)
        assert directory.resolve(None) == directory.canonical(cfg.default_model)
        for m in cfg.models:
            assert [directory.resolve(a) for a in m.aliases] == [m.id] * len(m.aliases)
            assert m.autoscaling and configs[m.id].autoscaling == m.autoscaling  # its own, not the app's
        assert len({c.engine.model for c in configs.values()}) == 2


def test_the_checked_in_crd_is_kuberays():
    """The gzipped schema is what scripts/refresh-kuberay-crd.py extracts from KubeRay's CRD (where the
    workspace has a copy of it)."""
    if not UPSTREAM_CRD.exists():
        pytest.skip(f"no {UPSTREAM_CRD}")
    spec = importlib.util.spec_from_file_location("refresh_crd", REPO / "scripts" / "refresh-kuberay-crd.py")
    refresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(refresh)
    assert refresh.main([str(UPSTREAM_CRD), "--check", "--out", str(CRD_FILE)]) == 0


def test_the_crd_conversion_examples():
    assert doctest.testmod(_kube_schema).failed == 0


#: the resource Ray gives the head node only (ray._common.constants.HEAD_NODE_RESOURCE_NAME)
HEAD_ONLY = "node:__internal_head__"


def test_a_misspelled_field_fails_the_checks():
    doc = yaml.safe_load(RAYSERVICES[0].read_text())
    bad = copy.deepcopy(doc)
    bad["spec"]["rayClusterConfig"]["workerGroupSpec"] = bad["spec"]["rayClusterConfig"].pop("workerGroupSpecs")
    with pytest.raises(jsonschema.ValidationError, match="workerGroupSpec"):
        CRD.validate(bad)
    # deep inside the pod template too (the API server would prune the field: the pod would run without limits)
    bad = copy.deepcopy(doc)
    container = bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    container["resource"] = container.pop("resources")
    with pytest.raises(jsonschema.ValidationError, match="'resource' was unexpected"):
        CRD.validate(bad)
    launcher = yaml.safe_load((CLUSTER / "launcher" / "specray-gpu.yaml").read_text())
    launcher["head_node_typ"] = "head"
    with pytest.raises(jsonschema.ValidationError, match="head_node_typ"):
        LAUNCHER.validate(launcher)
    serve = yaml.safe_load(doc["spec"]["serveConfigV2"])
    serve["applications"][0]["args"]["replica_resource"] = {"x": 1}
    with pytest.raises(ValueError, match="replica_resource"):
        _check_serve_config(serve)
    multi = yaml.safe_load((CLUSTER / "serve-multi.yaml").read_text())
    multi["applications"][0]["args"]["models"][1]["autoscalling"] = {"max_replicas": 2}
    with pytest.raises(ValueError, match="autoscalling"):
        _check_serve_config(multi)


def test_the_launcher_config_validates_and_deploys_the_gpu_serve_config():
    doc = yaml.safe_load((CLUSTER / "launcher" / "specray-gpu.yaml").read_text())
    LAUNCHER.validate(doc)
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
