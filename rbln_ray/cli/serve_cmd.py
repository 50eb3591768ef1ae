"""``rbln-ray serve``: run the Serve app, by default the embedded demo on emulated devices."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from rbln_ray.serve.config import DEMO_MODEL, AppConfig, embedded_default, load_config

logger = logging.getLogger("rbln_ray.cli")

# The demo model's compile settings: batch 4 with smaller decode graphs for light load.
DEMO_COMPILE = {"batch_size": 4, "max_seq_len": 1024, "decoder_batch_sizes": (4, 2, 1)}


def prepare_models(config: AppConfig) -> AppConfig:
    """Train/compile in the foreground (with progress) so replicas start from artifacts."""
    from rbln_ray.compile import CompileSettings, resolve_compiled_dir
    from rbln_ray.models import demo_model_dir

    models = []
    for m in config.models:
        path, settings = m.model, m.compile
        if path == DEMO_MODEL:
            path, settings = str(demo_model_dir()), {**DEMO_COMPILE, **m.compile}
        compiled = resolve_compiled_dir(path, CompileSettings.from_dict(settings))
        models.append(m.model_copy(update={"model": str(compiled), "compile": {}}))
    return config.model_copy(update={"models": models})


def start_ray(address: str | None, emulated: bool) -> None:
    """Join ``address`` (or ``RAY_ADDRESS``), else start a local instance with the devices."""
    import ray

    from rbln_ray.emulator.devices import physical_count

    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
        return
    resources = {"RBLN": physical_count()} if emulated else None
    # Bundle CPUs are accounting, not cores: give the local instance room for the replicas.
    ray.init(address="local", num_cpus=max(8, os.cpu_count() or 1), resources=resources)


def run(args: argparse.Namespace) -> int:
    from ray import serve

    from rbln_ray.cli.runtime_choice import choose_runtime
    from rbln_ray.serve import APP_NAME, build_app

    runtime = choose_runtime()
    config = load_config(args.config) if args.config else embedded_default()
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    if args.api_key:
        overrides["api_key"] = args.api_key
    config = prepare_models(config.model_copy(update=overrides))
    start_ray(args.address, emulated=runtime == "emulated")
    serve.start(http_options={"host": config.host, "port": config.port})
    logger.info("starting %d model(s): %s", len(config.models), [m.name for m in config.models])
    serve.run(build_app(config), name=APP_NAME, route_prefix="/", blocking=False)
    url = f"http://{config.host}:{config.port}"
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
    serve.shutdown()
    import ray

    ray.shutdown()
    return 0
