"""`rbln-ray serve` with no arguments: the embedded default answers a completion."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import ROOT
from tests.serve.conftest import free_port

pytestmark = pytest.mark.slow


def test_embedded_default_serves_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    port = free_port()
    log_path = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k not in ("RBLN_RAY_DEVICE", "RAY_ADDRESS")}
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [str(ROOT / ".venv" / "bin" / "rbln-ray"), "serve", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            deadline = time.monotonic() + 600
            while "rbln-ray is ready" not in log_path.read_text():
                assert proc.poll() is None, log_path.read_text()[-4000:]
                assert time.monotonic() < deadline, "no ready message"
                time.sleep(1)  # polling the log for the ready line
            text = log_path.read_text()
            assert "using emulated ATOM devices" in text
            assert f"http://127.0.0.1:{port}/v1" in text
            curl = subprocess.run(
                [
                    "curl",
                    "-s",
                    "-f",
                    f"http://127.0.0.1:{port}/v1/completions",
                    "-H",
                    "Content-Type: application/json",
                    "-d",
                    '{"model": "demo", "prompt": "def main(", "max_tokens": 16}',
                ],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert curl.returncode == 0, curl.stderr
            body = httpx.Response(200, content=curl.stdout).json()
            assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] == 16
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                code = proc.wait(timeout=120)
            finally:
                if proc.poll() is None:
                    proc.kill()
    assert code == 0, log_path.read_text()[-3000:]
    assert "shutting down" in log_path.read_text()
