"""The cluster launch files: `ray up` configs, the Serve config and the KubeRay RayService."""

from __future__ import annotations

import copy
import importlib
import ipaddress
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "cluster_configs"
RAY_UP = sorted(CONFIGS.glob("ray-up-*.yaml"))
SERVE_CONFIG = CONFIGS / "serve_config.yaml"
RAYSERVICE = CONFIGS / "kuberay-rayservice.yaml"


def ray_validate(config: dict) -> dict:
    """What `ray up` does with a config before touching any host (commands._bootstrap_config:
    defaults, Ray's schema, the node provider's own checks)."""
    from ray.autoscaler._private.commands import _bootstrap_config

    return _bootstrap_config(copy.deepcopy(config), no_config_cache=True)


def ray_start(commands: list[str], head: bool) -> str:
    (cmd,) = [c for c in commands if ("ray start --head" in c) == head and "ray start" in c]
    return cmd


def start_flags(cmd: str) -> set[str]:
    """The `ray start` flags and exported variable names of one start command."""
    flags = set(re.findall(r"(--[a-z-]+)=", cmd.split("ray start", 1)[1]))
    exported = set(re.findall(r"\b([A-Z][A-Z0-9_]+)=", cmd.split("ray start", 1)[0]))
    return flags | exported


def test_both_ray_up_configs_exist():
    assert {p.name for p in RAY_UP} == {"ray-up-atom.yaml", "ray-up-emulated.yaml"}


@pytest.mark.parametrize("path", RAY_UP, ids=lambda p: p.name)
def test_ray_up_config_passes_rays_validation(path: Path):
    config = yaml.safe_load(path.read_text())
    prepared = ray_validate(config)
    provider = prepared["provider"]
    assert provider["type"] == "external"
    assert provider["module"] == "rbln_ray.cluster.provider.SharedHostProvider"
    assert len(provider["worker_ips"]) >= 2
    node_types = prepared["available_node_types"]
    assert node_types[prepared["head_node_type"]]["max_workers"] == 0
    (workers_type,) = [t for n, t in node_types.items() if n != prepared["head_node_type"]]
    assert workers_type["min_workers"] == workers_type["max_workers"] == len(provider["worker_ips"])
    head = ray_start(prepared["head_start_ray_commands"], head=True)
    workers = ray_start(prepared["worker_start_ray_commands"], head=False)
    # Dashboard (and Serve's REST API) on loopback; token auth on; GCS on the given address.
    assert "--dashboard-host=127.0.0.1" in head
    assert f"--node-ip-address={provider['head_ip']}" in head
    assert "RAY_AUTH_MODE=token" in head and "RAY_AUTH_MODE=token" in workers
    assert "0.0.0.0" not in head + workers
    # Shared hosts: no `ray stop` anywhere; every start is preceded by this node's scoped stop,
    # which finds the node's processes by the RAY_TMPDIR its `ray start` exported.
    commands = [
        *prepared["setup_commands"], *prepared["head_start_ray_commands"],
        *prepared["worker_start_ray_commands"], *prepared["initialization_commands"],
    ]  # fmt: skip
    assert not [c for c in commands if re.search(r"(^|[;&|(]|\bthen|\bdo)\s*ray stop\b", c)]
    # One RAY_TMPDIR per host address (the one SSH reached), so hosts sharing a HOME stay apart.
    address = """$(echo $SSH_CONNECTION | cut -d' ' -f3)"""
    stop = provider["node_stop_command"]
    assert stop == f'rbln-ray stop-node --ray-tmpdir "$HOME/rbln-ray/{address}"'
    for cmds in (prepared["head_start_ray_commands"], prepared["worker_start_ray_commands"]):
        assert cmds[0] == stop
        start = ray_start(cmds, head=cmds is prepared["head_start_ray_commands"])
        assert f'RBLN_RAY_NODE_IP="{address}"' in start
        assert 'RAY_TMPDIR="$HOME/rbln-ray/$RBLN_RAY_NODE_IP"' in start
        assert '--temp-dir="$RAY_TMPDIR"' in start
    assert '--node-ip-address="$RBLN_RAY_NODE_IP"' in workers
    setup = " ".join(prepared["setup_commands"])
    assert "make -C ~/rbln-ray/src install" in setup and ".rbln-ray-installed" in setup
    # every node's Serve proxy caps request bodies (rbln_ray.serve.proxy_guard)
    from rbln_ray.serve.proxy_guard import CALLBACK, CALLBACK_ENV

    assert f"{CALLBACK_ENV}={CALLBACK}" in head and f"{CALLBACK_ENV}={CALLBACK}" in workers
    if "emulated" in path.name:
        assert "RBLN_RAY_DEVICE=emulated" in head and "RBLN_RAY_DEVICE=emulated" in workers
        assert """--resources='{"RBLN": 2}'""" in workers
        assert "RBLN_RAY_EMULATED_DEVICES=2" in workers
        assert "rbln_ray/emulator/_shim" in head and "rbln_ray/emulator/_shim" in workers
        assert "[rbln]" not in setup
        # One machine: loopback hosts, never 127.0.0.1 (Ray advertises the host's address
        # for it: services.resolve_ip_for_localhost).
        ips = [provider["head_ip"], *provider["worker_ips"]]
        assert all(ipaddress.ip_address(ip) in ipaddress.ip_network("127.0.0.0/8") for ip in ips)
        assert "127.0.0.1" not in ips
    else:
        assert "[rbln]" in setup and "pypi.rbln.ai" in setup
        assert "RBLN_RAY_DEVICE=rbln" in head and "_shim" not in head + workers


def test_atom_and_emulated_configs_differ_only_where_hardware_needs_it():
    atom, emu = (
        yaml.safe_load((CONFIGS / f"ray-up-{n}.yaml").read_text()) for n in ("atom", "emulated")
    )
    assert set(atom) - {"cluster_name"} == set(emu) - {"cluster_name"}
    assert set(atom["provider"]) == set(emu["provider"])
    for key in ("type", "module", "ssh_port", "node_stop_command"):
        assert atom["provider"][key] == emu["provider"][key], key
    for key in ("available_node_types", "head_node_type", "max_workers", "file_mounts",
                "rsync_exclude", "initialization_commands"):  # fmt: skip
        assert atom[key] == emu[key], key
    assert set(emu["setup_commands"]) <= set(atom["setup_commands"])  # ATOM adds the extra
    # Start commands: the same flags and variables, except these.
    # One machine: fixed agent and metrics-export ports would collide between its "hosts".
    one_machine = {
        "--num-cpus",
        "--resources",
        "--dashboard-agent-listen-port",
        "--object-store-memory",
        "--metrics-export-port",
    }
    hardware = {True: one_machine, False: one_machine | {"RBLN_RAY_EMULATED_DEVICES"}}
    for head, key in ((True, "head_start_ray_commands"), (False, "worker_start_ray_commands")):
        a, e = ray_start(atom[key], head), ray_start(emu[key], head)
        assert start_flags(a) ^ start_flags(e) <= hardware[head], start_flags(a) ^ start_flags(e)


def test_file_mounts_ship_what_make_install_needs_and_no_venv(tmp_path: Path):
    """The checkout's paths the configs ship (both configs ship the same, tested above) are
    enough for the nodes' `make install` and small: `ray up` hashes every byte of them."""
    mounts = yaml.safe_load(RAY_UP[0].read_text())["file_mounts"]
    src = {r: loc for r, loc in mounts.items() if r.startswith("~/rbln-ray/src/")}
    node = tmp_path / "src"
    node.mkdir()
    size = 0
    for remote, local in src.items():
        assert local.startswith("./") and remote == f"~/rbln-ray/src/{local[2:]}", remote
        path = ROOT / local
        files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
        assert files and not any(".venv" in f.parts for f in files), local
        size += sum(f.stat().st_size for f in files)
        copy = shutil.copy2 if path.is_file() else shutil.copytree
        copy(path, node / local[2:])
    assert size < 20 * 2**20, f"{size / 2**20:.0f} MiB shipped to every node"
    readme = re.search(r'^readme = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert readme and (node / readme[1]).is_file()  # `pip install -e .` reads it
    dry = subprocess.run(
        ["make", "-n", "-C", str(node), "install", f"VENV={tmp_path / 'venv'}"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert dry.returncode == 0, dry.stderr  # e.g. "No rule to make target 'requirements.txt'"
    assert "pip install -r requirements.txt" in dry.stdout


@pytest.mark.parametrize("path", RAY_UP, ids=lambda p: p.name)
@pytest.mark.parametrize(
    "breakage",
    ["unknown_top_level_field", "provider_without_head_ip", "commands_not_a_list"],
)
def test_broken_ray_up_config_fails_validation(path: Path, breakage: str):
    import jsonschema

    config = yaml.safe_load(path.read_text())
    expected: type[Exception] = jsonschema.ValidationError
    if breakage == "unknown_top_level_field":
        config["head_start_ray_comands"] = ["ray start --head"]  # a typo'd key
    elif breakage == "provider_without_head_ip":
        del config["provider"]["head_ip"]
        expected = ValueError  # the provider's own check, before any host is touched
    else:
        config["worker_start_ray_commands"] = "ray start --address=$RAY_HEAD_IP:6379"
    with pytest.raises(expected):
        ray_validate(config)


def test_serve_config_is_deployable_and_valid():
    from rbln_ray.serve.config import load_config

    doc = yaml.safe_load(SERVE_CONFIG.read_text())
    assert doc["http_options"]["host"] == "127.0.0.1"
    (app,) = doc["applications"]
    assert app["import_path"] == "rbln_ray.serve:build_app"
    assert app["route_prefix"] == "/"
    config = load_config(SERVE_CONFIG)  # a Serve config file: its app's args
    assert config.api_key_env == "RBLN_RAY_API_KEY"
    assert [m.model for m in config.models] == ["demo"]
    # Serve's own schema accepts the file as `serve deploy` would.
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(doc)
    assert schema.proxy_location == "HeadOnly"


def test_import_path_resolves():
    for text in (SERVE_CONFIG.read_text(), rayservice_serve_config_text()):
        module, attr = yaml.safe_load(text)["applications"][0]["import_path"].split(":")
        assert callable(getattr(importlib.import_module(module), attr))


def rayservice() -> dict:
    return yaml.safe_load(RAYSERVICE.read_text())


def rayservice_serve_config_text() -> str:
    return rayservice()["spec"]["serveConfigV2"]


def _mounts(pod_template: dict) -> set[str]:
    (container,) = pod_template["spec"]["containers"]
    return {m["mountPath"] for m in container.get("volumeMounts", [])}


def test_rayservice_manifest(tmp_path: Path):
    from rbln_ray.serve.config import load_config

    doc = rayservice()
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayService"
    cluster = doc["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    # Multi-host: Ray's token authentication on (KubeRay generates and injects the token).
    assert cluster["authOptions"] == {"mode": "token"}
    (workers,) = cluster["workerGroupSpecs"]

    # Workers ask Kubernetes for ATOMs and tell Ray the same count as RBLN.
    (container,) = workers["template"]["spec"]["containers"]
    atoms = int(container["resources"]["limits"]["rebellions.ai/ATOM"])
    assert int(container["resources"]["requests"]["rebellions.ai/ATOM"]) == atoms
    # KubeRay passes rayStartParams to `ray start` through a shell: a quoted JSON string.
    worker_res = json.loads(json.loads(workers["rayStartParams"]["resources"]))
    assert worker_res == {"RBLN": atoms}
    assert json.loads(json.loads(head["rayStartParams"]["resources"])) == {"RBLN": 0}

    # Every node runs a Serve proxy (EveryNode), and every proxy installs the guard.
    from rbln_ray.serve.proxy_guard import CALLBACK, CALLBACK_ENV

    for group in (head, workers):
        (c,) = group["template"]["spec"]["containers"]
        assert {"name": CALLBACK_ENV, "value": CALLBACK} in c["env"], group.get("groupName")

    serve_doc = yaml.safe_load(doc["spec"]["serveConfigV2"])
    assert serve_doc["proxy_location"] == "EveryNode"
    (app,) = serve_doc["applications"]
    assert app["import_path"] == "rbln_ray.serve:build_app"
    args = app["args"]

    # Model paths are absolute, on the volume mounted at the same path in head and workers.
    head_mounts, worker_mounts = _mounts(head["template"]), _mounts(workers["template"])
    for m in args["models"]:
        path = Path(m["model"])
        assert path.is_absolute()
        assert any(path.is_relative_to(mp) for mp in head_mounts & worker_mounts), path
        assert m["devices_per_worker"] * m.get("pipeline_stages", 1) <= atoms
    # They exist only inside the pods, so validate everything else against a stand-in dir
    # (load_config rejects a model directory that does not exist, as it would on the head).
    with pytest.raises(ValueError, match="does not exist"):
        load_config(args)
    local = copy.deepcopy(args)
    for m in local["models"]:
        m["model"] = str(tmp_path)
    config = load_config(local)
    assert config.models[0].num_replicas == len(args["models"]) * 2
