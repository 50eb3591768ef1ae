"""Vision-language models through ``vllm.LLM`` on RBLN, token-exact against transformers
(acceptance 2 of the pooling/vision issue, the offline half; the HTTP half is in
``tests/serve/test_vision_serve.py``).

One engine (a tiny LLaVA compiled batch 4 on the emulator by the code path ``rbln-ray compile``
uses) runs every request at once: images of several sizes, two images in one prompt, a prompt
whose image lies past its first 128-token prefill chunk, the same image twice (vLLM's
processor cache sends it to the engine once), and a text-only prompt. Each must give the
prompt token ids and the greedy tokens transformers' own ``generate`` gives on the HF
processor's inputs. A second engine checks prefix caching: two long prompts with the same
text after different images, run twice; the second pass reuses each prompt's own cached
first block (vLLM keys a block by the images in it), never the other image's.
"""

from __future__ import annotations

import json

import pytest

from rbln_ray.models import build_tiny_vlm
from tests.helpers import SCRIPTS, run_python
from tests.vision import compiled_vlm, hf_vlm_greedy, image_spec, make_image

pytestmark = pytest.mark.slow

MAX_TOKENS = 16


def chat(body: str) -> str:
    return f"<|user|>\n{body}\n<|assistant|>\n"


# (prompt, images)
REQUESTS = [
    (chat("<image>describe the image"), [image_spec(1)]),
    (chat("no image here, only text"), []),
    (chat("<image> and <image>: which is brighter?"), [image_spec(2), image_spec(3, 30, 90)]),
    (chat("x = 1\n" * 40 + "<image>what is this?"), [image_spec(4)]),
    (chat("<image>what colour is it?"), [image_spec(1)]),  # the first request's image again
    (chat("<image>"), [image_spec(5, 200, 100)]),
]


# Same text, different images at the start: their first 128-token blocks differ by the image.
LONG_TEXT = "y = 2\n" * 40 + "what now?"
CACHED = [
    (chat("<image>" + LONG_TEXT), [image_spec(6)]),
    (chat("<image>" + LONG_TEXT), [image_spec(8)]),
]


def engine_run(requests: list, **extra) -> dict:
    return {
        "model": str(compiled_vlm()),
        "requests": [
            {
                "prompt": prompt,
                "images": images,
                "params": {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True},
            }
            for prompt, images in requests
        ],
        "rpc": ["step_stats"],
        **extra,
    }


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    spec = {"runs": [engine_run(REQUESTS), engine_run(CACHED, passes=2)]}
    result, _ = run_python([str(SCRIPTS / "rbln_llm_run.py"), json.dumps(spec)], timeout=900)
    assert all("error" not in r for r in result["runs"]), result["runs"]
    return result["runs"]


@pytest.fixture(scope="module")
def run(runs: list[dict]) -> dict:
    return runs[0]


def test_greedy_with_images_matches_transformers(run: dict) -> None:
    hf_dir = build_tiny_vlm()
    for i, (prompt, images) in enumerate(REQUESTS):
        want_prompt, want = hf_vlm_greedy(hf_dir, prompt, [make_image(**s) for s in images], 16)
        assert run["prompt_token_ids"][i] == want_prompt, i
        assert run["outputs"][i][0]["token_ids"] == want, i


def test_images_change_the_output() -> None:
    """The reference is sensitive to the image, so matching it means the image was seen."""
    hf_dir = build_tiny_vlm()
    prompt = REQUESTS[0][0]
    _, first = hf_vlm_greedy(hf_dir, prompt, [make_image(1)], MAX_TOKENS)
    _, other = hf_vlm_greedy(hf_dir, prompt, [make_image(99)], MAX_TOKENS)
    assert first != other


def test_prefix_cache_hits_are_keyed_by_the_image(runs: list[dict]) -> None:
    cached = runs[1]
    hf_dir = build_tiny_vlm()
    wants = []
    for i, (prompt, images) in enumerate(CACHED):
        _, want = hf_vlm_greedy(hf_dir, prompt, [make_image(**s) for s in images], MAX_TOKENS)
        for n, outputs in enumerate(cached["passes"]):
            assert outputs[i][0]["token_ids"] == want, (i, n)
        wants.append(want)
    assert wants[0] != wants[1]  # the image decides the answer, so a wrong hit would show
    assert len(cached["prompt_token_ids"][0]) > 128
    # the second pass reused one cached 128-token block per prompt; the first reused none
    assert cached["rpc"]["step_stats"][0]["prefix_reused_tokens"] == 2 * 128


def test_requests_share_the_batch_and_long_prompts_are_chunked(run: dict) -> None:
    stats = run["rpc"]["step_stats"][0]
    assert stats["prefill_requests"] == len(REQUESTS)
    # the 4th prompt spans two 128-token chunks: one prefill call more than requests
    assert stats["prefill_steps"] == len(REQUESTS) + 1
    assert len(run["prompt_token_ids"][3]) > 128
    # several requests decoded together in one compiled batch
    assert max(len(ids) for _, kind, ids in stats["history"] if kind == "decode") > 1
