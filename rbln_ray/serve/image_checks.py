"""Checks of the images in a chat request, made at the ingress before any replica sees them.

Why at the ingress: an image a model cannot use, a URL the app must not fetch, a broken or
oversized image are the client's errors; answering them with a 4xx here (an OpenAI-style
body, :func:`rbln_ray.serve.ingress.error_response`) costs no engine anything, and the
engine never decodes an image the ingress has not opened first. A data URL is decoded and
the image opened to read its size before its pixels are decoded (a decompression bomb is
refused by its header).
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Iterable, Iterator
from typing import Any

from rbln_ray.serve.config import RequestLimits

# Content parts that carry an image, by OpenAI's chat schema and vLLM's extensions, and the
# key of their URL.
_IMAGE_PARTS = {"image_url": "image_url", "input_image": "image_url"}


def image_urls(messages: Iterable[Any]) -> Iterator[str]:
    """Every image URL in the content parts of chat ``messages``."""
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in _IMAGE_PARTS:
                continue
            value = part.get(_IMAGE_PARTS[kind])
            url = value.get("url") if isinstance(value, dict) else value
            yield url if isinstance(url, str) else ""


def check_images(
    model: str, urls: list[str], accepts_images: bool, limits: RequestLimits
) -> tuple[int, str] | None:
    """(HTTP status, message) of the first problem with a request's images, or None."""
    if not urls:
        return None
    if not accepts_images:
        return 400, f"model {model!r} does not accept images (it is not a vision-language model)"
    for i, url in enumerate(urls):
        if not url.startswith("data:"):
            if limits.allow_remote_images and url.startswith(("http://", "https://")):
                continue
            return 400, (
                f"image {i}: only inline data: URLs are accepted "
                f"(got {url[:40]!r}); remote images are off (limits.allow_remote_images)"
            )
        problem = _check_data_url(i, url, limits.max_image_pixels)
        if problem is not None:
            return problem
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
