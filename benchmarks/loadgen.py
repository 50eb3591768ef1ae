"""A small async load generator for OpenAI-compatible servers (vllm bench serve conventions).

Streams ``/v1/completions`` with token-id prompts, ``ignore_eos`` and a fixed ``max_tokens``
from ``concurrency`` workers (closed loop; or Poisson arrivals at ``request_rate``).
Metrics per request, as ``vllm bench serve`` defines them:
- TTFT: send -> first streamed token; ITL: gaps between streamed tokens;
- TPOT: (latency - TTFT) / (output tokens - 1), requests with more than one output token;
- E2E latency; throughput = completed requests (output tokens) / benchmark duration.
Requests are bounded in number and each has a timeout; targets must be local addresses.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from benchmarks.common import summary


def aggregate(records: list[dict[str, Any]], elapsed: float) -> dict[str, Any]:
    """Latency/throughput summary from ``{"sent", "stamps", "output_tokens"}`` records."""
    ok = [r for r in records if r.get("stamps") and not r.get("error")]
    ttft = [r["stamps"][0] - r["sent"] for r in ok]
    e2e = [r["stamps"][-1] - r["sent"] for r in ok]
    tpot = [
        (r["stamps"][-1] - r["stamps"][0]) / (r["output_tokens"] - 1)
        for r in ok
        if r["output_tokens"] > 1
    ]
    itl = [b - a for r in ok for a, b in zip(r["stamps"], r["stamps"][1:], strict=False)]
    out_tokens = sum(r["output_tokens"] for r in ok)
    return {
        "elapsed_s": elapsed,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "output_tokens": out_tokens,
        "req_per_s": len(ok) / elapsed,
        "output_tok_per_s": out_tokens / elapsed,
        "ttft_ms": summary(ttft, 1e3),
        "tpot_ms": summary(tpot, 1e3),
        "itl_ms": summary(itl, 1e3),
        "e2e_ms": summary(e2e, 1e3),
        "errors": sorted({r["error"] for r in records if r.get("error")})[:5],
    }


def completion_body(model: str, prompt: list[int], output_len: int) -> dict[str, Any]:
    """The streamed completion every load sends: token ids, greedy, exactly ``output_len``."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


class StreamRecord:
    """One request's record for :func:`aggregate`, built from its SSE data lines as they
    arrive (the first stamp is the first token's, the usage gives the output tokens)."""

    def __init__(self) -> None:
        self.sent = time.perf_counter()
        self.stamps: list[float] = []
        self.usage_tokens: int | None = None

    def line(self, line: str | bytes) -> None:
        text = line.decode() if isinstance(line, bytes) else line
        if not text.startswith("data: ") or text == "data: [DONE]":
            return
        chunk = json.loads(text[6:])
        if chunk.get("usage"):
            self.usage_tokens = chunk["usage"].get("completion_tokens")
        if chunk.get("choices"):
            self.stamps.append(time.perf_counter())

    def done(self) -> dict[str, Any]:
        tokens = self.usage_tokens or len(self.stamps)
        return {"sent": self.sent, "stamps": self.stamps, "output_tokens": tokens}

    def failed(self, error: str) -> dict[str, Any]:
        return {"sent": self.sent, "stamps": [], "output_tokens": 0, "error": error}


async def _one(client, url: str, body: dict, headers: dict, timeout: float) -> dict:
    record = StreamRecord()
    try:
        async with client.stream("POST", url, json=body, headers=headers, timeout=timeout) as resp:
            if resp.status_code != 200:
                return record.failed((await resp.aread()).decode()[:200])
            async for line in resp.aiter_lines():
                record.line(line)
    except Exception as exc:  # noqa: BLE001 - a failed request is a data point
        return record.failed(repr(exc)[:200])
    return record.done()


async def closed_loop(
    one: Callable[[list[int]], Awaitable[dict[str, Any]]],
    prompts: list[list[int]],
    concurrency: int,
    request_rate: float | None = None,
    warmup: int = 2,
    desc: str = "",
    progress: bool = True,
) -> dict[str, Any]:
    """Send every prompt once through ``one`` (after ``warmup`` of them unmeasured), at most
    ``concurrency`` in flight, arriving back to back or as Poisson arrivals at
    ``request_rate``; return :func:`aggregate` of the measured phase."""
    from tqdm import tqdm

    for p in prompts[:warmup]:
        await one(p)
    bar = tqdm(total=len(prompts), desc=desc, disable=not progress)
    records: list[dict] = []
    sem = asyncio.Semaphore(concurrency)
    rng = random.Random(0)

    async def send(p: list[int]) -> None:
        async with sem:
            records.append(await one(p))
            bar.update(1)

    start = time.perf_counter()
    tasks = []
    for p in prompts:
        tasks.append(asyncio.create_task(send(p)))
        if request_rate:
            await asyncio.sleep(rng.expovariate(request_rate))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    bar.close()
    return aggregate(records, elapsed)


async def run_load(
    base_url: str,
    model: str,
    prompts: list[list[int]],
    output_len: int,
    concurrency: int,
    request_rate: float | None = None,
    api_key: str | None = None,
    timeout: float = 600.0,
    progress: bool = True,
    warmup: int = 2,
) -> dict[str, Any]:
    """Send every prompt once over HTTP; return :func:`aggregate` of the measured phase.

    Each of the ``concurrency`` workers has a client of its own with one keep-alive
    connection, as independent users would. One client with a pool of ``concurrency``
    connections spent the load generator's time, not the server's: httpcore scans its whole
    pool whenever a response closes, so 256 streams ending together took seconds of its
    CPU before the next requests went out (BENCHMARKS.md section 16).
    """
    import ssl

    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    tls = ssl.create_default_context()  # one for all: making one loads the CA store
    idle: asyncio.Queue[httpx.AsyncClient] = asyncio.Queue()
    clients = [
        httpx.AsyncClient(limits=limits, trust_env=False, verify=tls) for _ in range(concurrency)
    ]
    for client in clients:
        idle.put_nowait(client)

    async def one(p: list[int]) -> dict[str, Any]:
        client = await idle.get()
        try:
            return await _one(client, url, completion_body(model, p, output_len), headers, timeout)
        finally:
            idle.put_nowait(client)

    try:
        desc = f"{base_url} c={concurrency}"
        return await closed_loop(one, prompts, concurrency, request_rate, warmup, desc, progress)
    finally:
        await asyncio.gather(*(client.aclose() for client in clients))


async def wait_ready(base_url: str, timeout: float, api_key: str | None = None) -> None:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(trust_env=False) as client:
        while time.monotonic() < deadline:
            try:
                r = await client.get(base_url + "/v1/models", headers=headers, timeout=5)
                if r.status_code == 200 and r.json().get("data"):
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(1.0)
    raise TimeoutError(f"{base_url} not ready after {timeout:.0f} s")
