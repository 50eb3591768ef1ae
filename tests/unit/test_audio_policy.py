"""What the ingress refuses of a speech-to-text upload, before any replica (no Ray, no
engine): the form, the model, and the audio's header."""

from __future__ import annotations

import asyncio
import struct
import wave
from io import BytesIO

import httpx
import numpy as np
import pytest

from rbln_ray.models.speech import tone_clip, wav_bytes
from rbln_ray.serve.audio import AudioUpload, check_audio, parse_upload
from rbln_ray.serve.config import RequestLimits

LIMITS = RequestLimits(max_request_bytes=1 << 22, max_audio_seconds=20)
MODELS = ["demo", "whisper"]


def wav_with_codec(tag: int, seconds: float = 1.0) -> bytes:
    """A WAV whose ``fmt `` chunk names codec ``tag`` (1 is PCM), 16 kHz mono 16-bit."""
    data = b"\0" * int(32000 * seconds)
    fmt = struct.pack("<HHIIHH", tag, 1, 16000, 32000, 2, 16)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def png_bytes() -> bytes:
    from PIL import Image

    buf = BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="PNG")
    return buf.getvalue()


def flac_bytes(seconds: float) -> bytes:
    import soundfile

    buf = BytesIO()
    soundfile.write(buf, tone_clip(seconds, 440), 16000, format="FLAC")
    return buf.getvalue()


def m4a_bytes(seconds: float) -> bytes:
    """AAC in an MP4 container: a format libsndfile does not read (FFmpeg's path)."""
    import av

    buf = BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("aac", rate=16000)
        samples = (tone_clip(seconds, 440) * 32767).astype(np.int16)
        for start in range(0, len(samples), 1024):
            frame = av.AudioFrame.from_ndarray(
                samples[None, start : start + 1024], format="s16", layout="mono"
            )
            frame.sample_rate = 16000
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"", "empty"),
        (b"this is a text file, not audio\n" * 20, "not audio"),
        (png_bytes(), "no audio stream (video (png))"),
        (wav_with_codec(0x1234), "codec"),
        (wav_bytes(tone_clip(21.0, 440)), "21.0 s long, more than limits.max_audio_seconds = 20"),
        (flac_bytes(25.0), "25.0 s"),
        (m4a_bytes(22.0), "more than limits.max_audio_seconds"),
    ],
    ids=["empty", "text", "png", "unknown-codec", "long-wav", "long-flac", "long-m4a"],
)
def test_bad_audio_is_a_400_naming_the_problem(data: bytes, needle: str) -> None:
    status, message = check_audio(data, LIMITS)
    assert status == 400 and needle in message, message


@pytest.mark.parametrize(
    "data",
    [wav_bytes(tone_clip(3.0, 440)), flac_bytes(3.0), m4a_bytes(3.0)],
    ids=["wav", "flac", "m4a"],
)
def test_audio_within_the_limit_passes(data: bytes) -> None:
    assert check_audio(data, LIMITS) is None


class _Request:
    """What parse_upload reads of a Starlette request: headers, the ASGI scope, the body."""

    def __init__(self, files: dict | None, data: dict | None, json: dict | None = None) -> None:
        built = httpx.Request(
            "POST", "http://x/v1/audio/transcriptions", files=files, data=data, json=json
        )
        self.body = built.read()
        self.headers = {k.lower(): v for k, v in built.headers.items()}
        self.scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/audio/transcriptions",
            "headers": [(k.encode(), v.encode()) for k, v in self.headers.items()],
        }

    async def stream(self):
        yield self.body


def parse(files: dict | None, data: dict | None = None, speech=("whisper",), **kw) -> object:
    request = _Request(files, data, **kw)
    return asyncio.run(parse_upload(request, "transcription", LIMITS, MODELS, list(speech)))


WAV = wav_bytes(tone_clip(1.0, 440))


def test_a_valid_upload_names_its_model_and_keeps_the_form() -> None:
    got = parse(
        {"file": ("a.wav", WAV, "audio/wav")},
        {
            "language": "en",
            "response_format": "verbose_json",
            "timestamp_granularities[]": "segment",
        },
    )
    assert isinstance(got, AudioUpload) and got.model == "whisper"  # the only speech model
    assert got.audio == WAV and got.filename == "a.wav" and got.task == "transcription"
    assert got.fields["language"] == "en" and got.fields["timestamp_granularities[]"] == ["segment"]


@pytest.mark.parametrize(
    ("files", "data", "speech", "status", "needle"),
    [
        ({"file": ("a.wav", WAV)}, {"model": "demo"}, ("whisper",), 400, "does not serve"),
        ({"file": ("a.wav", WAV)}, {"model": "nope"}, ("whisper",), 404, "does not exist"),
        ({"file": ("a.wav", WAV)}, {}, ("whisper", "w2"), 400, "model: field required"),
        (
            {"file": ("a.wav", WAV)},
            {"response_format": "yaml"},
            ("whisper",),
            400,
            "response_format",
        ),
        (None, {"model": "whisper"}, ("whisper",), 400, "file"),
        ({"file": ("a.txt", b"not audio at all" * 8)}, {}, ("whisper",), 400, "not audio"),
    ],
    ids=["chat-model", "unknown-model", "ambiguous-model", "bad-field", "no-file", "not-audio"],
)
def test_bad_uploads_are_refused_at_the_ingress(files, data, speech, status, needle) -> None:
    got = parse(files, data, speech=speech)
    assert isinstance(got, tuple) and got[0] == status and needle in got[1], got


def test_a_json_body_is_not_an_upload() -> None:
    status, message = parse(None, None, json={"model": "whisper", "file": "x"})
    assert status == 400 and "multipart/form-data" in message


def test_a_body_over_the_cap_is_a_413() -> None:
    small = RequestLimits(max_request_bytes=4096)
    request = _Request({"file": ("a.wav", WAV)}, {})
    got = asyncio.run(parse_upload(request, "transcription", small, MODELS, ["whisper"]))
    assert got[0] == 413 and "4096" in got[1]


def test_a_wav_header_is_read_without_decoding_the_samples() -> None:
    """The duration comes from the header: a WAV that declares 3 s holds 3 s of samples."""
    with wave.open(BytesIO(WAV)) as w:
        assert w.getnframes() == 16000
