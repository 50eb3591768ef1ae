"""`rbln-ray serve` with no arguments: the embedded default, as a newcomer starts it.

One process for the module (it takes a minute or two to start on 2 cores); the tests run in
file order: the cold-start check needs the first requests after ``ready``, and the last test
stops it with Ctrl-C.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import statistics
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from tests.helpers import ROOT
from tests.serve.conftest import free_port

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 600


@dataclass
class ServeProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def log(self) -> str:
        return self.log_path.read_text()


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {k: v for k, v in os.environ.items() if k not in ("RBLN_RAY_DEVICE", "RAY_ADDRESS")}
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [str(ROOT / ".venv" / "bin" / "rbln-ray"), "serve", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    running = ServeProcess(proc, port, log_path)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "rbln-ray is ready" not in running.log:
            assert proc.poll() is None, running.log[-4000:]
            assert time.monotonic() < deadline, "no ready message"
            time.sleep(1)  # polling the log for the ready line
        yield running
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_first_request_after_ready_is_not_cold(embedded: ServeProcess) -> None:
    """Acceptance (issue 18): the first request after ``ready`` takes at most 3 x the median
    of the next five (before: 14.4 s vs 0.19 s)."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{embedded.port}/v1", api_key="none")
    seconds = []
    for _ in range(6):
        started = time.perf_counter()
        out = client.completions.create(  # the model's default sampling, 32 tokens each
            model="demo", prompt="def main(", max_tokens=32, extra_body={"ignore_eos": True}
        )
        seconds.append(time.perf_counter() - started)
        assert out.choices[0].text and out.usage.completion_tokens == 32
    first, rest = seconds[0], statistics.median(seconds[1:])
    print(f"first request {first:.2f} s, median of the next five {rest:.2f} s: {seconds}")
    assert first <= 3 * rest, seconds


def test_answers_curl_as_printed(embedded: ServeProcess) -> None:
    text = embedded.log
    assert "using emulated ATOM devices" in text
    assert f"http://127.0.0.1:{embedded.port}/v1" in text
    curl = subprocess.run(
        [
            "curl",
            "-s",
            "-f",
            f"http://127.0.0.1:{embedded.port}/v1/completions",
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


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def test_every_socket_of_the_process_tree_is_on_loopback(embedded: ServeProcess) -> None:
    """Acceptance (issue 18): no listening TCP socket, and no bound UDP socket, of any process
    the embedded default started (GCS, raylet, dashboard and agents, core workers of the
    driver and every actor, Serve's proxy and replicas, vLLM's engine cores) is on a
    non-loopback address (wildcards ``0.0.0.0`` / ``::`` included)."""
    root = psutil.Process(embedded.proc.pid)
    seen: list[tuple[int, str, str, int]] = []
    exposed = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            name = proc.name()
            conns = proc.net_connections(kind="inet")
        except psutil.Error:
            continue  # a process that ended meanwhile has no sockets left
        for c in conns:
            listening = c.status == psutil.CONN_LISTEN or (c.type == 2 and c.laddr)
            if not listening:
                continue
            entry = (proc.pid, name, c.laddr.ip, c.laddr.port)
            seen.append(entry)
            if not is_loopback(c.laddr.ip):
                exposed.append(entry)
    names = {name for _, name, _, _ in seen}
    # The tree really was inspected: Ray's daemons, Serve and vLLM all hold sockets.
    assert {"gcs_server", "raylet"} <= names and any("EngineCore" in n for n in names), names
    print(f"{len(seen)} sockets in {len(names)} kinds of process, all on loopback")
    for pid, name, ip, port in sorted(seen, key=lambda e: (e[1], e[3])):
        print(f"  {name:<40} pid {pid:<8} {ip}:{port}")
    assert not exposed, exposed


def test_log_is_quiet_at_info(embedded: ServeProcess) -> None:
    """No line per metrics push or health check; optimum's rebel-compiler ImportWarning and
    the tokenizers fork warning are gone (issue 18)."""
    push_period_s = 2.0
    before = embedded.log.count("\n")
    deadline = time.monotonic() + 5 * push_period_s
    while time.monotonic() < deadline:  # five push periods of an idle app
        time.sleep(push_period_s)  # waiting for log lines that must not appear
    idle = embedded.log.splitlines()[before:]
    text = embedded.log
    assert "CALL push" not in text and "check_health" not in text
    assert "requires rebel-compiler" not in text
    assert "TOKENIZERS_PARALLELISM" not in text
    assert len(idle) <= 2, idle


def test_ctrl_c_stops_it(embedded: ServeProcess) -> None:
    embedded.proc.send_signal(signal.SIGINT)
    code = embedded.proc.wait(timeout=120)
    assert code == 0, embedded.log[-3000:]
    assert "shutting down" in embedded.log
