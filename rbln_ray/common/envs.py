"""Every ``RBLN_RAY_*`` environment variable, declared once: name, type, default and meaning.

Why one registry (like ``vllm/envs.py``): a variable read ad hoc in several modules drifts
(two defaults, two spellings, no docs). Values are read when asked for, not at import, because
tests and the CLI set some of them (``RBLN_RAY_DEVICE``) after ``rbln_ray`` is imported and
child processes (vLLM's engine core, Ray actors) inherit them through the environment.

Use ``envs.get("RBLN_RAY_DEVICE")`` or ``envs.RBLN_RAY_DEVICE``; ``envs.NAMES`` lists them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EnvVar:
    """One declared variable; ``parse`` turns its non-empty text into the typed value."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str


def _positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise ValueError("must be a positive integer")
    return value


def _lower(raw: str) -> str:
    return raw.strip().lower()


def _upper(raw: str) -> str:
    return raw.strip().upper()


_VARS = (
    EnvVar("RBLN_RAY_DEVICE", _lower, "auto",
           "which rebel runtime: auto (real rebel if importable), emulated (the CPU emulator), "
           "rbln (demand the real runtime)"),
    EnvVar("RBLN_RAY_CACHE", str, None,
           "root of rbln-ray's cache (compiled artifacts, models, device locks); default "
           "$XDG_CACHE_HOME/rbln-ray or ~/.cache/rbln-ray"),
    EnvVar("RBLN_RAY_LOG_LEVEL", _upper, "INFO", "level of the rbln_ray logger"),
    EnvVar("RBLN_RAY_NODE_ID", str, None,
           "node the emulated devices belong to when Ray is not initialised (set in actors)"),
    EnvVar("RBLN_RAY_REPLICA", str, None,
           "Serve replica an engine serves (set by the replica, forwarded to its workers): "
           "the replica tag of their device metrics"),
    EnvVar("RBLN_RAY_EMULATED_DEVICES", _positive_int, 4, "emulated RBLN devices per node"),
    EnvVar("RBLN_RAY_EMULATED_NPU", str, None,
           "kind of the emulated devices: atom / rebel or an NPU name (default ATOM)"),
    EnvVar("RBLN_RAY_EMULATOR_THREADS", _positive_int, None,
           "torch threads for one emulated device call (default: leave torch's setting)"),
    EnvVar("RBLN_RAY_EMULATOR_MODE", _lower, "compute",
           "compute (real results, CPU speed), timing (zero results, modelled device time) or "
           "modelled (real results, then the rest of the modelled device time)"),
    EnvVar("RBLN_RAY_TIMING_SHAPE", str, None,
           "timing/modelled mode: the model shape to cost (a preset name, an HF config.json "
           "path or JSON), or per compiled directory '<dir>=<shape>;<dir>=<shape>'"),
    EnvVar("RBLN_RAY_TIMING_PEAK_TFLOPS", float, None, "timing mode: device peak TFLOPS"),
    EnvVar("RBLN_RAY_TIMING_DRAM_GBPS", float, None, "timing mode: device DRAM GB/s"),
    EnvVar("RBLN_RAY_TIMING_COMPUTE_EFF", float, None, "timing mode: achieved compute share"),
    EnvVar("RBLN_RAY_TIMING_DRAM_EFF", float, None, "timing mode: achieved DRAM share"),
    EnvVar("RBLN_RAY_TIMING_CALL_US", float, None, "timing mode: fixed cost of one call, us"),
    EnvVar("RBLN_RAY_TIMING_TP_EFF", float, None,
           "timing mode: tensor-parallel efficiency over several devices"),
    EnvVar("RBLN_RAY_TIMING_SYNC_US", float, None,
           "timing mode: per-layer synchronisation cost across devices, us"),
    EnvVar("RBLN_RAY_TIMING_NETWORK_GBITS", float, None,
           "timing mode: node-to-node network, Gbit/s (KV handed between nodes)"),
    # Serve's HTTP proxies' guard (rbln_ray.serve.proxy_guard): the Serve config's `limits`,
    # handed to the proxies; typed, bounded and defaulted there (RequestLimits).
    EnvVar("RBLN_RAY_MAX_REQUEST_BYTES", str, None, "proxy guard: limits.max_request_bytes"),
    EnvVar("RBLN_RAY_BODY_READ_TIMEOUT_S", str, None, "proxy guard: limits.body_read_timeout_s"),
    EnvVar("RBLN_RAY_MAX_PENDING_BODIES", str, None, "proxy guard: limits.max_pending_bodies"),
    EnvVar("RBLN_RAY_MAX_PENDING_BODIES_PER_CLIENT", str, None,
           "proxy guard: limits.max_pending_bodies_per_client"),
    EnvVar("RBLN_RAY_MAX_REQUESTS_PER_CLIENT", str, None,
           "proxy guard: limits.max_requests_per_client"),
    EnvVar("RBLN_RAY_API_KEY_SHA256", str, None,
           "proxy guard: SHA-256 of the app's API key (requests without it get a 401 before "
           "their body is read)"),
    EnvVar("RBLN_RAY_TEST_STEP_FAULT", int, None,
           "tests only: a token id; a prefill whose tokens hold it raises in the worker, as a "
           "device call that fails would (fault injection, like vLLM's test_forward_error)"),
)  # fmt: skip
REGISTRY: dict[str, EnvVar] = {var.name: var for var in _VARS}
NAMES: tuple[str, ...] = tuple(REGISTRY)
# What a worker actor needs to pick the same runtime as its driver. Not the device kind:
# that belongs to the node (its raylet's environment), and a REBEL node may serve an ATOM driver.
FORWARDED: tuple[str, ...] = (
    "RBLN_RAY_DEVICE",
    "RBLN_RAY_EMULATED_DEVICES",
    "RBLN_RAY_CACHE",
    "RBLN_RAY_REPLICA",
)


class EnvError(ValueError):
    """A declared variable holds a value its type rejects."""


def get(name: str, environ: dict[str, str] | None = None) -> Any:
    """The typed value of ``name`` (its default when unset or empty)."""
    var = REGISTRY[name]
    raw = (os.environ if environ is None else environ).get(name, "")
    if not raw.strip():
        return var.default
    try:
        return var.parse(raw)
    except ValueError as e:
        raise EnvError(f"{name}={raw!r}: {e} ({var.doc})") from None


def is_set(name: str) -> bool:
    """Whether the user (or a parent process) chose a value for declared ``name``."""
    return bool(os.environ.get(REGISTRY[name].name, "").strip())


def export(name: str, value: Any) -> None:
    """Set declared ``name`` for this process and every process it starts (validated)."""
    var = REGISTRY[name]
    text = str(value)
    try:
        var.parse(text)
    except ValueError as e:
        raise EnvError(f"{name}={text!r}: {e} ({var.doc})") from None
    os.environ[name] = text


def __getattr__(name: str) -> Any:
    if name in REGISTRY:
        return get(name)
    raise AttributeError(name)
