"""`specray serve`: Ray (a running cluster, or a local one it starts) + the app on --host/--port, until Ctrl-C."""

from __future__ import annotations

import os
import signal
import sys
import time

from specray.engine.config import DRAFT_LOAD_FIELDS, parse_chain
from specray.engine.speculators.registry import cli_options

from specray.cluster.ray_env import environment, quiet_ray_env
from specray.deployments.ab.arms import parse_arm_flag, resolve_arms
from specray.deployments.config import ServeConfig, deep_merge, load_serve_config, read_yaml
from specray.deployments.models.config import failed_models, model_configs

# argparse flag -> ServeConfig path. The serve flags default to argparse.SUPPRESS: an attribute
# exists only if the user gave the flag, so "given" never has to be guessed from the value.
_FLAG_FIELDS = {
    "host": ("host",),
    "port": ("port",),
    "api_key": ("api_key",),
    "mode": ("mode",),
    "target_hop": ("target_hop",),
    "companion_hop": ("companion_hop",),
    "layout": ("layout",),
    "direct_ingress": ("direct_ingress",),
    "user_code_loop": ("user_code_loop",),
    "direct_writes": ("direct_writes",),
    "slots": ("engine", "slots"),
    "default_model": ("default_model",),
    "chat_template": ("engine", "chat_template"),
    "threads": ("engine", "threads"),
    "n_gpu_layers": ("engine", "n_gpu_layers"),
    "main_gpu": ("engine", "main_gpu"),
    "split_mode": ("engine", "split_mode"),
    "tensor_split": ("engine", "tensor_split"),
    "n_ctx": ("engine", "n_ctx"),
    "exact": ("engine", "exact"),
    "flash_attn": ("engine", "flash_attn"),
    "prompt_cache": ("engine", "prompt_cache"),
    "cache_ram": ("engine", "cache_ram"),
    "prefill_budget": ("engine", "prefill_budget"),
    "queue_order": ("engine", "queue_order"),
    "queue_max_wait": ("engine", "queue_max_wait_s"),
    "overlap": ("engine", "overlap"),
    "tile_pads": ("engine", "tile_pads"),
    "context_shift": ("engine", "context_shift"),
    "verify_shape": ("engine", "verify_shape"),
    "verify_buckets": ("engine", "verify_buckets"),
    "policy": ("engine", "chain", "policy"),
    "n_max": ("engine", "chain", "n_max"),
    "spec_tune": ("engine", "chain", "tune"),
    "spec_trees": ("engine", "chain", "trees"),
    "tree_branches": ("engine", "tree_branches"),
    "rollback": ("engine", "rollback"),
    "rollback_snapshots": ("engine", "rollback_snapshots"),
    # the model speculators' options (--draft-model, --mtp, --eagle3-model, ...), as their registry entries declare
    **{o.dest: ("engine", *o.config_path) for o in cli_options()},
    "cross_vocab": ("engine", "draft", "cross_vocab"),
    **{f"draft_{f}": ("engine", "draft", f) for f in DRAFT_LOAD_FIELDS},
    "hidden_transport": ("engine", "hidden", "transport"),
}


def flag_overrides(args) -> dict:
    """The ServeConfig fields the command line set explicitly, as a nested dict."""
    over: dict = {}
    for flag, path in _FLAG_FIELDS.items():
        if not hasattr(args, flag):
            continue
        node = over
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = getattr(args, flag)
    if hasattr(args, "spec"):
        over = deep_merge(over, {"engine": {"chain": {"speculators": parse_chain(args.spec)}}})
    return over


def arms_from_flags(flags: list[str], file_arms: list[dict]) -> list[dict]:
    """--arm flags -> the config's arms: each flag's chain and weight over the file's arm of that name
    (its params, autoscaling, ... kept); arms only in the file are dropped."""
    by_name = {a.get("name"): a for a in file_arms or []}
    out = []
    for text in flags:
        arm = parse_arm_flag(text)
        base = dict(by_name.get(arm.name, {}))
        out.append(base | {"name": arm.name, "chain": arm.chain, "weight": arm.weight})
    names = [a["name"] for a in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"--arm: arm names must be unique, repeated: {dup}")
    return out


def parse_model_flag(text: str) -> tuple[str, str]:
    """`--model [ID=]MODEL` -> (id, model): the id requests name, and the packaged alias or .gguf path.

    >>> parse_model_flag("smol=smollm2-135m"), parse_model_flag("/m/Qwen2-0.5B.Q4.gguf")
    (('smol', 'smollm2-135m'), ('Qwen2-0.5B.Q4', '/m/Qwen2-0.5B.Q4.gguf'))
    """
    ident, sep, model = text.partition("=")
    if not sep:
        return ServeConfig(engine={"model": text}).model_id, text
    if not ident.strip() or not model.strip():
        raise ValueError(f"--model {text!r}: expected MODEL or ID=MODEL, e.g. smol=smollm2-135m")
    return ident.strip(), model.strip()


def models_from_flags(flags: list[str], file_models: list[dict]) -> list[dict] | None:
    """--model flags -> the config's `models`, or None where they name one model without an id and the file
    has no `models` (then the flag is engine.model, as it always was). A model the file also lists (same id)
    keeps its other settings there; given flags replace the file's set of models."""
    if len(flags) == 1 and "=" not in flags[0] and not file_models:
        return None
    by_id = {m.get("id"): m for m in file_models or []}
    out = []
    for text in flags:
        ident, model = parse_model_flag(text)
        base = dict(by_id.get(ident, {}))
        out.append(base | {"id": ident, "engine": deep_merge(base.get("engine") or {}, {"model": model})})
    ids = [m["id"] for m in out]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ValueError(f"--model: model ids must be unique, repeated: {dup} (name them: --model ID=MODEL)")
    return out


def config_from_args(args, environ: dict | None = None) -> ServeConfig:
    """ServeConfig's defaults, then --config FILE, then every flag given (nested keys merged).
    $SPECRAY_API_KEY is the API key when neither the file nor --api-key sets one."""
    base = {"config_file": args.config} if getattr(args, "config", None) else {}
    over = flag_overrides(args)
    if hasattr(args, "arm"):
        file_arms = (read_yaml(args.config).get("arms") or []) if getattr(args, "config", None) else []
        over["arms"] = arms_from_flags(args.arm, file_arms)
    if hasattr(args, "model"):
        file_models = (read_yaml(args.config).get("models") or []) if getattr(args, "config", None) else []
        models = models_from_flags(args.model, file_models)
        if models is None:
            over = deep_merge(over, {"engine": {"model": args.model[0]}})
        else:
            over["models"] = models
    cfg = load_serve_config(deep_merge(base, over))
    env_key = (os.environ if environ is None else environ).get("SPECRAY_API_KEY")
    if env_key and cfg.api_key is None and not hasattr(args, "api_key"):
        cfg = cfg.model_copy(update={"api_key": env_key})
    return cfg


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def url_of(cfg: ServeConfig) -> str:
    host = "127.0.0.1" if cfg.host in ("0.0.0.0", "::") else cfg.host
    prefix = cfg.route_prefix.rstrip("/")
    return f"http://{host}:{cfg.port}{prefix}"


def ray_target(flag: str | None, env: str | None, recorded: str | None, running: set[str]) -> tuple[str, str]:
    """Which Ray cluster `specray serve` uses: (address for ray.init, why). The --address flag wins, then
    RAY_ADDRESS, then the cluster `ray start` recorded on this machine if its GCS is still running; else a
    new local one ("local"). A recorded cluster that is gone (stale file) is not joined.

    >>> ray_target(None, None, None, set())
    ('local', 'no running Ray cluster found')
    >>> ray_target(None, None, "10.0.0.5:6379", {"10.0.0.5:6379"})
    ('auto', 'the running cluster ray start left on this machine at 10.0.0.5:6379')
    >>> ray_target(None, None, "10.0.0.5:6379", set())[0]
    'local'
    >>> ray_target("auto", "10.0.0.7:6379", None, set())
    ('auto', '--address')
    """
    if flag:
        return flag, "--address"
    if env:
        return env, "RAY_ADDRESS"
    if recorded and recorded in running:
        # "auto", not the address: Ray reads a local cluster's auth token only for one it found itself
        return "auto", f"the running cluster ray start left on this machine at {recorded}"
    if recorded:
        return "local", f"the cluster recorded at {recorded} is not running"
    return "local", "no running Ray cluster found"


def find_ray_target(flag: str | None) -> tuple[str, str]:
    """ray_target for this machine: (address for ray.init, why)."""
    from ray._private import services

    try:
        recorded = services.find_bootstrap_address(None)
        running = set(services.find_gcs_addresses()) if recorded else set()
    except Exception:  # private API: if it moves, behave as if nothing were recorded
        recorded, running = None, set()
    return ray_target(flag, os.environ.get("RAY_ADDRESS") or None, recorded, running)


def connect_ray(address: str, why: str) -> tuple[str, bool]:
    """ray.init() at what find_ray_target said; returns (a line saying which cluster this is and why, joined). A
    cluster that is joined keeps its own resources (num_cpus may not be given to one: Ray refuses)."""
    import ray

    if address == "local":
        n = max(2, os.cpu_count() or 2)
        ray.init(address="local", num_cpus=n, include_dashboard=False)
        return f"started a local Ray ({n} CPUs; {why})", False
    try:
        ray.init(address=address)
    except (ConnectionError, RuntimeError) as e:
        raise RuntimeError(f"could not join the Ray cluster at {address} (from {why}): {e}") from None
    res = ray.cluster_resources()
    return (f"joined the Ray cluster at {ray.get_runtime_context().gcs_address} (from {why}; "
            f"{res.get('CPU', 0):g} CPUs, {res.get('GPU', 0):g} GPUs, {len(ray.nodes())} nodes)"), True


def direct_ingress_env(port: int) -> dict[str, str]:
    """Environment that makes Ray Serve (2.60) run direct ingress with the ingress replica on `port`: Serve reads
    these at import, in the controller and the replicas, so they must be set before Ray starts. One port in the
    range = one ingress replica per node; a replaced replica takes the port again at once (no quarantine: that
    is for HAProxy's stale backends) and a stopping one drains 2 s, not 30 (no load balancer in front).

    >>> direct_ingress_env(8000)["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"]
    '8000'
    """
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),  # range(MIN, MAX): one port
            "RAY_SERVE_PORT_QUARANTINE_S": "0", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}


def check_direct_ingress(cfg: ServeConfig) -> None:
    """ValueError naming --direct-ingress when the config could start more than one ingress replica (they
    would all want `port`)."""
    from specray.deployments.layout import several_ingress_replicas

    what = several_ingress_replicas(cfg)
    if what is not None:
        raise ValueError(f"--direct-ingress serves --port from one ingress replica; {what} may be more than 1 "
                         "(drop --direct-ingress, or serve one replica)")


def auto_direct_ingress(starts_local_ray: bool, serve_imported: bool, several: str | None) -> tuple[bool, str]:
    """Direct ingress when the config leaves it unset: on where it can be, i.e. specray serve starts its own Ray
    (Serve reads the setting from its processes' environment), Serve is not imported yet in this process, and
    one ingress replica serves (one port). Returns (on, why) for the serving line.

    >>> auto_direct_ingress(True, False, None)
    (True, 'direct ingress (auto)')
    >>> auto_direct_ingress(False, False, None)[1]
    'no direct ingress (auto: a joined Ray cluster)'
    >>> auto_direct_ingress(True, False, "ingress_replicas")[1]
    'no direct ingress (auto: ingress_replicas may be more than 1)'
    """
    if not starts_local_ray:
        return False, "no direct ingress (auto: a joined Ray cluster)"
    if serve_imported:
        return False, "no direct ingress (auto: Ray Serve was imported before specray serve)"
    if several is not None:
        return False, f"no direct ingress (auto: {several} may be more than 1)"
    return True, "direct ingress (auto)"


def serving_line(model_id: str, cfg: ServeConfig, layout: str | None = None) -> str:
    """How one model serves, for the start-up line (`layout`: said here in a one-model app).

    >>> serving_line("smol", ServeConfig(engine={"slots": 2, "chain": {"speculators": ["suffix"]}}))
    'smol (colocated, chain suffix, 2 slots per replica)'
    """
    if cfg.arms:
        arms = ", ".join(f"{a.name}={a.chain_config(cfg.engine.chain).label}@{a.weight:g}" for a in resolve_arms(cfg))
        what = f"arms {arms}"
    else:
        what = f"chain {cfg.engine.chain.label}"
    layout = f"{layout}, " if layout else ""
    return f"{model_id} ({cfg.mode}, {layout}{what}, {cfg.engine.slots} slots per replica)"


def main_serve(args) -> int:
    cfg = config_from_args(args)
    from specray.native.models import resolve_model

    for mcfg in model_configs(cfg).values():  # fail fast (exit 2) on a bad model before starting Ray
        resolve_model(mcfg.engine.model)
        for option in cli_options():  # the model speculators' model files (--draft-model, --eagle3-model, ...)
            path = mcfg.engine
            for part in option.config_path:
                path = getattr(path, part)
            if not option.switch and path:
                resolve_model(path)

    proxy_port = cfg.port
    address, why = find_ray_target(getattr(args, "address", None))
    if cfg.direct_ingress is None:
        from specray.deployments.layout import several_ingress_replicas

        on, auto = auto_direct_ingress(address == "local", "ray.serve" in sys.modules, several_ingress_replicas(cfg))
        cfg = cfg.model_copy(update={"direct_ingress": on})
    else:
        auto = None
    # a local Ray that this command starts: Ray's own processes quieter (cluster/ray_env.py), set around ray.init
    quiet = quiet_ray_env(os.environ) if address == "local" and getattr(args, "quiet_ray", True) else {}
    if cfg.direct_ingress:
        if "ray.serve" in sys.modules:  # Serve read its flags at import: too late to set them
            raise RuntimeError("--direct-ingress must be set before Ray Serve is imported in this process")
        check_direct_ingress(cfg)
        os.environ.update(direct_ingress_env(cfg.port))
        proxy_port = _free_port()  # Serve's proxy still runs (head node): out of the replica's way

    import ray
    from ray import serve

    from specray.deployments.app import build_app_from_config, uses_fused

    joined = False
    if not ray.is_initialized():
        with environment(quiet):
            line, joined = connect_ray(address, why)
        if quiet:
            line += f"; quiet: {len(quiet)} settings slow Ray's periodic loops, --no-quiet-ray for Ray's defaults"
        print(f"specray: {line}", flush=True)
    if joined and cfg.direct_ingress:
        ray.shutdown()
        raise ValueError("--direct-ingress needs a Ray that specray serve starts itself (Serve reads the setting "
                         "from its processes' environment): add --address local")
    serve.start(http_options={"host": cfg.host, "port": proxy_port})
    t0 = time.perf_counter()
    try:
        serve.run(build_app_from_config(cfg), name=cfg.app_name, route_prefix=cfg.route_prefix)
    except RuntimeError as e:
        # one model that cannot start (a replica whose constructor fails) leaves the others serving
        app = serve.status().applications.get(cfg.app_name)
        statuses = {n: str(getattr(d.status, "value", d.status)) for n, d in (app.deployments if app else {}).items()}
        failed = failed_models(cfg, statuses) if cfg.models else None
        if not failed:
            raise
        print(f"specray: WARNING: {', '.join(failed)} could not start, serving the other models; its requests get "
              f"503 and /health names it ({e})", file=sys.stderr, flush=True)
    url = url_of(cfg)
    layout = "fused: the engine replica serves HTTP" if uses_fused(cfg) else "split: ingress + engine deployments"
    if cfg.direct_ingress:
        layout += f"; direct ingress: the replica listens on {cfg.port}, Serve's proxy on {proxy_port}"
    if auto is not None:
        layout += f"; {auto}"
    what = "; ".join(serving_line(mid, mcfg, None if cfg.models else layout) for mid, mcfg in model_configs(cfg).items())
    if cfg.models:
        what = f"{len(cfg.models)} models ({layout}): {what}"
    print(f"specray: serving {what} at {url}/v1  [ready in {time.perf_counter() - t0:.1f}s]", flush=True)
    auth = " -H 'Authorization: Bearer <api key>'" if cfg.api_key else ""
    print(f"  try: curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
          "-d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}]}'", flush=True)
    print("  Ctrl-C to stop.", flush=True)

    stop = {"now": False}

    def _on_term(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, _on_term)
    # Ctrl-C explicitly too: a process started in the background of a shell without job control (`cmd &` in a
    # script, as CI runners do) inherits SIGINT ignored, and Python then never raises KeyboardInterrupt, so
    # `kill -INT` did nothing (the serve-command tests waited out their timeout on it)
    signal.signal(signal.SIGINT, _on_term)
    while not stop["now"]:
        time.sleep(0.5)
    print("specray: shutting down", file=sys.stderr, flush=True)
    try:
        if joined:  # a cluster we joined keeps Serve and its other apps: only ours goes
            serve.delete(cfg.app_name)
        else:
            serve.shutdown()
    finally:
        ray.shutdown()
    return 0
