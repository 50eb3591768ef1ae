"""Model-zoo families through the Serve app and the real ``openai`` client: a sliding-window
family (Gemma2, hybrid cache) and an MoE family (Mixtral), served side by side, each under
concurrent requests longer than the sliding window, greedy text equal to transformers'."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import compiled_model, hf_greedy
from tests.serve.conftest import RunningApp, free_port, start_app, stop_app

pytestmark = pytest.mark.slow

FAMILIES = {"gemma2": "sliding window (hybrid)", "mixtral": "MoE"}
# Python source, as the tiny models' tokenizer was trained on: well over the 64-token window.
PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n"
    "    parser.add_argument('--verbose', action='store_true')\n    args = parser.parse_args"
    "(argv)\n    for name in sorted(os.listdir(args.path)):\n        print(name)\n",
    "class Queue:\n    def __init__(self, maxsize=0):\n        self.maxsize = maxsize\n"
    "        self._init(maxsize)\n        self.mutex = threading.Lock()\n"
    "        self.not_empty = threading.Condition(self.mutex)\n    def put(self, item):\n",
    "def f(x):\n    return x\n",
]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def zoo_app() -> Iterator[RunningApp]:
    models = [
        {"name": family, "model": str(compiled_model(family)), "num_replicas": 1}
        for family in FAMILIES
    ]
    app = start_app({"models": models}, free_port(), Path())
    try:
        yield app
    finally:
        stop_app()


@pytest.mark.parametrize("family", list(FAMILIES), ids=list(FAMILIES))
def test_openai_client_concurrent_greedy_matches_transformers(
    zoo_app: RunningApp, family: str
) -> None:
    import openai
    from transformers import AutoTokenizer

    from rbln_ray.models import build_tiny_model

    hf_dir = build_tiny_model(family=family)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    assert max(len(i) for i in ids) > 64, "prompts must be longer than the sliding window"
    # vLLM holds back a trailing incomplete UTF-8 sequence.
    expected = [tok.decode(t).rstrip("\ufffd") for t in hf_greedy(hf_dir, ids, MAX_TOKENS)]

    client = openai.OpenAI(base_url=f"{zoo_app.url}/v1", api_key="unused", max_retries=0)

    def complete(prompt: str) -> str:
        out = client.completions.create(
            model=family, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        return out.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(complete, PROMPTS))
    assert got == expected, FAMILIES[family]
    streamed = client.completions.create(
        model=family, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == expected[0]
