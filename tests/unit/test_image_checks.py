"""The ingress's image checks (``rbln_ray.serve.image_checks``): which chat requests' images
are refused, with which status and message, before any replica sees them."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from rbln_ray.serve.config import RequestLimits
from rbln_ray.serve.image_checks import check_images, image_urls


def png_url(width: int, height: int) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_image_urls_walks_every_image_part() -> None:
    messages = [
        {"role": "system", "content": "plain text"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "a"},
                {"type": "image_url", "image_url": {"url": "data:x"}},
                {"type": "input_image", "image_url": "https://h/i.png"},
            ],
        },
    ]
    assert list(image_urls(messages)) == ["data:x", "https://h/i.png"]


def test_a_good_image_passes_and_text_only_requests_are_untouched() -> None:
    limits = RequestLimits()
    assert check_images("m", [png_url(32, 24)], True, limits) is None
    assert check_images("m", [], False, limits) is None


@pytest.mark.parametrize(
    ("url", "accepts", "status", "needle"),
    [
        (png_url(4, 4), False, 400, "does not accept images"),
        ("https://example.com/a.png", True, 400, "data: urls"),
        ("file:///etc/passwd", True, 400, "data: urls"),
        ("data:image/png,rawbytes", True, 400, "base64"),
        ("data:image/png;base64,%%%", True, 400, "not valid base64"),
        ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), True, 400,
         "cannot be decoded"),
        (png_url(300, 200), True, 413, "60000 pixels"),
    ],
)  # fmt: skip
def test_bad_images_are_refused_naming_the_problem(
    url: str, accepts: bool, status: int, needle: str
) -> None:
    limits = RequestLimits(max_image_pixels=50_000)
    problem = check_images("m", [url], accepts, limits)
    assert problem is not None and problem[0] == status
    assert needle in problem[1].lower(), problem[1]


def test_remote_images_pass_only_when_allowed() -> None:
    url = "https://example.com/a.png"
    assert check_images("m", [url], True, RequestLimits(allow_remote_images=True)) is None
    # still only web URLs: a local file is never fetched
    problem = check_images("m", ["file:///x"], True, RequestLimits(allow_remote_images=True))
    assert problem is not None and problem[0] == 400


def test_a_truncated_image_is_refused() -> None:
    full = base64.b64decode(png_url(64, 64).partition(",")[2])
    url = "data:image/png;base64," + base64.b64encode(full[: len(full) // 2]).decode()
    problem = check_images("m", [url], True, RequestLimits())
    assert problem is not None and problem[0] == 400
