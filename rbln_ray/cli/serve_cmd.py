"""``rbln-ray serve``: run the Serve app, by default the embedded demo on emulated devices."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from rbln_ray.serve.config import AppConfig, embedded_default, load_config

logger = logging.getLogger("rbln_ray.cli")

PROBE_TIMEOUT_S = 120.0


def prepare_models(config: AppConfig) -> AppConfig:
    """Train/compile in the foreground (with progress) so replicas start from artifacts."""
    from rbln_ray.compile import CompileSettings, resolve_compiled_dir
    from rbln_ray.models.demo import resolve_model

    models = []
    for m in config.models:
        path, settings = resolve_model(m.model, m.compile)
        compiled = resolve_compiled_dir(path, settings)
        models.append(m.model_copy(update={"model": str(compiled), "compile": CompileSettings()}))
    return config.model_copy(update={"models": models})


def start_ray(address: str | None, emulated: bool, metrics_port: int, config: AppConfig) -> None:
    """Join ``address`` (or ``RAY_ADDRESS``), else start a local instance with the devices,
    closed to the network (:mod:`rbln_ray.serve.local_ray`), exporting its metrics for
    Prometheus on ``127.0.0.1:metrics_port``."""
    import ray

    from rbln_ray.emulator.devices import physical_count
    from rbln_ray.serve.local_ray import record_embedded, start_loopback_ray
    from rbln_ray.serve.proxy_guard import proxy_env

    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
        return
    resources = {"RBLN": physical_count()} if emulated else None
    # Serve's proxies (started by this instance) guard request bodies themselves
    os.environ.update(proxy_env(config.limits, config.resolved_api_key()))
    # Bundle CPUs are accounting, not cores: give the local instance room for the replicas.
    start_loopback_ray(
        num_cpus=max(8, os.cpu_count() or 1), resources=resources, metrics_port=metrics_port
    )
    record_embedded(ray.get_runtime_context().gcs_address)


def probe_http_path(config: AppConfig) -> None:
    """One tiny completion per model through the HTTP proxy before ``ready`` is printed.

    Why: the replicas warmed themselves up (:mod:`rbln_ray.serve.warmup`) and the ingress its
    request path, but the proxy's route to the ingress and the ingress's handles to the
    models are set up on their first request; this way that is not the user's.
    """
    import httpx

    key = config.resolved_api_key()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
    for m in config.models:
        body = {"model": m.name, "prompt": "Hello", "max_tokens": 1}
        try:
            r = httpx.post(
                f"http://{host}:{config.port}/v1/completions",
                json=body,
                headers=headers,
                timeout=PROBE_TIMEOUT_S,
            )
            ok = r.status_code == 200
        except httpx.HTTPError as exc:
            ok, r = False, exc
        if not ok:
            logger.warning("model %s: the HTTP probe before ready failed: %s", m.name, r)


def run(args: argparse.Namespace) -> int:
    from ray import serve

    from rbln_ray.cli.runtime_choice import choose_runtime
    from rbln_ray.common import envs
    from rbln_ray.common.logging_setup import LEVEL_ENV
    from rbln_ray.serve import APP_NAME, build_app

    runtime = choose_runtime()
    config = load_config(args.config) if args.config else embedded_default()
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    if args.api_key or args.api_key_file:  # the command line's source replaces the config's
        overrides.update(api_key=args.api_key, api_key_env=None, api_key_file=args.api_key_file)
    config = prepare_models(config.model_copy(update=overrides))
    start_ray(
        args.address,
        emulated=runtime == "emulated",
        metrics_port=args.metrics_port,
        config=config,
    )
    serve.start(http_options={"host": config.host, "port": config.port})
    logger.info("starting %d model(s): %s", len(config.models), [m.name for m in config.models])
    level = envs.get(LEVEL_ENV)
    serve.run(
        build_app(config),
        name=APP_NAME,
        route_prefix="/",
        blocking=False,
        logging_config={"log_level": level},
    )
    url = f"http://{config.host}:{config.port}"
    probe_http_path(config)
    print(f"rbln-ray is ready: {url}/v1 (models: {', '.join(m.name for m in config.models)})")
    print(
        f"  try: curl {url}/v1/completions -H 'Content-Type: application/json' "
        f'-d \'{{"model": "{config.models[0].name}", "prompt": "def main(", '
        '"max_tokens": 32}\'',
        flush=True,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):  # a timed wait lets Python run the signal handler promptly
        pass
    print("shutting down rbln-ray ...", flush=True)
    from rbln_ray.serve.local_ray import forget_embedded

    forget_embedded()
    serve.shutdown()
    import ray

    ray.shutdown()
    return 0
