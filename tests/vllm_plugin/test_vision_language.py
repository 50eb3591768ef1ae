"""Vision-language models through ``vllm.LLM`` on RBLN, token-exact against transformers
(acceptance 2 of the pooling/vision issue, the offline half; the HTTP half, for a
fixed-size family and an any-size one, is in ``tests/serve/test_openai_app.py``).

One engine per vision-language family of the registry (a tiny model of each, compiled batch
4 on the emulator by the code path ``rbln-ray compile`` uses) runs every request at once:
images of several sizes (the Qwen families: 4 to 64 tokens an image, as the processor
resizes, a skinny one of one 40-token row, which a windowed tower runs in its longer compiled
graph, and the largest straddling the 128-token chunk boundary), two images in one prompt
where the family takes several, a prompt whose image lies past its first 128-token prefill
chunk (families that place images before the text: a long text after it), the same image
twice (vLLM's processor cache sends it to the engine once), and a text-only prompt; for the
families with videos (numpy frames through ``multi_modal_data={"video": ...}``) a video, an
image and a video of an odd number of frames in one prompt, and an eight-frame video past a
long text. Each must give the prompt token ids and the greedy tokens transformers' own
``generate`` gives on the HF processor's inputs. A second engine per family checks prefix
caching where the family has it: two long prompts with the same text after different images
(and, for families with videos, two after different videos), run twice; the second pass
reuses each prompt's own cached first block (vLLM keys a block by the media in it), never the
other's; for the Qwen families the tokens after the cached block still take M-RoPE positions
that depend on the cached item's grid. A new family joins every test here by its registry
record (what it supports decides which requests and expectations apply).
"""

from __future__ import annotations

import json
import os

import pytest

from rbln_ray.families.registry import VISION
from rbln_ray.models import build_tiny_vlm
from rbln_ray.models.vision import image_placeholder
from tests.helpers import SCRIPTS, run_python
from tests.vision import (
    CAUSAL_TOKEN_TYPE,
    LARGE,
    LARGE_BUDGET,
    compiled_vlm,
    hf_chat_prompt,
    hf_reference,
    hf_vlm_greedy,
    image_chat,
    image_spec,
    make_image,
    make_video,
    video_spec,
)

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
CHUNK = 128  # the compiled prefill_chunk_size


def chat(body: str) -> str:
    return f"<|user|>\n{body}\n<|assistant|>\n"


def any_size(family: str) -> bool:
    """The family's images are any size (its processor has a pixel budget: the Qwen ones)."""
    return "max_pixels" in VISION[family].code().SPEC_DEFAULTS


def requests_of(family: str) -> list:
    """(prompt, images, videos) of the first engine of ``family``: ``<image>`` and
    ``<video>`` stand for the family's placeholders."""
    record = VISION[family]
    img = image_placeholder(family)
    requests = [
        (chat("<image>describe the image"), [image_spec(1)]),
        (chat("no image here, only text"), []),
        (chat("<image>what colour is it?"), [image_spec(1)]),  # the first request's image again
        (chat("<image>"), [image_spec(5, 200, 100)]),
    ]
    if record.max_images is None or record.max_images >= 2:
        two = [image_spec(2), image_spec(3, 30, 90)]
        requests.append((chat("<image> and <image>: which is brighter?"), two))
    if record.images_at_start:  # the image first, the text past the first chunk
        requests.append((chat("<image>" + "x = 1\n" * 40 + "what is this?"), [image_spec(4)]))
    else:
        requests.append((chat("x = 1\n" * 40 + "<image>what is this?"), [image_spec(4)]))
    if any_size(family):
        # the largest image the processor makes (64 tokens) across 128
        requests.append((chat("z = 3\n" * 24 + "<image>and now?"), [image_spec(9, 224, 224)]))
        # a skinny one: one row of 40 tokens (windowed towers pad it to their longer graph)
        requests.append((chat("<image>a long thin one"), [image_spec(10, 1120, 28)]))
    requests = [(prompt, images, []) for prompt, images in requests]
    if "video" in record.inputs:  # numpy frames
        requests += [
            (chat("<video>describe the video"), [], [video_spec(1)]),
            # an odd number of frames (the last repeated), after an image
            (chat("<image> and <video>: the same?"), [image_spec(2)], [video_spec(2, frames=5)]),
            # eight frames, past a long text
            (chat("v = 5\n" * 28 + "<video>and this?"), [], [video_spec(3, 8, 96, 96)]),
        ]
    vid = record.code().VIDEO_PLACEHOLDER
    return [
        (as_prompt(family, prompt.replace("<image>", img).replace("<video>", vid)), images, videos)
        for prompt, images, videos in requests
    ]


def cached_of(family: str) -> list:
    """Same text, different images at the start: their first 128-token blocks differ by the
    image."""
    text = image_placeholder(family) + "y = 2\n" * 40 + "what now?"
    cached = [(chat(text), [image_spec(6)], []), (chat(text), [image_spec(8)], [])]
    if "video" in VISION[family].inputs:  # and the same after different videos
        text = VISION[family].code().VIDEO_PLACEHOLDER + "y = 2\n" * 40 + "what now?"
        cached += [(chat(text), [], [video_spec(6)]), (chat(text), [], [video_spec(8)])]
    return [(as_prompt(family, p), i, v) for p, i, v in cached]


def as_prompt(family: str, prompt: str) -> str:
    """PaliGemma's generation prompt ends without a newline: its processor appends one
    (transformers' always, vLLM's unless the prompt ends with one)."""
    return prompt.removesuffix("\n") if family == "paligemma" else prompt


# TEST_VISION_FAMILIES=a,b limits a development run to some families (unset: every family)
FAMILIES = [  # the image families (an audio one, Qwen3-ASR, is test_speech.py's)
    f
    for f in VISION
    if not VISION[f].transcribes and f in (os.environ.get("TEST_VISION_FAMILIES") or f).split(",")
]
REQUESTS = {family: requests_of(family) for family in FAMILIES}
CACHED = {family: cached_of(family) for family in FAMILIES}


# A chat with a ``data:`` URL image and a text-only chat, through ``LLM.chat``: vLLM's chat
# path (the family's template, its placeholders) as its OpenAI server renders it, for every
# family; what only HTTP adds (the ingress's media policy, the 400) is the same for every
# family and is checked for one of each kind in tests/serve/test_openai_app.py.
CHAT_IMAGE = image_spec(7, 90, 60)
CHAT_PARAMS = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}


def chats() -> list[tuple[list[dict], list[dict]]]:
    """(messages, image specs) of the chats each family's first engine answers."""
    with_image = image_chat(make_image(**CHAT_IMAGE), "what is in the picture?")
    return [(with_image, [CHAT_IMAGE]), ([{"role": "user", "content": "no picture this time"}], [])]


def too_large_chat() -> dict:
    """A chat whose image, at the budget it raises, is larger than the compiled tower (JPEG:
    only its size counts)."""
    return {
        "messages": image_chat(make_image(12, *LARGE), "?", fmt="JPEG"),
        "params": {"max_tokens": 2},
        "mm_processor_kwargs": LARGE_BUDGET,
    }


# Gemma 4: an image budget (max_soft_tokens) the tiny model's tower was not compiled for
OTHER_BUDGET = 140


def refused_chat(family: str) -> dict | None:
    """The chat each family's engine must refuse before running it, if any: an image past
    the compiled tower (any-size families), an image budget it was not compiled for (Gemma 4)."""
    if any_size(family):
        return too_large_chat()
    if family == "gemma4_vl":
        return {**too_large_chat(), "mm_processor_kwargs": {"max_soft_tokens": OTHER_BUDGET}}
    return None


def engine_run(family: str, requests: list, **extra) -> dict:
    return {
        "model": str(compiled_vlm(family)),
        "requests": [
            {
                "prompt": prompt,
                "images": images,
                "videos": videos,
                "params": {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True},
            }
            for prompt, images, videos in requests
        ],
        "rpc": ["step_stats"],
        **extra,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """Every engine of this module in one subprocess (vLLM imported once): per family, the
    requests' engine (which also answers :func:`chats`) and the prefix-cache engine."""
    asked = [{"messages": m, "params": CHAT_PARAMS} for m, _ in chats()]
    spec = {
        "runs": [
            engine
            for family in FAMILIES
            for engine in (
                engine_run(
                    family,
                    REQUESTS[family],
                    chats=asked,
                    **({"refused_chat": refused_chat(family)} if refused_chat(family) else {}),
                ),
                engine_run(family, CACHED[family], passes=2),
            )
        ]
    }
    path = tmp_path_factory.mktemp("vision-spec") / "spec.json"  # data: URLs: a long spec
    path.write_text(json.dumps(spec))
    result, _ = run_python([str(SCRIPTS / "rbln_llm_run.py"), f"@{path}"], timeout=900)
    assert all("error" not in r for r in result["runs"]), result["runs"]
    return {family: result["runs"][2 * i : 2 * i + 2] for i, family in enumerate(FAMILIES)}


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_images_matches_transformers(runs: dict, family: str) -> None:
    run, hf_dir = runs[family][0], build_tiny_vlm(family=family)
    for i, (prompt, images, videos) in enumerate(REQUESTS[family]):
        want_prompt, want = hf_vlm_greedy(
            hf_dir,
            prompt,
            [make_image(**s) for s in images],
            MAX_TOKENS,
            videos=[make_video(**v) for v in videos],
        )
        assert run["prompt_token_ids"][i] == want_prompt, i
        assert run["outputs"][i][0]["token_ids"] == want, i


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_with_a_data_url_image_equals_transformers(runs: dict, family: str) -> None:
    """``LLM.chat`` with an image as a ``data:`` URL, and without one: the prompt the HF
    processor's chat template renders, and transformers' greedy tokens on it."""
    hf_dir = build_tiny_vlm(family=family)
    got = runs[family][0]["chats"]
    for answer, (messages, images) in zip(got, chats(), strict=True):
        prompt = hf_chat_prompt(hf_dir, messages)
        want_prompt, want = hf_vlm_greedy(
            hf_dir, prompt, [make_image(**s) for s in images], MAX_TOKENS
        )
        assert answer["prompt_token_ids"] == want_prompt
        assert answer["token_ids"] == want
    assert got[0]["token_ids"] != got[1]["token_ids"]  # the image changed it


@pytest.mark.parametrize("family", [f for f in FAMILIES if any_size(f)])
def test_an_image_beyond_the_compiled_tower_is_refused_naming_both_sizes(
    runs: dict, family: str
) -> None:
    """A chat raising the pixel budget (``mm_processor_kwargs``) past what the compiled
    vision tower takes is refused with the image's patches (as the HF processor makes them)
    and the tower's length (``rbln_config.json``); the engine then answers the chats of
    :func:`test_chat_with_a_data_url_image_equals_transformers`. Over HTTP this is a 400
    (tests/serve/test_openai_app.py)."""
    from rbln_ray.compile.vision import load_hf_processor

    message = runs[family][0]["refused_chat"]
    processor = load_hf_processor(compiled_vlm(family))
    grid = processor.image_processor(images=[make_image(12, *LARGE)], **LARGE_BUDGET)
    patches = int(grid["image_grid_thw"][0].prod())
    compiled = json.loads((compiled_vlm(family) / "rbln_config.json").read_text())
    tower = compiled["visual"]["max_seq_len"]
    tower = max(tower) if isinstance(tower, list) else tower
    assert f"{patches} patches" in message and f"{tower} patches" in message, message


@pytest.mark.parametrize("family", [f for f in FAMILIES if f == "gemma4_vl"])
def test_an_image_budget_the_tower_was_not_compiled_for_is_refused(runs: dict, family: str) -> None:
    """A chat asking Gemma 4's processor for another ``max_soft_tokens`` than the compiled
    tower takes is refused naming both (optimum's tower runs only its compiled patch counts);
    the engine then answers the chats of test_chat_with_a_data_url_image_equals_transformers."""
    message = runs[family][0]["refused_chat"]
    assert f"max_soft_tokens={OTHER_BUDGET}" in message and "[70]" in message, message


@pytest.mark.parametrize("family", FAMILIES)
def test_images_change_the_output(family: str) -> None:
    """The reference is sensitive to the image, so matching it means the image was seen."""
    hf_dir = build_tiny_vlm(family=family)
    prompt = REQUESTS[family][0][0]
    _, first = hf_vlm_greedy(hf_dir, prompt, [make_image(1)], MAX_TOKENS)
    _, other = hf_vlm_greedy(hf_dir, prompt, [make_image(99)], MAX_TOKENS)
    assert first != other


@pytest.mark.parametrize("family", [f for f in FAMILIES if f in CAUSAL_TOKEN_TYPE])
def test_bidirectional_prefill_changes_the_output(family: str) -> None:
    """Where the prefill attends partly bidirectionally (PaliGemma's whole prompt, Gemma3's
    images), the reference's tokens depend on it, so matching it means the compiled prefill
    attended so too."""
    hf_dir = build_tiny_vlm(family=family)
    prompt, specs, _ = REQUESTS[family][0]
    images = [make_image(**s) for s in specs]
    _, want = hf_vlm_greedy(hf_dir, prompt, images, MAX_TOKENS)
    _, causal = hf_vlm_greedy(hf_dir, prompt, images, MAX_TOKENS, causal=True)
    assert want != causal


@pytest.mark.parametrize("family", [f for f in FAMILIES if f == "gemma4_vl"])
def test_optimums_own_image_prefill_differs_from_transformers(family: str) -> None:
    """Why rbln-ray prefills a Gemma 4 image prompt causally with its own per-layer inputs
    (rbln_ray.families.gemma4_vl): optimum-rbln's own ``generate`` on the same compiled model
    (its image_prefill graphs, bidirectional on every layer, and per-layer inputs from the
    image token) gives other tokens than transformers, which the engine's match
    (test_greedy_with_images_matches_transformers). With ``use_bidirectional_attention:
    "vision"`` transformers gives tokens neither graph gives (bidirectional on the sliding
    layers only): the engine start refuses a model whose text config asks for it."""
    import torch

    from rbln_ray.compile.vision import load_hf_processor
    from rbln_ray.emulator.switch import require_runtime
    from rbln_ray.families.gemma4_vl import BIDIRECTIONAL_REASON, Embedder

    require_runtime("load a compiled model")
    import optimum.rbln

    model = optimum.rbln.RBLNGemma4ForConditionalGeneration.from_pretrained(
        str(compiled_vlm(family))
    )
    hf_dir = build_tiny_vlm(family=family)
    prompt, specs, _ = REQUESTS[family][0]
    images = [make_image(**s) for s in specs]
    prompt_ids, want = hf_vlm_greedy(hf_dir, prompt, images, MAX_TOKENS)
    inputs = load_hf_processor(hf_dir)(images=images, text=[prompt], return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == prompt_ids
    model.generation_config.eos_token_id = None  # as the reference: every token generated
    out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    image_prefill = out[0, len(prompt_ids) :].tolist()
    assert image_prefill != want and len(image_prefill) == len(want)
    # transformers with bidirectional sliding layers (the image's tokens marked as its
    # processor marks them)
    reference, _ = hf_reference(hf_dir)  # the one hf_vlm_greedy ran, set back after
    marked = (inputs["input_ids"] == reference.config.image_token_id).long()
    text_config = reference.config.text_config
    before = text_config.use_bidirectional_attention
    text_config.use_bidirectional_attention = "vision"
    try:
        with torch.no_grad():
            vision = reference.generate(
                **inputs, mm_token_type_ids=marked, max_new_tokens=MAX_TOKENS, do_sample=False
            )
    finally:
        text_config.use_bidirectional_attention = before
    vision = vision[0, len(prompt_ids) :].tolist()
    assert vision != want and vision != image_prefill
    model.config.text_config.use_bidirectional_attention = "vision"
    with pytest.raises(ValueError, match="use_bidirectional_attention='vision'") as refused:
        Embedder(model)
    assert BIDIRECTIONAL_REASON in str(refused.value)


@pytest.mark.parametrize("family", [f for f in FAMILIES if "video" in VISION[f].inputs])
def test_videos_change_the_output(family: str) -> None:
    """As for images: the reference is sensitive to the video's frames and to their order."""
    hf_dir = build_tiny_vlm(family=family)
    (prompt, _, [spec]) = next(r for r in REQUESTS[family] if r[2] and not r[1])
    video = make_video(**spec)
    _, first = hf_vlm_greedy(hf_dir, prompt, [], MAX_TOKENS, videos=[video])
    _, other = hf_vlm_greedy(hf_dir, prompt, [], MAX_TOKENS, videos=[video[::-1].copy()])
    assert first != other


@pytest.mark.parametrize("family", [f for f in FAMILIES if any_size(f)])
def test_images_are_as_many_tokens_as_their_size_and_lie_where_asked(
    runs: dict, family: str
) -> None:
    """The Qwen families' processors resize each image to multiples of the merged token
    within their budget, one token per merged patch: the prompts above cover images of
    several token counts, an image past the first prefill chunk and one across the chunk
    boundary."""
    from rbln_ray.compile.vision import load_hf_processor

    pad = load_hf_processor(build_tiny_vlm(family=family)).image_token_id
    spans = []
    for ids in runs[family][0]["prompt_token_ids"]:
        where = [i for i, t in enumerate(ids) if t == pad]
        spans.append((where[0], where[-1] + 1, len(where)) if where else None)
    assert len({s[2] for s in spans if s}) >= 4  # images of (at least) four token counts
    assert spans[5][0] > CHUNK  # the image lies past the first 128-token chunk
    assert spans[6][0] < CHUNK < spans[6][1]  # the largest image straddles the boundary


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_cache_hits_are_keyed_by_the_image(runs: dict, family: str) -> None:
    """Where the family has prefix caching; where it has not, the engine says so (and the
    second pass is still exact, recomputed)."""
    cached = runs[family][1]
    hf_dir = build_tiny_vlm(family=family)
    wants = []
    for i, (prompt, images, videos) in enumerate(CACHED[family]):
        media = [make_image(**s) for s in images]
        _, want = hf_vlm_greedy(
            hf_dir, prompt, media, MAX_TOKENS, videos=[make_video(**v) for v in videos]
        )
        for n, outputs in enumerate(cached["passes"]):
            assert outputs[i][0]["token_ids"] == want, (i, n)
        wants.append(want)
    assert len(cached["prompt_token_ids"][0]) > CHUNK
    reused = cached["rpc"]["step_stats"][0]["prefix_reused_tokens"]
    if not VISION[family].prefix_caching:
        assert not cached["config"]["enable_prefix_caching"] and reused == 0
        return
    # the image (video) decides the answer, so a wrong hit would show
    assert all(wants[i] != wants[i + 1] for i in range(0, len(wants), 2))
    assert cached["config"]["enable_prefix_caching"]
    # the second pass reused one cached 128-token block per prompt; the first reused none
    assert reused == len(CACHED[family]) * CHUNK


@pytest.mark.parametrize("family", FAMILIES)
def test_requests_share_the_batch_and_long_prompts_are_chunked(runs: dict, family: str) -> None:
    run = runs[family][0]
    stats = run["rpc"]["step_stats"][0]
    assert stats["prefill_requests"] == len(REQUESTS[family])
    # prompts over 128 tokens span two chunks: one prefill call more each (a family without
    # chunked prefill prefills each prompt in one step)
    long = sum(len(ids) > CHUNK for ids in run["prompt_token_ids"])
    assert long >= 1
    extra = long if VISION[family].chunked_prefill else 0
    assert stats["prefill_steps"] == len(REQUESTS[family]) + extra
    # several requests decoded together in one compiled batch
    assert max(len(ids) for _, kind, ids in stats["history"] if kind == "decode") > 1
