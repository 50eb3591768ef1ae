"""A Serve app on a local Ray instance with emulated ATOM devices, shared by a module."""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.helpers import free_port
from tests.ray_metrics import FAST_EXPORT

API_KEY = "test-secret"
# vLLM's speculative_config of demo_app's "spec" model (prompt lookup, 4 drafts)
SPEC_NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}
# The LoRA adapters of the app's Qwen2 (build_tiny_adapter's arguments): different ranks,
# disjoint targets
LORA_ADAPTERS = {
    "qwen-a": {"r": 4, "alpha": 8, "targets": ("q_proj", "v_proj"), "seed": 1},
    "qwen-b": {"r": 8, "alpha": 16, "targets": ("o_proj", "gate_proj", "down_proj"), "seed": 2},
}


# A model's engine_kwargs for a replica that drives its device itself (`vllm serve
# --distributed-executor-backend uni`): two processes a model (Serve replica, engine core)
# instead of three (and a Ray worker actor), so an app of many models starts sooner on 2 cores.
IN_PROCESS = {"distributed_executor_backend": "uni"}

# The per-test timeout of modules whose fixture starts an app of many models: pytest's (900 s)
# covers a module fixture's setup in the module's first test, and in one CI run the
# seven-model app, started beside the multi-node tests, came up just as it ran out (all its
# replicas started at once and became ready together: slow, not stuck).
MANY_MODEL_APP_TIMEOUT_S = 1800


# What start_app changed in this process's environment, and the values stop_app puts back.
_saved_env: dict[str, str | None] = {}


@dataclass
class RunningApp:
    url: str
    api_key: str | None
    gcs_address: str
    model_dir: Path
    embed_model_dir: Path | None = None  # the HF directory of the app's embedding model
    vlm_model_dir: Path | None = None  # the HF directory of its vision-language model
    qwen_vl_model_dir: Path | None = None  # ... and of its Qwen2-VL one


def start_app(config: dict, port: int, model_dir: Path, devices: int = 4) -> RunningApp:
    """Start the app on a new local Ray instance whose node has ``devices`` emulated RBLN
    devices (Ray's resource and the emulator agree) and CPUs for a replica on each."""
    import ray
    from ray import serve

    from rbln_ray.serve import APP_NAME, build_app, load_config
    from rbln_ray.serve.proxy_guard import proxy_env

    app_config = load_config(config)
    env = {
        # as `rbln-ray serve` does: the proxy caps request bodies (read when the proxy starts)
        **proxy_env(app_config.limits, app_config.resolved_api_key()),
        "RBLN_RAY_DEVICE": "emulated",
        "RBLN_RAY_EMULATED_DEVICES": str(devices),  # the raylet's workers inherit it
    }
    # restored by stop_app: the next app this process starts (an xdist worker runs several
    # modules) must not inherit this one's API key or limits
    for name in env:
        _saved_env.setdefault(name, os.environ.get(name))
    os.environ.update(env)
    try:
        ray.init(
            address="local",
            # a replica's placement group takes 2 CPUs (the replica, its worker); logical only
            num_cpus=max(8, 2 * devices),
            resources={"RBLN": devices},
            log_to_driver=False,
            # No dashboard (no test of these apps reads Ray's state API) and no idle workers
            # started ahead of the replicas: on a 2-core host beside other tests, every
            # process a start spares is CPU the replicas' vLLM imports get.
            include_dashboard=False,
            _system_config={**FAST_EXPORT, "prestart_worker_first_driver": False},
        )
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(app_config), name=APP_NAME, route_prefix="/")
    except BaseException:
        stop_app()  # the caller's teardown never runs for an app that did not start
        raise
    return RunningApp(
        url=f"http://127.0.0.1:{port}",
        api_key=app_config.api_key,
        gcs_address=ray.get_runtime_context().gcs_address,
        model_dir=model_dir,
    )


def stop_app() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    for name, value in _saved_env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _saved_env.clear()


@pytest.fixture(scope="module")
def demo_app() -> Iterator[RunningApp]:
    """The demo model (compiled, batch 4) with 2 replicas, and beside it (one device each) a
    tiny Qwen2 with two LoRA adapters compiled in (``LORA_ADAPTERS``), a tiny BERT embedding
    model, two tiny vision-language models, a LLaVA and a Qwen2-VL, and the demo model with
    verify graphs decoding speculatively (``SPEC_NGRAM``); an API key."""
    from rbln_ray.compile import CompileSettings, resolve_compiled_dir
    from rbln_ray.models import build_tiny_encoder, build_tiny_model, build_tiny_vlm, demo_model_dir
    from rbln_ray.models.adapters import build_tiny_adapter
    from rbln_ray.models.demo import DEMO_COMPILE
    from tests.helpers import compiled_encoder, compiled_model
    from tests.vision import compiled_vlm
    from tests.vllm_plugin.test_spec_decode import demo_compiled

    hf_dir = demo_model_dir()
    compiled = resolve_compiled_dir(hf_dir, CompileSettings.from_dict(DEMO_COMPILE))
    qwen_hf = build_tiny_model(family="qwen2")
    adapters = {name: str(build_tiny_adapter(qwen_hf, **kw)) for name, kw in LORA_ADAPTERS.items()}
    config = {
        "api_key": API_KEY,
        # a request may resize Qwen2-VL's images (test_an_image_beyond_the_compiled_tower...)
        "limits": {"allowed_mm_processor_kwargs": ["min_pixels", "max_pixels"]},
        "models": [
            # stored Responses API responses: calls about one go to its replica
            {"name": "demo", "model": str(compiled), "num_replicas": 2, "responses_store": True},
            # served with its adapters (each a model of /v1/models), taken from the artifact
            {
                "name": "qwen",
                "model": str(compiled_model("qwen2", lora_modules=adapters)),
                "num_replicas": 1,
            },
            {"name": "embed", "model": str(compiled_encoder()), "num_replicas": 1},
            {"name": "vision", "model": str(compiled_vlm()), "num_replicas": 1},
            # These two run IN_PROCESS: images reaching a Ray worker are LLaVA's (above), and
            # drafts verified by a Ray worker are tests/vllm_plugin/test_spec_decode.py's.
            {
                "name": "qwen-vl",
                "model": str(compiled_vlm("qwen2_vl")),
                "num_replicas": 1,
                "engine_kwargs": dict(IN_PROCESS),
            },
            {
                "name": "spec",
                "model": str(demo_compiled()[1]),  # the demo model with verify graphs (k=4)
                "num_replicas": 1,
                "engine_kwargs": {"speculative_config": SPEC_NGRAM, **IN_PROCESS},
            },
        ],
    }
    app = start_app(config, free_port(), hf_dir, devices=7)
    app.embed_model_dir = build_tiny_encoder()
    app.vlm_model_dir = build_tiny_vlm()
    app.qwen_vl_model_dir = build_tiny_vlm(family="qwen2_vl")
    try:
        yield app
    finally:
        stop_app()


def overload(app: RunningApp, body: dict, headers: dict | None = None) -> list[httpx.Response]:
    """8 copies of one completion at once, then one more after them: every answer is a 200
    with all of ``max_tokens`` or a 429 and both kinds occur (nothing lost, nothing 5xx),
    and the app serves again once they are done. The 429s, for the caller's own checks."""
    url = f"{app.url}/v1/completions"

    def one(_: int) -> httpx.Response:
        return httpx.post(url, json=body, headers=headers, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(one, range(8)))
    codes = sorted(r.status_code for r in responses)
    assert set(codes) == {200, 429}, codes
    for r in responses:
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == body["max_tokens"]
    after = one(0)
    assert after.status_code == 200, after.text
    return [r for r in responses if r.status_code == 429]
