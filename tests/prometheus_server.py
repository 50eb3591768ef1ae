"""A real Prometheus server (Debian's, unpacked into the venv by ``make setup``) for a test:
its own config, data dir and loopback port; stopped by PID afterwards."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.helpers import ROOT, free_port

BINARY = Path(sys.executable).parent / "prometheus"  # `make setup` puts it in the venv
SHIPPED_CONFIG = ROOT / "cluster_configs" / "prometheus.yml"
START_TIMEOUT_S = 60


class Prometheus:
    """Query access to a running server (its HTTP API)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def api(self, path: str, **params: Any) -> Any:
        body = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30).json()
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query's vector: ``[{"metric": {...}, "value": [t, "v"]}, ...]``."""
        return self.api("query", query=expr)["result"]

    def names(self) -> set[str]:
        return set(self.api("label/__name__/values"))


def embedded_job(target: str, interval_s: float) -> dict:
    """The shipped scrape config's job for the embedded default, aimed at ``target``."""
    shipped = yaml.safe_load(SHIPPED_CONFIG.read_text())
    job = next(j for j in shipped["scrape_configs"] if j["job_name"] == "rbln-ray-embedded")
    job = {**job, "static_configs": [{"targets": [target]}]}
    return {"global": {"scrape_interval": f"{interval_s}s"}, "scrape_configs": [job]}


@contextmanager
def prometheus_server(config: dict, workdir: Path) -> Iterator[Prometheus]:
    assert BINARY.is_file(), f"{BINARY} is missing: `make setup` unpacks Debian's prometheus"
    port = free_port()
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = (workdir / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            str(BINARY),
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    server = Prometheus(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, (workdir / "prometheus.log").read_text()[-3000:]
            try:
                if httpx.get(f"{server.url}/-/ready", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "Prometheus did not become ready"
            time.sleep(0.5)  # polling its readiness endpoint
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
