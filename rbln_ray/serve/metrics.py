"""``/metrics``: vLLM's engine metrics plus per-device RBLN counters, from every replica.

Why a hub: each replica's vLLM metrics live in that replica's process (prometheus_client's
registry) and Serve routes a handle call to one replica only, so nothing can ask "all
replicas". Instead every server replica pushes its exposition text to a one-replica
``MetricsHub`` deployment every few seconds; the ingress renders the hub's merged view, each
sample labelled with the replica it came from. Entries of replicas that stopped pushing expire.
"""

from __future__ import annotations

import re
import time
from typing import Any

PUSH_PERIOD_S = 2.0
EXPIRE_AFTER_S = 15.0


def device_metrics_text(model: str, stats: list[dict[str, Any]], workers: list[dict]) -> str:
    """Prometheus text for the RBLN workers of one engine (one stats dict per worker)."""
    counters = {
        "rbln_prefill_steps_total": ("prefill_steps", "Prefill calls on the device"),
        "rbln_decode_steps_total": ("decode_steps", "Decode calls on the device"),
        "rbln_decode_rows_total": ("decode_rows", "Live rows in decode calls"),
        "rbln_padded_rows_total": ("padded_rows", "Padding rows in decode calls"),
        "rbln_device_seconds_total": ("device_seconds", "Seconds inside rebel.Runtime calls"),
    }
    gauges = {
        "rbln_slots_in_use": ("slots_in_use", "Requests holding a compiled batch slot"),
        "rbln_batch_size": ("batch_size", "Compiled batch size (slots)"),
    }
    lines: list[str] = []
    for kind, table in (("counter", counters), ("gauge", gauges)):
        for name, (key, help_text) in table.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            for stat, worker in zip(stats, workers, strict=True):
                labels = (
                    f'model="{model}",node="{worker.get("node") or ""}",'
                    f'devices="{worker.get("rbln_devices") or ""}"'
                )
                lines.append(f"{name}{{{labels}}} {float(stat.get(key, 0))}")
    return "\n".join(lines) + "\n"


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?(\s.*)$")


def with_label(text: str, label: str, value: str) -> str:
    """Add ``label="value"`` to every sample line of a Prometheus text exposition."""
    out = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if line.startswith("#") or match is None:
            out.append(line)
            continue
        name, labels, rest = match.groups()
        merged = f'{label}="{value}"' + (f",{labels}" if labels else "")
        out.append(f"{name}{{{merged}}}{rest}")
    return "\n".join(out)


def merge(texts: dict[str, str]) -> str:
    """Merge per-replica expositions, keeping one HELP/TYPE header per metric family."""
    seen: set[str] = set()
    families: dict[str, list[str]] = {}
    order: list[str] = []
    for replica, text in sorted(texts.items()):
        current = None
        for line in with_label(text, "replica", replica).splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                current = line.split(" ")[2]
                if current not in families:
                    families[current] = []
                    order.append(current)
                if line not in seen:
                    seen.add(line)
                    families[current].append(line)
            elif line and current is not None:
                families[current].append(line)
    return "\n".join(line for name in order for line in families[name]) + "\n"


class MetricsHub:
    """One-replica deployment holding the latest exposition text of each server replica."""

    def __init__(self) -> None:
        from rbln_ray.serve.replica_bind import bind_replica_grpc_to_loopback

        bind_replica_grpc_to_loopback()
        self._texts: dict[str, tuple[float, str]] = {}

    def push(self, replica: str, text: str) -> None:
        self._texts[replica] = (time.monotonic(), text)

    def render(self) -> str:
        now = time.monotonic()
        live = {r: t for r, (at, t) in self._texts.items() if now - at < EXPIRE_AFTER_S}
        self._texts = {r: v for r, v in self._texts.items() if r in live}
        return merge(live)
