"""Speculative decoding behind the Serve app: a model's ``engine_kwargs`` carry vLLM's
``speculative_config`` (issue #34, acceptance 4). Completions and chat, plain and streamed,
through the ``openai`` client equal transformers' greedy text, and the replica's vLLM
metrics (Ray's export) count accepted drafts."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.helpers import hf_greedy
from tests.ray_metrics import metric_sum
from tests.serve.conftest import RunningApp, free_port, start_app, stop_app

pytestmark = pytest.mark.slow

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}


@pytest.fixture(scope="module")
def spec_app() -> Iterator[RunningApp]:
    from tests.vllm_plugin.test_spec_decode import demo_compiled

    hf_dir, compiled = demo_compiled()  # the demo model with verify graphs (k=4)
    config = {
        "models": [
            {
                "name": "spec",
                "model": str(compiled),
                "num_replicas": 1,
                "engine_kwargs": {"speculative_config": NGRAM},
            }
        ]
    }
    app = start_app(config, free_port(), hf_dir, devices=1)
    try:
        yield app
    finally:
        stop_app()


def test_completions_and_streams_equal_transformers_with_ngram(spec_app: RunningApp) -> None:
    import openai
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(spec_app.model_dir)
    client = openai.OpenAI(base_url=f"{spec_app.url}/v1", api_key="unused", max_retries=0)

    def expected(ids: list[int]) -> str:
        return tok.decode(hf_greedy(spec_app.model_dir, [ids], 40)[0]).rstrip("\ufffd")

    kw = {"model": "spec", "max_tokens": 40, "temperature": 0, "extra_body": {"ignore_eos": True}}
    prompt = "class Parser:\n    def parse(self, text):\n"
    want = expected(tok(prompt)["input_ids"])
    assert client.completions.create(prompt=prompt, **kw).choices[0].text == want
    chunks = client.completions.create(prompt=prompt, stream=True, **kw)
    assert "".join(c.choices[0].text for c in chunks) == want

    messages = [{"role": "user", "content": "read a file line by line"}]
    chat_prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    chat_want = expected(tok(chat_prompt, add_special_tokens=False)["input_ids"])
    streamed = client.chat.completions.create(messages=messages, stream=True, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat_want

    # The replica's engine verified drafts (its vLLM metrics, exported by Ray every second).
    name = "ray_vllm_spec_decode_num_accepted_tokens_total"
    deadline = time.monotonic() + 60
    while metric_sum(name) <= 0 and time.monotonic() < deadline:
        time.sleep(1)  # a bounded poll of Ray's metrics export, not a synchronisation
    assert metric_sum(name) > 0
    assert metric_sum("ray_vllm_spec_decode_num_draft_tokens_total") > metric_sum(name)
