"""The ingress's media policy (``rbln_ray.serve.media_policy``): which chat requests' media
are refused, with which status and message, before any replica sees them; every content
part is read as vLLM's own chat parser reads it, typeless parts included."""

from __future__ import annotations

import base64
import io
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from rbln_ray.serve.config import RequestLimits
from rbln_ray.serve.media_policy import (
    NO_REMOTE_DOMAIN,
    check_media,
    check_processor_kwargs,
    media_parts,
    replica_media_args,
)

IMAGES = ("image",)
AUDIO = ("audio",)


def png_url(width: int, height: int) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def wav_b64(seconds: float) -> str:
    """A silent 16 kHz mono WAV of ``seconds``, base64 (what ``input_audio`` carries)."""
    from rbln_ray.models.speech import wav_bytes

    return base64.b64encode(wav_bytes(np.zeros(int(seconds * 16000), np.float32))).decode()


def user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def check(messages: list[dict], accepts=IMAGES, **limits):
    return check_media("m", list(media_parts(messages)), accepts, RequestLimits(**limits))


def test_every_media_part_is_found_typed_or_not() -> None:
    messages = [
        {"role": "system", "content": "plain text"},
        *user(
            {"type": "text", "text": "a"},
            {"type": "image_url", "image_url": {"url": "data:x"}},
            {"type": "input_image", "image_url": "https://h/i.png", "detail": "auto"},
            {"image_url": "http://127.0.0.1:9/typeless.png"},  # vLLM takes it without a type
            {"video_url": {"url": "http://h/v.mp4"}},
        ),
    ]
    parts = list(media_parts(messages))
    assert [(p.kind, p.content) for p in parts] == [
        ("image_url", "data:x"),
        ("input_image", "https://h/i.png"),
        ("image_url", "http://127.0.0.1:9/typeless.png"),
        ("video_url", "http://h/v.mp4"),
    ]


def test_a_good_image_passes_and_text_only_requests_are_untouched() -> None:
    assert check(user({"type": "image_url", "image_url": {"url": png_url(32, 24)}})) is None
    assert check(user({"type": "text", "text": "hi"}), accepts=()) is None


@pytest.mark.parametrize(
    ("part", "accepts", "status", "needle"),
    [
        ({"type": "image_url", "image_url": {"url": png_url(4, 4)}}, (), 400,
         "does not accept image"),
        ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, IMAGES, 400,
         "data: urls"),
        ({"image_url": "http://127.0.0.1:9/x.png"}, IMAGES, 400, "data: urls"),  # typeless
        ({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}, IMAGES, 400,
         "data: urls"),
        ({"type": "image_url", "image_url": {"url": "data:image/png,rawbytes"}}, IMAGES, 400,
         "base64"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}, IMAGES, 400,
         "not valid base64"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,"
          + base64.b64encode(b"not an image").decode()}}, IMAGES, 400, "cannot be decoded"),
        ({"type": "image_url", "image_url": {"url": png_url(300, 200)}}, IMAGES, 413,
         "60000 pixels"),
        ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, IMAGES, 400,
         "does not accept video"),
        ({"audio_url": "http://h/a.wav"}, IMAGES, 400, "does not accept audio"),
        ({"audio_url": "http://h/a.wav"}, AUDIO, 400, "remote audio is not fetched"),
        ({"type": "audio_url", "audio_url": {"url": "data:audio/wav,raw"}}, AUDIO, 400,
         "base64"),
        ({"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}}, AUDIO, 400,
         "not valid base64"),
        ({"type": "input_audio", "input_audio": {"data": base64.b64encode(b"no audio").decode(),
          "format": "wav"}}, AUDIO, 400, "audio 0"),

        ({"type": "image_embeds", "image_embeds": "AAAA"}, IMAGES, 400, "not accepted"),
        ({"image_url": None, "uuid": "someone-elses-image"}, IMAGES, 400, "not accepted"),
    ],
)  # fmt: skip
def test_bad_media_are_refused_naming_the_problem(
    part: dict, accepts: tuple, status: int, needle: str
) -> None:
    try:
        problem = check(user(part), accepts=accepts, max_image_pixels=50_000)
    except ValueError as exc:  # vLLM's parser refuses a part it cannot read (the ingress: 400)
        problem = (400, str(exc))
    assert problem is not None and problem[0] == status
    assert needle in problem[1].lower(), problem[1]


def test_inline_audio_passes_for_a_speech_to_text_model_within_the_limits() -> None:
    clip = {"type": "input_audio", "input_audio": {"data": wav_b64(2.0), "format": "wav"}}
    assert check(user(clip), accepts=AUDIO) is None
    as_url = {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + wav_b64(1)}}
    assert check(user(as_url), accepts=AUDIO) is None
    problem = check(user(clip), accepts=AUDIO, max_audio_seconds=1)
    assert problem == (
        400,
        "audio 0: the audio is 2.0 s long, more than limits.max_audio_seconds = 1",
    )
    video = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    problem = check(user(video), accepts=("image", "video"))
    assert problem is not None and "not served yet" in problem[1]


def test_remote_images_pass_only_when_allowed() -> None:
    remote = user({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}})
    assert check(remote, allow_remote_images=True) is None
    # still only web URLs: a local file is never fetched
    local = user({"type": "image_url", "image_url": {"url": "file:///x"}})
    problem = check(local, allow_remote_images=True)
    assert problem is not None and problem[0] == 400


def test_more_images_than_the_limit_are_refused_before_any_is_decoded() -> None:
    broken = {"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}
    problem = check(user(*[broken] * 3), max_images=2)
    assert problem == (400, "the request carries 3 images, more than limits.max_images = 2")


def test_a_truncated_image_is_refused() -> None:
    full = base64.b64decode(png_url(64, 64).partition(",")[2])
    url = "data:image/png;base64," + base64.b64encode(full[: len(full) // 2]).decode()
    problem = check(user({"type": "image_url", "image_url": {"url": url}}))
    assert problem is not None and problem[0] == 400


def test_processor_kwargs_only_from_the_allow_list() -> None:
    asked = SimpleNamespace(mm_processor_kwargs={"min_pixels": 10**8}, media_io_kwargs=None)
    problem = check_processor_kwargs(asked, RequestLimits())
    assert problem is not None and "min_pixels" in problem[1]
    allowed = RequestLimits(allowed_mm_processor_kwargs=["min_pixels"])
    assert check_processor_kwargs(asked, allowed) is None


def test_replicas_fetch_nothing_remote_unless_allowed() -> None:
    assert replica_media_args(RequestLimits(), IMAGES) == {
        "limit_mm_per_prompt": {"image": 8},
        "allowed_media_domains": [NO_REMOTE_DOMAIN],
    }
    some = RequestLimits(allow_remote_images=True, allowed_media_domains=["img.example.com"])
    assert replica_media_args(some, ()) == {"allowed_media_domains": ["img.example.com"]}
    assert replica_media_args(RequestLimits(allow_remote_images=True), ()) == {}
    # a speech-to-text model's clips per prompt are its processor's (one): no image limit
    assert replica_media_args(RequestLimits(), AUDIO) == {
        "allowed_media_domains": [NO_REMOTE_DOMAIN]
    }
