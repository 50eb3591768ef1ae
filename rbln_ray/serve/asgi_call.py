"""Run one :class:`~rbln_ray.serve.http_call.HTTPCall` through an ASGI app in process.

The replica's app is vLLM's own (``build_app`` on the replica's serving state), so this is
the request path of ``vllm serve`` minus the socket: vLLM's body parsing and validation,
handlers, exception handlers and response classes (JSON, SSE, a pooling model's bytes).

Why each detail:

* ``receive`` hands over the body once, then blocks until the call ends: vLLM's
  ``with_cancellation`` and Starlette's ``StreamingResponse`` wait on it for
  ``http.disconnect``, which aborts the request in the engine. The scope leaves
  ``spec_version`` unset (ASGI 2.0) so Starlette does listen for it.
* The first item is yielded only with the first body chunk (the whole body of a JSON
  response, the first event of a stream), so a caller can still retry a call whose replica
  died before anything was produced.
* Starlette's ``ServerErrorMiddleware`` sends its 500 and then re-raises: the exception is
  logged here, not raised a second time.
* ``load_aware_call`` attaches background tasks that run after the last body chunk: the
  app task is awaited (bounded) before the call returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from rbln_ray.serve.http_call import HTTPCall, HTTPStart

logger = logging.getLogger(__name__)

BACKGROUND_WAIT_S = 5.0  # for the app's background tasks after the last body chunk
CANCEL_WAIT_S = 2.0  # for the app to see the disconnect before it is cancelled


def scope_of(call: HTTPCall, app: Any = None) -> dict[str, Any]:
    """The ASGI HTTP scope of ``call``."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": call.method,
        "scheme": "http",
        "path": call.path,
        "raw_path": call.path.encode(),
        "root_path": "",
        "query_string": call.query,
        "headers": [(k, v) for k, v in call.headers],
        "client": call.client,
        "server": ("127.0.0.1", 0),
        **({"app": app} if app is not None else {}),
    }


async def run(app: Any, call: HTTPCall) -> AsyncIterator[HTTPStart | bytes]:
    """Stream ``app``'s answer to ``call``: an :class:`HTTPStart`, then body chunks.

    Closing the generator early (the caller went away) tells the app the client
    disconnected, waits briefly for it to wind down, then cancels it.
    """
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    out: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    task = asyncio.create_task(app(scope_of(call), receive, out.put))
    start: dict[str, Any] | None = None
    first_sent = False
    try:
        while True:
            message = await _next(out, task)
            if message is None:
                break
            if message["type"] == "http.response.start":
                start = message
                continue
            if message["type"] != "http.response.body":
                continue
            chunk, more = message.get("body", b""), message.get("more_body", False)
            if not first_sent:
                if start is None:
                    raise RuntimeError("the app sent a body before its response start")
                first_sent = True
                headers = tuple((bytes(k), bytes(v)) for k, v in start.get("headers", ()))
                yield HTTPStart(int(start["status"]), headers, chunk, more)
            elif chunk:
                yield chunk
            if not more:
                break
        if not first_sent:  # the app ended without a response: its exception says why
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()
            raise RuntimeError(f"{call.method} {call.path}: the app sent no response")
        await asyncio.wait({task}, timeout=BACKGROUND_WAIT_S)
    finally:
        gone.set()
        if not task.done():
            await asyncio.wait({task}, timeout=CANCEL_WAIT_S)
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        elif not task.cancelled() and task.exception() is not None and first_sent:
            # ServerErrorMiddleware re-raises after sending its 500: already answered.
            logger.debug("%s %s raised after answering", call.method, call.path,
                         exc_info=task.exception())  # fmt: skip


async def _next(out: asyncio.Queue, task: asyncio.Task) -> dict[str, Any] | None:
    """The app's next message, or None once it has ended with nothing more queued."""
    while True:
        if not out.empty():
            return out.get_nowait()
        if task.done():
            return None if out.empty() else out.get_nowait()
        getter = asyncio.ensure_future(out.get())
        try:
            await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not getter.done():
                getter.cancel()
        if not getter.cancelled():
            return getter.result()
