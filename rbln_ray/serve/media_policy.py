"""What media a chat request may carry, decided at the ingress before any replica sees it.

Why at the ingress, and why vLLM's own parser: an image a model cannot use, a URL the app
must not fetch, a broken or oversized image are the client's errors; answering them with a
4xx here (an OpenAI-style body, :func:`rbln_ray.serve.ingress.error_response`) costs no engine
anything. The replica parses a message's content parts with vLLM's chat parser, which also
takes parts without a ``type`` (``{"image_url": "http://..."}``), ``video_url``,
``audio_url``, ``input_audio``, precomputed ``*_embeds`` and cache references by ``uuid``; a
check that walked only typed ``image_url`` parts could be bypassed (a replica would fetch any
URL: server-side request forgery). So every part is classified by vLLM's own function
(:func:`rbln_ray.upstream.vllm_internals.content_part`), and the replica is also told to fetch
nothing remote unless configured (:func:`replica_media_args`): two locks, either enough.

A data URL is decoded and the image opened to read its size before its pixels are decoded (a
decompression bomb is refused by its header); that work runs off the event loop
(:func:`check_media` is called in a thread).
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from rbln_ray.serve.config import RequestLimits

# A host name that never resolves (RFC 2606): vLLM's "only these domains" for a replica that
# must fetch nothing remote (an empty list means "any domain" to vLLM).
NO_REMOTE_DOMAIN = "remote-media-disabled.invalid"
IMAGE_PARTS = ("image_url", "input_image")
OTHER_MEDIA = {
    "video_url": "video",
    "audio_url": "audio",
    "input_audio": "audio",
}
# parts a request may not carry: precomputed embeddings skip every check of the media
NOT_ACCEPTED = ("image_embeds", "audio_embeds", "video_embeds", "prompt_embeds", "image_pil")


@dataclass(frozen=True)
class MediaPart:
    """One non-text content part, as vLLM's parser reads it."""

    kind: str  # vLLM's part type (image_url, video_url, image_embeds, ...)
    content: Any  # a URL for *_url parts
    uuid: Any = None


def media_parts(messages: Iterable[Any]) -> Iterator[MediaPart]:
    """Every non-text content part of chat ``messages`` (typed or not)."""
    from rbln_ray.upstream.vllm_internals import content_part

    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict):
                continue
            kind, value = content_part(part)
            if kind in ("text", "input_text", "output_text", "refusal", "thinking"):
                continue
            yield MediaPart(kind, value, part.get("uuid"))


def request_media_parts(path: str, body: dict[str, Any]) -> Iterator[MediaPart]:
    """Every non-text content part of a request body of any route: chat messages (one
    conversation, or a batch of them), a Responses API ``input``, Anthropic ``messages``
    (whose image blocks vLLM turns into image URLs)."""
    if path.startswith("/v1/messages"):
        yield from media_parts(_anthropic_as_chat(body.get("messages")))
        return
    if path.startswith("/v1/responses"):
        value = body.get("input")
        if isinstance(value, list):
            yield from media_parts(_responses_as_chat(value))
        return
    messages = body.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[0], list):
        for conversation in messages:  # /v1/chat/completions/batch
            yield from media_parts(conversation)
    elif isinstance(messages, list):
        yield from media_parts(messages)


def _responses_as_chat(items: list[Any]) -> Iterator[dict[str, Any]]:
    """Responses API input items as the chat messages vLLM makes of them: a message's
    ``content``, and a tool result's ``output`` (``function_call_output``: vLLM turns it into
    a tool message whose content parts, images included, its chat parser reads)."""
    for item in items:
        if not isinstance(item, dict):
            continue
        for field in ("content", "output"):
            if isinstance(item.get(field), list):
                yield {"content": item[field]}


def _anthropic_as_chat(messages: Any) -> Iterator[dict[str, Any]]:
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            yield {"content": list(_anthropic_parts(content))}


def _anthropic_parts(blocks: list[Any]) -> Iterator[dict[str, Any]]:
    """Anthropic image blocks as the image URLs vLLM makes of them (a base64 source becomes a
    data URL), also inside tool results."""
    for block in blocks:
        if not isinstance(block, dict):
            continue
        if block.get("type") == "image":
            source = block.get("source") if isinstance(block.get("source"), dict) else {}
            url = None
            if source.get("type") == "base64":
                url = f"data:{source.get('media_type')};base64,{source.get('data')}"
            elif source.get("type") == "url":
                url = source.get("url")
            yield {"type": "image_url", "image_url": {"url": url}}
        elif block.get("type") == "tool_result" and isinstance(block.get("content"), list):
            yield from _anthropic_parts(block["content"])


def check_media(
    model: str, parts: list[MediaPart], accepts: tuple[str, ...], limits: RequestLimits
) -> tuple[int, str] | None:
    """(HTTP status, message) of the first problem with a request's media, or None.
    ``accepts``: the media the model takes (``("image",)`` for a vision-language model)."""
    images = [p for p in parts if p.kind in IMAGE_PARTS]
    if len(images) > limits.max_images:
        return 400, (
            f"the request carries {len(images)} images, more than limits.max_images "
            f"= {limits.max_images}"
        )
    for i, part in enumerate(parts):
        if part.kind in NOT_ACCEPTED:
            return 400, f"content part {i}: {part.kind} inputs are not accepted"
        if part.uuid is not None and part.content is None:
            return 400, f"content part {i}: a media reference by uuid alone is not accepted"
        media = "image" if part.kind in IMAGE_PARTS else OTHER_MEDIA.get(part.kind)
        if media is None:
            continue  # vLLM refuses an unknown part type itself, with a 400
        if media not in accepts:
            return 400, f"model {model!r} does not accept {media} inputs"
        if media == "video":
            return 400, f"content part {i}: {media} inputs are not served yet"
        if media == "audio":
            problem = _check_audio(i, part.kind, part.content, limits)
            if problem is not None:
                return problem
    for i, part in enumerate(images):
        problem = _check_image(i, part.content, limits)
        if problem is not None:
            return problem
    return None


def _check_image(i: int, url: Any, limits: RequestLimits) -> tuple[int, str] | None:
    if not isinstance(url, str) or not url:
        return 400, f"image {i}: no URL"
    if not url.startswith("data:"):
        if limits.allow_remote_images and url.startswith(("http://", "https://")):
            return None
        return 400, (
            f"image {i}: only inline data: URLs are accepted "
            f"(got {url[:40]!r}); remote images are off (limits.allow_remote_images)"
        )
    return _check_data_url(i, url, limits.max_image_pixels)


def _check_audio(i: int, kind: str, content: Any, limits: RequestLimits) -> tuple[int, str] | None:
    """An audio part of a chat request (a speech-to-text model's): inline only (the base64
    data of ``input_audio``, or a ``data:`` URL), a file libsndfile reads (the replica then
    never starts FFmpeg on it, :mod:`rbln_ray.serve.audio`), at most
    ``limits.max_audio_seconds`` long."""
    from rbln_ray.serve.audio import check_audio, readable_by_libsndfile

    if kind == "input_audio":
        data = content.get("data") if isinstance(content, dict) else None
    elif isinstance(content, str) and content.startswith("data:"):
        header, sep, data = content.partition(",")
        if not sep or not header.endswith(";base64"):
            return 400, f"audio {i}: a data URL must be 'data:audio/<type>;base64,<data>'"
    else:
        return 400, (
            f"audio {i}: only inline audio is accepted (input_audio, or a data: URL); "
            "remote audio is not fetched"
        )
    try:
        raw = base64.b64decode(data or "", validate=True)
    except (binascii.Error, ValueError) as exc:
        return 400, f"audio {i}: the data is not valid base64 ({exc})"
    problem = check_audio(raw, limits)
    if problem is not None:
        return problem[0], f"audio {i}: {problem[1].removeprefix('file: ')}"
    if not readable_by_libsndfile(raw):
        return 400, (
            f"audio {i}: not a WAV, FLAC, Ogg or MP3 file; upload other formats to "
            "/v1/audio/transcriptions, which converts them"
        )
    return None


def _check_data_url(i: int, url: str, max_pixels: int) -> tuple[int, str] | None:
    from PIL import Image, UnidentifiedImageError

    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        return 400, f"image {i}: a data URL must be 'data:image/<type>;base64,<data>'"
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        return 400, f"image {i}: the data URL is not valid base64 ({exc})"
    try:
        with Image.open(io.BytesIO(raw)) as image:
            width, height = image.size
            if width * height > max_pixels:
                return 413, (
                    f"image {i} is {width}x{height} = {width * height} pixels, above the "
                    f"limit of {max_pixels} (limits.max_image_pixels)"
                )
            image.load()
    except Image.DecompressionBombError as exc:
        return 413, f"image {i}: {exc}"
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        return 400, f"image {i} cannot be decoded as an image: {exc}"
    return None


def check_processor_kwargs(parsed: Any, limits: RequestLimits) -> tuple[int, str] | None:
    """A request's ``mm_processor_kwargs`` / ``media_io_kwargs`` may only name what the
    config allows (they change how the HF processor resizes an image, before any check)."""
    allowed = {
        "mm_processor_kwargs": set(limits.allowed_mm_processor_kwargs),
        "media_io_kwargs": set(limits.allowed_media_io_kwargs),
    }
    for field, names in allowed.items():
        given = (
            parsed.get(field) if isinstance(parsed, dict) else getattr(parsed, field, None)
        ) or {}
        if not isinstance(given, dict):
            continue  # the request model refuses it
        refused = sorted(set(given) - names)
        if refused:
            return 400, (f"{field} {refused} not allowed (limits.allowed_{field}: {sorted(names)})")
    return None


def replica_media_args(limits: RequestLimits, media: Sequence[str]) -> dict[str, Any]:
    """vLLM engine arguments that make a replica enforce the same policy: at most
    ``max_images`` images a prompt (a model whose ``media`` include images), and no remote
    fetch unless allowed (then only from the allowed domains, if any are named)."""
    args: dict[str, Any] = {}
    if "image" in media:
        args["limit_mm_per_prompt"] = {"image": limits.max_images}
    if not limits.allow_remote_images:
        args["allowed_media_domains"] = [NO_REMOTE_DOMAIN]
    elif limits.allowed_media_domains:
        args["allowed_media_domains"] = list(limits.allowed_media_domains)
    return args
