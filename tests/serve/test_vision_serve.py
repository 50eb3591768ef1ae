"""Every vision-language family of the registry through the Serve app and the `openai`
client: a chat with a ``data:`` URL image equals transformers' greedy output on the same
weights, and so does a text-only chat to the same model. Families whose images are any size
(the Qwen families: the processor sizes an image within its pixel budget, which a request may
raise) refuse an image larger than the compiled vision tower takes with a 400 naming both
sizes, and keep serving.

One app (one Ray instance, one Serve application) serves the families a few at a time: the
application is redeployed with the next families once the previous ones answered, so at most
``WAVE`` replicas (each an engine and a worker) are up at once on this 2-core, 24 GiB machine.
A new family joins this test by its registry record.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Iterator

import pytest

from rbln_ray.families.registry import VISION
from tests.serve.conftest import RunningApp, free_port, start_app, stop_app

pytestmark = pytest.mark.slow

# TEST_VISION_FAMILIES=a,b limits a development run to some families (unset: every family)
FAMILIES = [f for f in VISION if f in (os.environ.get("TEST_VISION_FAMILIES") or f).split(",")]
WAVE = 3
# return_token_ids: vLLM adds the prompt and reply token ids to the response
GREEDY = {
    "max_tokens": 12,
    "temperature": 0,
    "extra_body": {"ignore_eos": True, "return_token_ids": True},
}
# An image of 32 x 32 patches of 14 pixels (16 x 16 of 16) when a request raises the budget
# to it: more than a tiny model's tower takes (256 patches).
LARGE, LARGE_BUDGET = (448, 448), {"min_pixels": 56 * 56, "max_pixels": 448 * 448}


def any_size(family: str) -> bool:
    """The family's images are any size (its processor has a pixel budget)."""
    return "max_pixels" in VISION[family].code().SPEC_DEFAULTS


def messages_with(image, question: str) -> list[dict]:
    from tests.vision import data_url

    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(image)}},
                {"type": "text", "text": question},
            ],
        }
    ]


TEXT_ONLY = [{"role": "user", "content": "no picture this time"}]


def wave_config(families: list[str]) -> dict:
    from tests.vision import compiled_vlm

    models = [
        {"name": f, "model": str(compiled_vlm(f)), "num_replicas": 1, "warm_up": False}
        for f in families
    ]
    # the pixel budget is a processor argument requests may raise (too_large) only when the
    # config allows it
    return {"models": models, "limits": {"allowed_mm_processor_kwargs": list(LARGE_BUDGET)}}


@pytest.fixture(scope="module")
def replies() -> Iterator[dict[str, dict]]:
    """family -> (its responses, what was asked: (messages, images) each), every family
    served by the one app, a wave at a time."""
    import openai
    from ray import serve

    from rbln_ray.serve import APP_NAME, build_app, load_config
    from tests.vision import make_image

    waves = [FAMILIES[i : i + WAVE] for i in range(0, len(FAMILIES), WAVE)]
    app: RunningApp = start_app(wave_config(waves[0]), free_port(), model_dir=None, devices=WAVE)
    out: dict[str, tuple[list, list]] = {}
    refused: dict[str, tuple[int, str]] = {}
    try:
        for n, wave in enumerate(waves):
            if n:
                config = load_config(wave_config(wave))
                serve.run(build_app(config), name=APP_NAME, route_prefix="/")
            client = openai.OpenAI(base_url=f"{app.url}/v1", api_key="unused", max_retries=0)
            image = make_image(7, 90, 60)
            asked = [(messages_with(image, "what is in the picture?"), [image]), (TEXT_ONLY, [])]
            with concurrent.futures.ThreadPoolExecutor(2 * WAVE) as pool:
                futures = {
                    family: [
                        pool.submit(
                            client.chat.completions.create, model=family, messages=m, **GREEDY
                        )
                        for m, _ in asked
                    ]
                    for family in wave
                }
                for family, fs in futures.items():
                    out[family] = ([f.result() for f in fs], asked)
            for family in filter(any_size, wave):
                refused[family] = too_large(client, family)
        yield {"replies": out, "refused": refused}
    finally:
        stop_app()


def too_large(client, family: str) -> tuple[int, str]:
    """(status, message) of a chat whose image, at a budget the request raises, is larger
    than the compiled tower; then the same chat at the model's own budget must be served."""
    import openai

    from tests.vision import make_image

    messages = messages_with(make_image(12, *LARGE), "?")
    try:
        client.chat.completions.create(
            model=family,
            messages=messages,
            max_tokens=2,
            extra_body={"mm_processor_kwargs": LARGE_BUDGET},
        )
        status, message = 200, ""
    except openai.BadRequestError as err:
        status, message = err.status_code, str(err)
    ok = client.chat.completions.create(model=family, messages=messages, max_tokens=2)
    assert ok.usage.completion_tokens == 2
    return status, message


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_with_a_data_url_image_equals_transformers(replies: dict, family: str) -> None:
    from transformers import AutoTokenizer

    from rbln_ray.models import build_tiny_vlm
    from tests.vision import hf_chat_prompt, hf_vlm_greedy

    model_dir = build_tiny_vlm(family=family)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    got, asked = replies["replies"][family]
    for response, (messages, images) in zip(got, asked, strict=True):
        prompt = hf_chat_prompt(model_dir, messages)
        want_prompt, want = hf_vlm_greedy(model_dir, prompt, images, GREEDY["max_tokens"])
        choice = response.choices[0]
        assert response.prompt_token_ids == want_prompt
        assert choice.token_ids == want
        # the text, but an incomplete UTF-8 character at the end (a byte-level token), which
        # vLLM's detokenizer holds back
        text = tokenizer.decode(want, skip_special_tokens=True)
        assert text.startswith(choice.message.content), (choice.message, want)
    assert got[0].choices[0].token_ids != got[1].choices[0].token_ids  # the image changed it


@pytest.mark.parametrize("family", [f for f in FAMILIES if any_size(f)])
def test_an_image_beyond_the_compiled_tower_is_a_400_naming_both_sizes(
    replies: dict, family: str
) -> None:
    """The image's patches (as the HF processor makes them at the raised budget) and the
    compiled tower's length (``rbln_config.json``) are both in the message."""
    import json

    from rbln_ray.compile.vision import load_hf_processor
    from tests.vision import compiled_vlm, make_image

    status, message = replies["refused"][family]
    assert status == 400, message
    processor = load_hf_processor(compiled_vlm(family))
    grid = processor.image_processor(images=[make_image(12, *LARGE)], **LARGE_BUDGET)
    patches = int(grid["image_grid_thw"][0].prod())
    compiled = json.loads((compiled_vlm(family) / "rbln_config.json").read_text())
    tower = compiled["visual"]["max_seq_len"]
    tower = max(tower) if isinstance(tower, list) else tower
    assert f"{patches} patches" in message and f"{tower} patches" in message, message
