"""The cluster launch files: `ray up` configs, the Serve config and the KubeRay RayService."""

from __future__ import annotations

import copy
import importlib
import json
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "cluster_configs"
RAY_UP = sorted(CONFIGS.glob("ray-up-*.yaml"))
SERVE_CONFIG = CONFIGS / "serve_config.yaml"
RAYSERVICE = CONFIGS / "kuberay-rayservice.yaml"


def ray_validate(config: dict) -> dict:
    """What `ray up` does with a config before touching any host."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def test_both_ray_up_configs_exist():
    assert {p.name for p in RAY_UP} == {"ray-up-atom.yaml", "ray-up-emulated.yaml"}


@pytest.mark.parametrize("path", RAY_UP, ids=lambda p: p.name)
def test_ray_up_config_passes_rays_validation(path: Path):
    config = yaml.safe_load(path.read_text())
    prepared = ray_validate(config)
    assert prepared["provider"]["type"] == "local"
    assert len(prepared["provider"]["worker_ips"]) >= 2
    head = " ".join(prepared["head_start_ray_commands"])
    workers = " ".join(prepared["worker_start_ray_commands"])
    # Dashboard (and Serve's REST API) on loopback; token auth on; GCS on the given address.
    assert "--dashboard-host=127.0.0.1" in head
    assert f"--node-ip-address={config['provider']['head_ip']}" in head
    assert "RAY_AUTH_MODE=token" in head and "RAY_AUTH_MODE=token" in workers
    assert "0.0.0.0" not in head + workers
    setup = " ".join(prepared["worker_setup_commands"])
    if "emulated" in path.name:
        assert "RBLN_RAY_DEVICE=emulated" in head and "RBLN_RAY_DEVICE=emulated" in workers
        assert """--resources='{"RBLN": 2}'""" in workers
        assert "[rbln]" not in setup
    else:
        assert "[rbln]" in setup and "pypi.rbln.ai" in setup


@pytest.mark.parametrize("path", RAY_UP, ids=lambda p: p.name)
@pytest.mark.parametrize(
    "breakage",
    ["unknown_top_level_field", "provider_without_head_ip", "commands_not_a_list"],
)
def test_broken_ray_up_config_fails_validation(path: Path, breakage: str):
    import click
    import jsonschema

    config = yaml.safe_load(path.read_text())
    expected: type[Exception] = jsonschema.ValidationError
    if breakage == "unknown_top_level_field":
        config["head_start_ray_comands"] = ["ray start --head"]  # a typo'd key
    elif breakage == "provider_without_head_ip":
        del config["provider"]["head_ip"]
        expected = click.ClickException  # the local provider's own abort
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
    (workers,) = cluster["workerGroupSpecs"]

    # Workers ask Kubernetes for ATOMs and tell Ray the same count as RBLN.
    (container,) = workers["template"]["spec"]["containers"]
    atoms = int(container["resources"]["limits"]["rebellions.ai/ATOM"])
    assert int(container["resources"]["requests"]["rebellions.ai/ATOM"]) == atoms
    # KubeRay passes rayStartParams to `ray start` through a shell: a quoted JSON string.
    worker_res = json.loads(json.loads(workers["rayStartParams"]["resources"]))
    assert worker_res == {"RBLN": atoms}
    assert json.loads(json.loads(head["rayStartParams"]["resources"])) == {"RBLN": 0}

    serve_doc = yaml.safe_load(doc["spec"]["serveConfigV2"])
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
