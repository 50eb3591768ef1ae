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


async def _one(client, url: str, body: dict, headers: dict, timeout: float) -> dict:
    sent = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    usage_tokens = None
    try:
        async with client.stream("POST", url, json=body, headers=headers, timeout=timeout) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode()[:200]
                return {"sent": sent, "stamps": [], "output_tokens": 0, "error": text}
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                if chunk.get("choices"):
                    stamps.append(time.perf_counter())
                    tokens += 1
    except Exception as exc:  # noqa: BLE001 - a failed request is a data point
        return {"sent": sent, "stamps": [], "output_tokens": 0, "error": repr(exc)[:200]}
    return {"sent": sent, "stamps": stamps, "output_tokens": usage_tokens or tokens}


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
    """Send every prompt once; return :func:`aggregate` of the measured phase."""
    import httpx
    from tqdm import tqdm

    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def body(p: list[int]) -> dict:
        return {
            "model": model,
            "prompt": p,
            "max_tokens": output_len,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, trust_env=False) as client:
        for p in prompts[:warmup]:
            await _one(client, url, body(p), headers, timeout)
        bar = tqdm(total=len(prompts), desc=f"{base_url} c={concurrency}", disable=not progress)
        records: list[dict] = []
        sem = asyncio.Semaphore(concurrency)
        rng = random.Random(0)

        async def send(p: list[int]) -> None:
            async with sem:
                records.append(await _one(client, url, body(p), headers, timeout))
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
