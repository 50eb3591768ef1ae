"""A small typed API over the model server's ``DeploymentHandle``.

It sends the same vLLM protocol objects the HTTP ingress sends, so a handle call and an HTTP
call are validated, scheduled and sampled identically.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rbln_ray.serve.naming import APP_NAME, server_deployment_name


class RBLNRequestError(RuntimeError):
    """The server rejected or failed a request; ``code`` is the HTTP-equivalent status."""

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


def _raise_if_error(item: dict[str, Any]) -> None:
    if "error" in item:
        raise RBLNRequestError(
            item["error"].get("message", "error"), item["error"].get("code", 500)
        )


def _sse_payloads(chunk: str) -> Iterator[dict[str, Any]]:
    """The JSON events in an SSE chunk (``data: {...}`` lines), skipping ``[DONE]``."""
    for line in chunk.splitlines():
        if line.startswith("data: ") and line[6:].strip() != "[DONE]":
            payload = json.loads(line[6:])
            _raise_if_error(payload)
            yield payload


class RBLNClient:
    """Completions and chat for one served model, through Ray Serve handles."""

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

    # ------------------------------------------------------------ requests
    def _completion_request(self, prompt: str | list[int], stream: bool, **params: Any):
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        return CompletionRequest(model=self.model, prompt=prompt, stream=stream, **params)

    def _chat_request(self, messages: list[dict[str, Any]], stream: bool, **params: Any):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        return ChatCompletionRequest(model=self.model, messages=messages, stream=stream, **params)

    def _call(self, method: str, request: Any) -> Iterator[Any]:
        return iter(getattr(self._handle.options(stream=True), method).remote(request))

    @staticmethod
    def _finished(item: Any, text: str) -> Completion:
        usage = item.get("usage") or {}
        return Completion(
            text=text,
            finish_reason=item["choices"][0].get("finish_reason"),
            prompt_tokens=usage.get("prompt_tokens", 0),
            completion_tokens=usage.get("completion_tokens", 0),
        )

    # ------------------------------------------------------------ public API
    def complete(self, prompt: str | list[int], **params: Any) -> Completion:
        """One completion (``params``: any OpenAI/vLLM completion field, e.g. max_tokens)."""
        item = next(self._call("completions", self._completion_request(prompt, False, **params)))
        _raise_if_error(item)
        return self._finished(item, item["choices"][0]["text"])

    def stream(self, prompt: str | list[int], **params: Any) -> Iterator[str]:
        """Text deltas as the model produces them."""
        request = self._completion_request(prompt, True, **params)
        for chunk in self._call("completions", request):
            if isinstance(chunk, dict):
                _raise_if_error(chunk)
                continue
            for payload in _sse_payloads(chunk):
                for choice in payload.get("choices", []):
                    if choice.get("text"):
                        yield choice["text"]

    def chat(self, messages: list[dict[str, Any]], **params: Any) -> Completion:
        """One chat completion; ``text`` is the assistant message content."""
        item = next(self._call("chat", self._chat_request(messages, False, **params)))
        _raise_if_error(item)
        return self._finished(item, item["choices"][0]["message"]["content"] or "")

    def stream_chat(self, messages: list[dict[str, Any]], **params: Any) -> Iterator[str]:
        """Assistant content deltas as the model produces them."""
        for chunk in self._call("chat", self._chat_request(messages, True, **params)):
            if isinstance(chunk, dict):
                _raise_if_error(chunk)
                continue
            for payload in _sse_payloads(chunk):
                for choice in payload.get("choices", []):
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        yield content
