"""A small typed API over the model server's ``DeploymentHandle``.

It sends what the HTTP ingress sends (:class:`~rbln_ray.serve.http_call.HTTPCall`: a route,
a JSON body), so a handle call and an HTTP call run through the same vLLM app in the
replica: validated, scheduled, sampled and shaped identically. :meth:`RBLNClient.request`
reaches any route vLLM serves (``/v1/responses``, ``/v1/messages``, ``/tokenize``, ...);
the helpers cover completions and chat. The ingress's own admission limits (``n``,
``max_tokens`` caps, the media policy) do not apply to handle calls, as before: a driver
on the cluster is trusted.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rbln_ray.serve.http_call import HTTPCall, HTTPStart, parse_response_id, routing_prefix
from rbln_ray.serve.naming import APP_NAME, server_deployment_name


class RBLNRequestError(RuntimeError):
    """The server rejected or failed a request; ``code`` is the HTTP status."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass(frozen=True)
class Completion:
    """One finished choice."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


def _raise_if_error(item: dict[str, Any], status: int = 200) -> None:
    error = item.get("error") if isinstance(item, dict) else None
    if error is not None or status >= 400:
        error = error if isinstance(error, dict) else {"message": str(item)}
        raise RBLNRequestError(error.get("message", "error"), error.get("code") or status)


def sse_events(chunks: Iterator[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON events of an SSE byte stream (``data: {...}`` lines), skipping ``[DONE]``;
    an error event raises :class:`RBLNRequestError`."""
    buffer = b""
    for chunk in chunks:
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.decode().splitlines():
                if line.startswith("data: ") and line[6:].strip() != "[DONE]":
                    payload = json.loads(line[6:])
                    _raise_if_error(payload)
                    yield payload


class RBLNClient:
    """Requests to one served model through Ray Serve handles."""

    def __init__(self, model: str, app_name: str = APP_NAME, address: str | None = None) -> None:
        """Join the cluster first if this process has not: ``address``, else ``RAY_ADDRESS``,
        else this host's running ``rbln-ray serve`` (the embedded default), else Ray's own
        discovery."""
        import sys

        if "ray" not in sys.modules or not sys.modules["ray"].is_initialized():
            from rbln_ray.serve.local_ray import embedded_address, prepare_to_join

            address = address or os.environ.get("RAY_ADDRESS") or embedded_address() or "auto"
            prepare_to_join(address)  # before `import ray`: it reads the mode at import
            import ray

            ray.init(address=address, log_to_driver=False)
        from ray import serve

        self.model = model
        self._handle = serve.get_deployment_handle(server_deployment_name(model), app_name)

    # ------------------------------------------------------------ any route
    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> HTTPCall:
        """The :class:`HTTPCall` of one request (the model's name filled in)."""
        replica = None
        if body is not None:
            body = {"model": self.model, **body}
            previous = body.get("previous_response_id")
            found = parse_response_id(previous) if isinstance(previous, str) else None
            replica = found[1] if found else None
        if path.startswith("/v1/responses/"):  # retrieve / cancel: the id names the replica
            found = parse_response_id(path.split("/")[3])
            replica = found[1] if found else None
        return HTTPCall(
            method=method,
            path=path,
            headers=((b"content-type", b"application/json"),),
            body=json.dumps(body).encode() if body is not None else b"",
            prefix=routing_prefix(body or {}),
            replica=replica,
        )

    def stream_request(
        self, method: str, path: str, body: dict[str, Any] | None = None
    ) -> tuple[HTTPStart, Iterator[bytes]]:
        """Send a request; its start (status, headers, first chunk) and the rest of the
        body's chunks."""
        items = iter(self._handle.options(stream=True).http.remote(self.call(method, path, body)))
        start = next(items)
        return start, items

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """One request to any route the model serves; its JSON answer (a 4xx or 5xx raises
        :class:`RBLNRequestError`)."""
        start, rest = self.stream_request(method, path, body)
        raw = start.body + b"".join(rest)
        answer = json.loads(raw) if raw else None
        if start.status >= 400:
            _raise_if_error(answer if isinstance(answer, dict) else {}, start.status)
        return answer

    def events(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The JSON events of a streaming request (``"stream": True`` is added)."""
        start, rest = self.stream_request("POST", path, {**body, "stream": True})
        if start.status >= 400:
            answer = json.loads(start.body + b"".join(rest))
            _raise_if_error(answer, start.status)

        def chunks() -> Iterator[bytes]:
            yield start.body
            yield from rest

        yield from sse_events(chunks())

    # ------------------------------------------------------------ helpers
    @staticmethod
    def _finished(item: dict[str, Any], text: str) -> Completion:
        usage = item.get("usage") or {}
        return Completion(
            text=text,
            finish_reason=item["choices"][0].get("finish_reason"),
            prompt_tokens=usage.get("prompt_tokens", 0),
            completion_tokens=usage.get("completion_tokens", 0),
        )

    def complete(self, prompt: str | list[int], **params: Any) -> Completion:
        """One completion (``params``: any OpenAI/vLLM completion field, e.g. max_tokens)."""
        item = self.request("POST", "/v1/completions", {"prompt": prompt, **params})
        return self._finished(item, item["choices"][0]["text"])

    def stream(self, prompt: str | list[int], **params: Any) -> Iterator[str]:
        """Text deltas as the model produces them."""
        for payload in self.events("/v1/completions", {"prompt": prompt, **params}):
            for choice in payload.get("choices", []):
                if choice.get("text"):
                    yield choice["text"]

    def chat(self, messages: list[dict[str, Any]], **params: Any) -> Completion:
        """One chat completion; ``text`` is the assistant message content."""
        item = self.request("POST", "/v1/chat/completions", {"messages": messages, **params})
        return self._finished(item, item["choices"][0]["message"]["content"] or "")

    def stream_chat(self, messages: list[dict[str, Any]], **params: Any) -> Iterator[str]:
        """Assistant content deltas as the model produces them."""
        for payload in self.events("/v1/chat/completions", {"messages": messages, **params}):
            for choice in payload.get("choices", []):
                content = (choice.get("delta") or {}).get("content")
                if content:
                    yield content

    def responses(self, input: str | list[dict[str, Any]], **params: Any) -> dict[str, Any]:
        """One Responses API response (``client.responses.create``'s JSON)."""
        return self.request("POST", "/v1/responses", {"input": input, **params})

    def tokenize(self, prompt: str, **params: Any) -> list[int]:
        """The model's token ids of ``prompt``."""
        return self.request("POST", "/tokenize", {"prompt": prompt, **params})["tokens"]
