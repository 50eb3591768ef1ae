"""Does a server answer vLLM's OpenAI-compatible API as ``vllm serve`` does?

    python -m benchmarks.api_compat --base http://127.0.0.1:8000 --model demo \\
        [--reference http://127.0.0.1:8001 | --reference-model HF_DIR [--reference-args ...]] \\
        [--api-key KEY] [--only meta,chat,...] [--out FILE] [--strict]

The same calls go to both servers, through the ``openai`` and ``anthropic`` SDKs where a
route has one and raw HTTP elsewhere, and their answers are compared after normalisation
(:func:`normalize`: ids, timestamps and fingerprints out): status codes and media types
exactly, JSON bodies field by field (log-probabilities within 1e-3), errors by type, code
and parameter, streams by their event sequence, text, tool calls, finish reason and usage
(chunk counts may differ). A difference rbln-ray intends is listed in :data:`EXPECTED` with
its reason; any other is reported, and ``--strict`` exits 1 on one.

Generation is greedy, so equal weights give equal tokens. What a random test model cannot be
made to write (a tool call, a reasoning block) is scripted: calls carry
``vllm_xargs.rbln_script`` token ids (:mod:`rbln_ray.models.scripted`), which both servers
honour when they load that logits processor (``--reference-model`` launches plain vLLM with
it); token ids come from the base server's ``/tokenize``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import math
import os
import re
import struct
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import vllm_serve

# Keys whose values differ between any two runs: ids, timestamps, fingerprints, paths.
DROP_KEYS = {
    "name_or_path",
    "id",
    "created",
    "created_at",
    "completed_at",
    "system_fingerprint",
    "root",
    "parent",
    "permission",
    "request_id",
    "sequence_number",
}
ID_RE = re.compile(r"^(chatcmpl|cmpl|resp|msg|rs|fc|call|toolu|ctc)[-_][0-9A-Za-z_-]+$")
LOGPROB_TOL = 1e-3
FLOAT_TOL = 1e-4

WRONG_TASK = (
    "a route the model's task does not serve: vllm serve does not mount it (FastAPI's bare "
    "404 {'detail': 'Not Found'}); rbln-ray's 404 is an OpenAI error body naming the tasks"
)
# Cases where rbln-ray answers differently on purpose (README, "Routes"), with the reason.
EXPECTED = {
    "meta: model card": "/v1/models/{model} is an rbln-ray extension; vllm serve has no route",
    "meta: health": "rbln-ray's /health reports every deployment in a JSON body",
    "meta: /metrics": "metrics go through Ray's metrics pipeline; rbln-ray refuses /metrics",
    "meta: /load": "per-replica load is Serve's; rbln-ray refuses /load",
    "meta: /sleep": "both refuse engine control with 404; rbln-ray's body says why",
    "meta: /collective_rpc": "both refuse engine control with 404; rbln-ray's body says why",
    "meta: tokenizer_info": (
        "a compiled artifact's tokenizer files are optimum-rbln's re-save (Qwen2's tokenizer "
        "class adds its unknown token); the tokens of any text are the same"
    ),
    "completions: logprobs + echo": (
        "prompt log-probabilities need every prompt position's logits; a compiled RBLN "
        "prefill graph returns the last one's (400 naming it)"
    ),
    "completions: no model": (
        "a routed app needs the model named; vllm serve falls back to its only model"
    ),
    # benchmarks.api_compat_pooling
    "embed: /classify": WRONG_TASK,
    "cross: embeddings": WRONG_TASK,
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome", "Seoul"]}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}


# ------------------------------------------------------------------ answers
@dataclass
class Answer:
    """What one server answered one case: status, media type, normalised body."""

    status: int
    media: str
    body: Any
    raw_id: str | None = None  # the "id" of the body before normalisation


def media_of(headers: Any) -> str:
    return str(headers.get("content-type", "")).split(";")[0].strip()


def normalize(value: Any) -> Any:
    """A body without what differs between runs (:data:`DROP_KEYS`, ids); an embedding sent
    as base64 (the ``openai`` SDK's default) as its floats, compared within tolerance."""
    if isinstance(value, dict):
        return {
            k: normalize(floats(v) if k == "embedding" else v)
            for k, v in value.items()
            if k not in DROP_KEYS
        }
    if isinstance(value, list):
        return [normalize(v) for v in value]
    if isinstance(value, str) and ID_RE.match(value):
        return "<id>"
    return value


def floats(embedding: Any) -> Any:
    """A base64 embedding (little-endian float32, as vLLM encodes it) as a list of floats."""
    if not isinstance(embedding, str):
        return embedding
    raw = base64.b64decode(embedding)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def error_view(body: Any) -> Any:
    """An error body's comparable part: its type, code and parameter (OpenAI's shape), or
    Anthropic's type; messages are reported, not compared."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        error = body["error"]
        return {k: error.get(k) for k in ("type", "code", "param") if k in error}
    return body


def parse_sse(text: str) -> list[tuple[str | None, Any]]:
    """``(event name, data)`` of every SSE event (data as JSON where it is)."""
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if data:
            raw = "\n".join(data)
            try:
                events.append((name, json.loads(raw)))
            except ValueError:
                events.append((name, raw))
    return events


def _collapse(names: list[str]) -> list[str]:
    """Runs of one event type as one (how many deltas a text takes may differ)."""
    return [n for i, n in enumerate(names) if i == 0 or names[i - 1] != n]


def stream_summary(text: str) -> dict[str, Any]:
    """What a stream says, independent of how its tokens were grouped into chunks."""
    events = parse_sse(text)
    if any(name for name, _ in events):  # Responses API / Anthropic: named events
        texts: dict[str, str] = {}
        final = None
        for name, data in events:
            if not isinstance(data, dict):
                continue
            delta = data.get("delta")
            if isinstance(delta, str):
                texts[name] = texts.get(name, "") + delta
            elif isinstance(delta, dict):
                for key in ("text", "partial_json", "thinking"):
                    if isinstance(delta.get(key), str):
                        texts[key] = texts.get(key, "") + delta[key]
            if name in ("response.completed", "message_delta", "error"):
                final = data
        names = _collapse([name or "data" for name, _ in events])
        return {"events": names, "text": texts, "final": normalize(final)}
    choices: dict[int, dict[str, Any]] = {}
    usage, done, keys = None, False, set()
    for _, data in events:
        if data == "[DONE]":
            done = True
            continue
        if not isinstance(data, dict):
            continue
        if "error" in data:
            return {"error": error_view(data)}
        usage = data.get("usage") or usage
        for choice in data.get("choices") or []:
            c = choices.setdefault(
                choice.get("index", 0), {"text": "", "reasoning": "", "tools": {}, "finish": None}
            )
            delta = choice.get("delta") or {}
            keys |= {k for k, v in delta.items() if v not in (None, "", [])}
            c["text"] += choice.get("text") or delta.get("content") or ""
            c["reasoning"] += delta.get("reasoning") or ""
            for tc in delta.get("tool_calls") or []:
                t = c["tools"].setdefault(tc.get("index", 0), {"name": "", "arguments": ""})
                fn = tc.get("function") or {}
                t["name"] += fn.get("name") or ""
                t["arguments"] += fn.get("arguments") or ""
            c["finish"] = choice.get("finish_reason") or c["finish"]
    return {"choices": choices, "usage": usage, "done": done, "delta_keys": sorted(keys)}


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Paths where two normalised bodies differ (log-probabilities and floats within
    tolerance)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                out.append(f"{path}.{key} only in {'base' if key in a else 'reference'}")
            else:
                out += differences(a[key], b[key], f"{path}.{key}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path} length {len(a)} != {len(b)}"]
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in differences(x, y, f"{path}[{i}]")
        ]
    numbers = (int, float)
    both = isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool)
    if both and (isinstance(a, float) or isinstance(b, float)):
        tol = LOGPROB_TOL if "logprob" in path else FLOAT_TOL
        if math.isinf(a) or math.isinf(b):
            return [] if a == b else [f"{path}: {a} != {b}"]
        return [] if abs(a - b) <= tol else [f"{path}: {a} != {b}"]
    return [] if a == b else [f"{path}: {_short(a)} != {_short(b)}"]


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) < 80 else text[:77] + "..."


# ------------------------------------------------------------------ servers
class Server:
    """One server under test: its URL, key, SDK clients and the model it serves."""

    def __init__(self, url: str, model: str, api_key: str | None = None) -> None:
        import anthropic
        import httpx
        import openai

        self.url, self.model, self.api_key = url.rstrip("/"), model, api_key
        key = api_key or "unused"
        self.openai = openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=300
        )
        self.anthropic = anthropic.Anthropic(
            base_url=self.url, auth_token=key, max_retries=0, timeout=300
        )
        headers = {"Authorization": f"Bearer {key}"}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=300, trust_env=False)

    def close(self) -> None:
        self.http.close()


def from_http(response: Any, stream: bool = False) -> Answer:
    media = media_of(response.headers)
    text = response.text
    if stream and media == "text/event-stream":
        return Answer(response.status_code, media, stream_summary(text))
    try:
        raw = json.loads(text) if text else None
    except ValueError:
        raw = text
    body = normalize(raw)
    if response.status_code >= 400:
        body = error_view(body)
    raw_id = raw.get("id") if isinstance(raw, dict) and isinstance(raw.get("id"), str) else None
    return Answer(response.status_code, media, body, raw_id)


def sdk(call: Callable[[Server], Any]) -> Callable[[Server], Answer]:
    """A case through an SDK's ``with_raw_response`` call (errors are answers too)."""

    def run(server: Server) -> Answer:
        import anthropic
        import openai

        try:
            return from_http(call(server).http_response)
        except (openai.APIStatusError, anthropic.APIStatusError) as exc:
            return from_http(exc.response)

    return run


def sdk_stream(call: Callable[[Server], Any]) -> Callable[[Server], Answer]:
    """A streaming case through an SDK's ``with_streaming_response`` call."""

    def run(server: Server) -> Answer:
        import anthropic
        import openai

        try:
            with call(server) as response:
                response.read()
                return from_http(response.http_response, stream=True)
        except (openai.APIStatusError, anthropic.APIStatusError) as exc:
            return from_http(exc.response)

    return run


def http(
    method: str,
    path: str,
    body: Any = None,
    *,
    content: bytes | None = None,
    headers: dict | None = None,
    stream: bool = False,
) -> Callable[[Server], Answer]:
    """A raw HTTP case; ``{model}`` in the path and ``"<model>"`` in the body become the
    server's model."""

    def run(server: Server) -> Answer:
        url = path.replace("{model}", server.model)
        payload = _with_model(body, server.model)
        response = server.http.request(method, url, json=payload, content=content, headers=headers)
        return from_http(response, stream=stream)

    return run


def _with_model(value: Any, model: str) -> Any:
    if isinstance(value, dict):
        return {k: _with_model(v, model) for k, v in value.items()}
    if isinstance(value, list):
        return [_with_model(v, model) for v in value]
    return model if value == "<model>" else value


# ------------------------------------------------------------------ cases
@dataclass
class Case:
    name: str
    run: Callable[[Server], Answer]
    # Runs after the named case on the same server, with its answer (retrieve a response).
    then: Callable[[Server, Answer], Answer] | None = None


def scripts(base: Server) -> Callable[[str], dict]:
    """``text -> extra_body`` making a model write ``text`` (ids from the base server's
    ``/tokenize``; ended by the EOS token when ``/tokenizer_info`` names it)."""
    eos: list[int] = []
    info = base.http.get("/tokenizer_info", params={"model": base.model})
    token = info.json().get("eos_token") if info.status_code == 200 else None
    if isinstance(token, dict):
        token = token.get("content")
    if isinstance(token, str):
        eos = _tokens(base, token)[-1:]

    def script(text: str) -> dict:
        return {"vllm_xargs": {"rbln_script": _tokens(base, text) + eos}}

    return script


def _tokens(server: Server, text: str) -> list[int]:
    body = {"model": server.model, "prompt": text, "add_special_tokens": False}
    answer = server.http.post("/tokenize", json=body)
    answer.raise_for_status()
    return answer.json()["tokens"]


def cases(script: Callable[[str], dict]) -> dict[str, list[Case]]:
    """Every case, by group."""
    m = "<model>"
    greedy = {"temperature": 0}
    hermes = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    rome = hermes.replace("Paris", "Rome")  # required / named: a Hermes structural tag
    named = {"type": "function", "function": {"name": "get_weather"}}
    think = {
        # no opening <think>: vLLM's deepseek_r1 stream keeps it in `reasoning` when it
        # arrives in one delta with more text (timing-dependent), as R1 models never write it
        **script("Paris is in France.</think>It is sunny."),
        "chat_template_kwargs": {"thinking": True},
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}

    def comp(**kw: Any) -> Callable[[Server], Answer]:
        return sdk(lambda s: s.openai.completions.with_raw_response.create(model=s.model, **kw))

    def comp_stream(**kw: Any) -> Callable[[Server], Answer]:
        return sdk_stream(
            lambda s: s.openai.completions.with_streaming_response.create(
                model=s.model, stream=True, **kw
            )
        )

    def chat(**kw: Any) -> Callable[[Server], Answer]:
        return sdk(
            lambda s: s.openai.chat.completions.with_raw_response.create(
                model=s.model, **{"messages": ASK, "max_tokens": 24, **greedy, **kw}
            )
        )

    def chat_stream(**kw: Any) -> Callable[[Server], Answer]:
        return sdk_stream(
            lambda s: s.openai.chat.completions.with_streaming_response.create(
                model=s.model, stream=True, **{"messages": ASK, "max_tokens": 24, **greedy, **kw}
            )
        )

    def resp(**kw: Any) -> Callable[[Server], Answer]:
        return sdk(
            lambda s: s.openai.responses.with_raw_response.create(
                model=s.model, **{"input": "hello", "max_output_tokens": 16, **greedy, **kw}
            )
        )

    def resp_stream(**kw: Any) -> Callable[[Server], Answer]:
        return sdk_stream(
            lambda s: s.openai.responses.with_streaming_response.create(
                model=s.model,
                stream=True,
                **{"input": "hello", "max_output_tokens": 16, **greedy, **kw},
            )
        )

    def anthropic_kw(kw: dict[str, Any]) -> dict[str, Any]:
        # Anthropic's SDK has no temperature argument: greedy goes in the body
        extra = {"temperature": 0, **kw.pop("extra_body", {})}
        hi = [{"role": "user", "content": "hi"}]
        return {"max_tokens": 16, "messages": hi, "extra_body": extra, **kw}

    def msgs(**kw: Any) -> Callable[[Server], Answer]:
        return sdk(
            lambda s: s.anthropic.messages.with_raw_response.create(
                model=s.model, **anthropic_kw(dict(kw))
            )
        )

    def msgs_stream(**kw: Any) -> Callable[[Server], Answer]:
        return sdk_stream(
            lambda s: s.anthropic.messages.with_streaming_response.create(
                model=s.model, stream=True, **anthropic_kw(dict(kw))
            )
        )

    def retrieve(server: Server, created: Answer) -> Answer:
        return from_http(server.http.get(f"/v1/responses/{created.raw_id}"))

    def cancel(server: Server, created: Answer) -> Answer:
        return from_http(server.http.post(f"/v1/responses/{created.raw_id}/cancel"))

    json_h = {"Content-Type": "application/json"}
    return {
        "meta": [
            Case("meta: models", http("GET", "/v1/models")),
            Case("meta: model card", http("GET", "/v1/models/{model}")),
            Case("meta: version", http("GET", "/version")),
            Case("meta: health", http("GET", "/health")),
            Case("meta: tokenizer_info", http("GET", "/tokenizer_info")),
            Case("meta: unknown route", http("GET", "/nope")),
            Case("meta: wrong method", http("GET", "/v1/completions")),
            Case("meta: /metrics", http("GET", "/metrics")),
            Case("meta: /load", http("GET", "/load")),
            Case("meta: /sleep", http("POST", "/sleep", {})),
            Case("meta: /collective_rpc", http("POST", "/collective_rpc", {})),
        ],
        "tokenizer": [
            Case("tokenize: prompt", http("POST", "/tokenize", {"model": m, "prompt": "def f():"})),
            Case(
                "tokenize: chat",
                http(
                    "POST",
                    "/tokenize",
                    {
                        "model": m,
                        "messages": ASK,
                        "add_generation_prompt": True,
                        "return_token_strs": True,
                        "tools": TOOLS,
                    },
                ),
            ),
            Case("detokenize", http("POST", "/detokenize", {"model": m, "tokens": [5, 6, 7, 300]})),
            Case(
                "tokenize: unknown model", http("POST", "/tokenize", {"model": "x", "prompt": "a"})
            ),
        ],
        "completions": [
            Case("completions: greedy", comp(prompt="def main(", max_tokens=16, **greedy)),
            Case(
                "completions: stream + usage",
                comp_stream(
                    prompt="def main(",
                    max_tokens=16,
                    stream_options={"include_usage": True},
                    **greedy,
                ),
            ),
            Case(
                "completions: logprobs + echo",
                comp(prompt="x = 1", max_tokens=4, logprobs=3, echo=True, **greedy),
            ),
            Case(
                "completions: token ids + stop",
                comp(prompt=[5, 6, 7, 300], max_tokens=16, stop=["\n"], **greedy),
            ),
            Case(
                "completions: n=2 seeded",
                comp(prompt="import", max_tokens=8, n=2, seed=7, temperature=1.0),
            ),
            Case(
                "completions: ignore_eos",
                comp(prompt="a", max_tokens=12, extra_body={"ignore_eos": True}, **greedy),
            ),
            Case("completions: bad max_tokens", comp(prompt="a", max_tokens="lots")),
            Case("completions: negative max_tokens", comp(prompt="a", max_tokens=-5)),
            Case("completions: over the context", comp(prompt=[5] * 600, max_tokens=4)),
            Case(
                "completions: unknown model",
                http("POST", "/v1/completions", {"model": "gpt-9", "prompt": "a"}),
            ),
            Case(
                "completions: no model",
                http("POST", "/v1/completions", {"prompt": "a", "max_tokens": 2, **greedy}),
            ),
            Case(
                "completions: not JSON",
                http("POST", "/v1/completions", content=b"{oops", headers=json_h),
            ),
            Case(
                "completions: a list body",
                http("POST", "/v1/completions", content=b"[1, 2]", headers=json_h),
            ),
            Case(
                "completions: text/plain",
                http(
                    "POST", "/v1/completions", content=b"{}", headers={"Content-Type": "text/plain"}
                ),
            ),
        ],
        "chat": [
            Case("chat: greedy", chat()),
            Case("chat: stream", chat_stream(stream_options={"include_usage": True})),
            Case("chat: json_schema", chat(response_format=fmt, max_tokens=48)),
            Case("chat: json_object", chat(response_format={"type": "json_object"}, max_tokens=24)),
            Case(
                "chat: regex",
                chat(extra_body={"structured_outputs": {"regex": r"(yes|no), [0-9]{3}"}}),
            ),
            Case(
                "chat: choice",
                chat(extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}}),
            ),
            Case(
                "chat: grammar",
                chat(extra_body={"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}}),
            ),
            Case("chat: tools auto", chat(tools=TOOLS, max_tokens=64, extra_body=script(hermes))),
            Case(
                "chat: tools auto stream",
                chat_stream(tools=TOOLS, max_tokens=64, extra_body=script(hermes)),
            ),
            Case(
                "chat: tools required",
                chat(tools=TOOLS, tool_choice="required", max_tokens=64, extra_body=script(rome)),
            ),
            Case("chat: tools named", chat(tools=TOOLS, tool_choice=named, max_tokens=32)),
            Case(
                "chat: tools none",
                chat(tools=TOOLS, tool_choice="none", extra_body=script("no tools")),
            ),
            Case("chat: reasoning", chat(extra_body=think, max_tokens=32)),
            Case("chat: reasoning stream", chat_stream(extra_body=think, max_tokens=32)),
            Case(
                "chat: named tool not in tools",
                chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
            ),
            Case(
                "chat: two constraints",
                chat(response_format=fmt, extra_body={"structured_outputs": {"choice": ["a"]}}),
            ),
        ],
        "responses": [
            Case("responses: create", resp(extra_body=script("Hi there."))),
            Case("responses: stream", resp_stream(extra_body=script("Streamed."))),
            Case(
                "responses: json_schema",
                resp(
                    max_output_tokens=48,
                    text={
                        "format": {
                            "type": "json_schema",
                            "name": "w",
                            "schema": SCHEMA,
                            "strict": True,
                        }
                    },
                ),
            ),
            Case(
                "responses: stored, retrieved",
                resp(store=True, extra_body=script("Kept.")),
                then=retrieve,
            ),
            Case("responses: cancel a finished one", resp(store=True), then=cancel),
            Case("responses: retrieve unknown", http("GET", "/v1/responses/resp_nope")),
            Case("responses: cancel unknown", http("POST", "/v1/responses/resp_nope/cancel")),
            Case(
                "responses: function call",
                resp(
                    tools=[{"type": "function", **TOOLS[0]["function"]}],
                    max_output_tokens=64,
                    extra_body=script(hermes),
                ),
            ),
        ],
        "messages": [
            Case("messages: create", msgs(extra_body=script("Hello from RBLN."))),
            Case("messages: stream", msgs_stream(extra_body=script("Streamed too."))),
            Case(
                "messages: tool_use",
                msgs(
                    max_tokens=64,
                    tools=[
                        {
                            "name": "get_weather",
                            "description": "weather",
                            "input_schema": TOOLS[0]["function"]["parameters"],
                        }
                    ],
                    extra_body=script(hermes),
                ),
            ),
            Case(
                "messages: count_tokens",
                sdk(
                    lambda s: s.anthropic.messages.with_raw_response.count_tokens(
                        model=s.model, messages=[{"role": "user", "content": "hi"}]
                    )
                ),
            ),
            Case(
                "messages: no max_tokens",
                http(
                    "POST",
                    "/v1/messages",
                    {"model": m, "messages": [{"role": "user", "content": "hi"}]},
                ),
            ),
            Case(
                "messages: unknown model",
                http(
                    "POST",
                    "/v1/messages",
                    {
                        "model": "gpt-9",
                        "max_tokens": 4,
                        "messages": [{"role": "user", "content": "hi"}],
                    },
                ),
            ),
        ],
    }


# ------------------------------------------------------------------ running
@dataclass
class Result:
    case: str
    base: dict[str, Any]
    reference: dict[str, Any]
    verdict: str  # same | differs | expected
    details: list[str] = field(default_factory=list)


def answer(server: Server, case: Case) -> Answer:
    first = case.run(server)
    return first if case.then is None else case.then(server, first)


def compare(name: str, a: Answer, b: Answer) -> Result:
    found = []
    if a.status != b.status:
        found.append(f"status {a.status} != {b.status}")
    if a.media != b.media:
        found.append(f"media type {a.media!r} != {b.media!r}")
    if not found:
        found = differences(a.body, b.body)
    verdict = "same" if not found else ("expected" if name in EXPECTED else "differs")
    return Result(name, asdict(a), asdict(b), verdict, found)


def run(
    base: Server,
    reference: Server,
    only: set[str] | None = None,
    table: dict[str, list[Case]] | None = None,
) -> list[Result]:
    """Every case of ``table`` (default: :func:`cases`, the generating routes) on both."""
    results = []
    for group, group_cases in (table or cases(scripts(base))).items():
        if only and group not in only:
            continue
        for case in group_cases:
            results.append(compare(case.name, answer(base, case), answer(reference, case)))
    return results


def report(results: list[Result]) -> str:
    lines = [f"{'case':44} {'base':>5} {'ref':>5}  verdict"]
    for r in results:
        verdict = r.verdict
        if r.verdict == "differs":
            verdict += ": " + "; ".join(r.details[:3])
        elif r.verdict == "expected":
            verdict += ": " + EXPECTED[r.case]
        lines.append(f"{r.case:44} {r.base['status']:>5} {r.reference['status']:>5}  {verdict}")
    counts = {v: sum(r.verdict == v for r in results) for v in ("same", "expected", "differs")}
    lines.append(
        f"{counts['same']} same, {counts['expected']} expected differences, "
        f"{counts['differs']} unexpected differences"
    )
    return "\n".join(lines)


# ------------------------------------------------------------------ a reference server
def reference_args(model_cfg: Any, max_model_len: int) -> tuple[list[str], dict[str, str]]:
    """The ``vllm serve`` arguments and environment that serve like ``model_cfg`` (an
    rbln-ray model config: the same chat template, parsers, logits processors,
    structured-output backend, stored responses and context length)."""
    from rbln_ray.serve.vllm_args import engine_argv

    argv = engine_argv(model_cfg.vllm_kwargs()) + ["--max-model-len", str(max_model_len)]
    env = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"} if model_cfg.responses_store else {}
    return argv, env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the server under test")
    parser.add_argument("--model", required=True, help="the model name both servers serve")
    parser.add_argument("--api-key", default=os.environ.get("RBLN_RAY_API_KEY"))
    parser.add_argument("--reference", help="a running vllm serve of the same weights")
    parser.add_argument("--reference-model", help="launch vllm serve of this HF directory")
    parser.add_argument("--reference-args", default="", help="more vllm serve arguments")
    groups = ",".join(cases(lambda text: {}))
    parser.add_argument("--only", help=f"comma-separated groups: {groups}")
    parser.add_argument("--out", type=Path, help="write every result as JSON here")
    parser.add_argument("--strict", action="store_true", help="exit 1 on a difference")
    args = parser.parse_args(argv)
    if not args.reference and not args.reference_model:
        parser.error("give --reference URL or --reference-model HF_DIR")
    only = set(args.only.split(",")) if args.only else None
    base = Server(args.base, args.model, args.api_key)
    with contextlib.ExitStack() as stack:
        url = args.reference
        if url is None:
            url = stack.enter_context(
                vllm_serve(args.reference_model, args.model, args.reference_args.split())
            )
        results = run(base, Server(url, args.model), only)
    print(report(results))
    if args.out:
        args.out.write_text(json.dumps([asdict(r) for r in results], indent=1, default=str))
    unexpected = sum(r.verdict == "differs" for r in results)
    return 1 if args.strict and unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
