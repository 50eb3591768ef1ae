"""Warm a replica before Serve marks it healthy: no user request pays for first calls.

Why: the first request after ``rbln-ray is ready`` took seconds, the next ones a fraction of
one (BENCHMARKS §10): the replica's first device calls (every compiled graph runs once before it is
fast: the emulator builds its kernels, an ATOM loads the program), vLLM's first sampling,
detokenizing and response building, the chat template's compilation. So the replica's
constructor serves a few requests of its own through the very objects user requests use
(vLLM's OpenAI serving layer on the replica's engine):

* one burst of ``B`` concurrent completions, ``B`` = the largest compiled decoder batch
  size, with ``max_tokens`` 2, 3, ..., B + 1: each starts with a prefill; the scheduler
  admits waiting prompts before decoding, so the rows decoded per step go B, B - 1, ..., 1
  as the requests finish one by one, and every compiled decoder batch size runs (the
  smallest one that holds the rows: ``RBLNModelRunner._decode``). One of them streams;
* one chat completion (chat template, chat response path).

Sampling matters as much as shapes: the first request with the model's default sampling
parameters took seconds longer than a greedy one (vLLM's random and top-k/top-p sampling
paths run for the first time; BENCHMARKS §10), so the burst alternates greedy and default
sampling and the chat request uses top-k/top-p.

The runner's step history then says which decoder batch sizes ran; a size the burst missed
(prompts that arrived late) gets one more burst of its own size. Warm-up costs a handful of
tiny requests per replica start; vLLM's request counters include them.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

PROMPT = "Hello"


def burst_max_tokens(size: int) -> list[int]:
    """``max_tokens`` of one burst of ``size`` requests: distinct, so they finish one by one."""
    return [2 + i for i in range(size)]


def decoder_sizes_run(
    history: Iterable[tuple[int, str, Sequence[str]]], sizes: Sequence[int]
) -> set[int]:
    """Compiled decoder batch sizes the runner's step ``history`` used (see StepStats)."""
    ordered = sorted(sizes)
    used = set()
    for _, kind, req_ids in history:
        if kind == "decode" and req_ids:
            idx = bisect.bisect_left(ordered, len(req_ids))
            if idx < len(ordered):
                used.add(ordered[idx])
    return used


async def _complete(serving: Any, model: str, max_tokens: int, stream: bool, greedy: bool) -> None:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    sampling = {"temperature": 0.0} if greedy else {}  # else the model's defaults
    request = CompletionRequest(
        model=model,
        prompt=PROMPT,
        max_tokens=max_tokens,
        ignore_eos=True,
        stream=stream,
        **sampling,
    )
    await _drain(await serving.create_completion(request))


async def _chat(serving: Any, model: str) -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    request = ChatCompletionRequest(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=2,
        top_k=20,
        top_p=0.9,
        ignore_eos=True,
    )
    await _drain(await serving.create_chat_completion(request))


async def _drain(result: Any) -> None:
    """Consume a serving call's result; an error response fails the warm-up."""
    if hasattr(result, "model_dump"):
        body = result.model_dump()
        if "error" in body:
            raise RuntimeError(f"warm-up request failed: {body['error']}")
        return
    async for chunk in result:
        if '"error"' in chunk:
            raise RuntimeError(f"warm-up stream failed: {chunk.strip()}")


async def _burst(state: Any, model: str, size: int) -> None:
    serving = state.openai_serving_completion
    await asyncio.gather(
        *(
            _complete(serving, model, n, stream=i == 0, greedy=i % 2 == 0)
            for i, n in enumerate(burst_max_tokens(size))
        )
    )


async def warm_up(state: Any, engine: Any, model: str, decoder_sizes: Sequence[int]) -> None:
    """Run the warm-up requests (module docstring) on ``engine`` through ``state``'s serving
    objects (vLLM's ``init_app_state``)."""
    started = time.perf_counter()
    sizes = sorted(decoder_sizes)
    await _burst(state, model, sizes[-1])
    missed = set(sizes) - decoder_sizes_run(await _history(engine), sizes)
    for size in sorted(missed, reverse=True):
        await _burst(state, model, size)
    await _chat(state.openai_serving_chat, model)
    still = set(sizes) - decoder_sizes_run(await _history(engine), sizes)
    if still:
        logger.warning("warm-up of %s did not run decoder batch size(s) %s", model, sorted(still))
    seconds = time.perf_counter() - started
    logger.info(
        "model %s warmed up (decoder batch sizes %s, chat) in %.1f s", model, sizes, seconds
    )


async def _history(engine: Any) -> list[tuple[int, str, Sequence[str]]]:
    stats = await engine.collective_rpc("step_stats")
    return list(stats[0].get("history", ()))
