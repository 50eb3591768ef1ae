"""Adversarial clients for the chaos soak (``benchmarks.chaos_soak --adversaries``).

Each kind comes from a loopback address of its own (127.0.0.2 and up: Linux routes all of
127/8 to this host), as distinct attackers would, while the soak's ordinary clients use
127.0.0.1:

* ``template_bomb`` (127.0.0.2): chat requests carrying a client-written chat template that
  would loop 10^10 times (``chat_template_kwargs.chat_template``, and the top-level
  ``chat_template``), the request that stalled the cache-aware app;
* ``slow_body`` (127.0.0.3): connections that send headers declaring a 500 kB body, 64 KiB of
  it, then nothing (a new one when the server closes one, after ``SLOW_BODY_PAUSE_S``);
* ``fan_out`` (127.0.0.4): one over-limit request for every route, body shape and limited
  field of vLLM's route table (``tests/route_limits.py``), in turn: ``n`` and ``best_of``
  past ``limits.max_n``, ``max_tokens`` past the cap, more prompts than
  ``limits.max_prompts``, JSON bodies and audio uploads alike.

Each kind runs ``concurrency`` loops (``KINDS``), every request paced by ``PAUSE_S``: the
attackers' rates are part of the result. Each outcome is counted by kind and HTTP status.
Run in a process of its own (:func:`run`), so the attackers' own CPU is not the ordinary
clients' event loop.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import time
from collections import Counter
from typing import Any

# kind -> (source address, concurrent loops)
KINDS = {"template_bomb": ("127.0.0.2", 8), "slow_body": ("127.0.0.3", 200),
         "fan_out": ("127.0.0.4", 4)}  # fmt: skip
PAUSE_S = 0.2  # between one loop's requests
SLOW_BODY_PAUSE_S = 1.0  # before a slow-body loop opens a new connection
BOMB = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}x"


def bomb_bodies(model: str) -> list[dict[str, Any]]:
    messages = [{"role": "user", "content": "hello"}]
    return [
        {"model": model, "messages": messages, "max_tokens": 4,
         "chat_template_kwargs": {"chat_template": BOMB}},
        {"model": model, "messages": messages, "max_tokens": 4, "chat_template": BOMB},
    ]  # fmt: skip


async def _http_loop(
    url: str, source: str, requests: list[tuple[str, dict, bool]], stop: Any, counts: Counter
) -> None:
    import httpx

    from rbln_ray.models.speech import tone_clip, wav_bytes

    wav = wav_bytes(tone_clip(0.5, 440))
    transport = httpx.AsyncHTTPTransport(local_address=source)
    async with httpx.AsyncClient(transport=transport, timeout=60) as client:
        i = 0
        while not stop.is_set():
            path, body, form = requests[i % len(requests)]
            i += 1
            try:
                if form:
                    data = {k: v if isinstance(v, str) else json.dumps(v) for k, v in body.items()}
                    r = await client.post(f"{url}{path}", data=data,
                                          files={"file": ("a.wav", wav, "audio/wav")})  # fmt: skip
                else:
                    r = await client.post(f"{url}{path}", json=body)
                counts[str(r.status_code)] += 1
            except httpx.HTTPError as exc:
                counts[type(exc).__name__] += 1
            await asyncio.sleep(PAUSE_S)


async def _slow_body_loop(host: str, port: int, source: str, stop: Any, counts: Counter) -> None:
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
            "\r\nContent-Length: 500000\r\n\r\n").encode()  # fmt: skip
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
        except OSError as exc:
            counts[type(exc).__name__] += 1
            await asyncio.sleep(SLOW_BODY_PAUSE_S)
            continue
        try:
            writer.write(head + b"{" + b" " * (64 * 1024 - 1))
            await writer.drain()
            answer = await reader.read(64)  # the server's answer, or b"" when it closes
            status = answer.split(b" ")[1].decode() if answer.startswith(b"HTTP/") else "closed"
            counts[status] += 1
        except OSError as exc:
            counts[type(exc).__name__] += 1
        finally:
            writer.close()
        await asyncio.sleep(SLOW_BODY_PAUSE_S)


async def _attack(url: str, model: str, stop: Any, shared: dict) -> None:
    from rbln_ray.serve.config import RequestLimits
    from tests.route_limits import limit_cases

    host, port = url.removeprefix("http://").split(":")
    counts = {kind: Counter() for kind in KINDS}
    fan_out = [(c.path, c.body, c.form) for c in limit_cases(RequestLimits(), model)]
    bombs = [("/v1/chat/completions", b, False) for b in bomb_bodies(model)]
    loops = []
    for kind, (source, n) in KINDS.items():
        for _ in range(n):
            if kind == "slow_body":
                loops.append(_slow_body_loop(host, int(port), source, stop, counts[kind]))
            else:
                work = bombs if kind == "template_bomb" else fan_out
                loops.append(_http_loop(url, source, work, stop, counts[kind]))

    async def report() -> None:
        while not stop.is_set():
            shared.update({k: dict(v) for k, v in counts.items()})
            await asyncio.sleep(1.0)

    await asyncio.gather(report(), *loops)
    shared.update({k: dict(v) for k, v in counts.items()})


def _main(url: str, model: str, stop: Any, shared: dict) -> None:
    asyncio.run(_attack(url, model, stop, shared))


class Adversaries:
    """The attackers, in a process of their own: :meth:`start`, then :meth:`stop`, which
    returns the outcome counts by kind and status."""

    def __init__(self, url: str, model: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._manager = ctx.Manager()
        self._stop = self._manager.Event()
        self._counts = self._manager.dict()
        self._process = ctx.Process(target=_main, args=(url, model, self._stop, self._counts),
                                    daemon=True)  # fmt: skip
        self.started_at: float | None = None

    def start(self) -> None:
        self._process.start()
        self.started_at = time.monotonic()

    def counts(self) -> dict[str, dict[str, int]]:
        return dict(self._counts)

    def stop(self) -> dict[str, dict[str, int]]:
        self._stop.set()
        self._process.join(timeout=120)
        if self._process.is_alive():
            self._process.kill()  # by handle: the process this object started
        counts = self.counts()
        self._manager.shutdown()
        return counts
