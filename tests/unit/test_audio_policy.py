"""Speech-to-text uploads at the ingress (no Ray, no engine): what it refuses before any
replica (the form, the model, the audio's header), and what it relays (the body as it came,
to vLLM's own route in the replica; its stream as vLLM streams it)."""

from __future__ import annotations

import asyncio
import json
import struct
import types
import wave
from io import BytesIO

import httpx
import numpy as np
import pytest

from rbln_ray.models.speech import tone_clip, wav_bytes
from rbln_ray.serve.audio import check_audio
from rbln_ray.serve.config import RequestLimits

LIMITS = RequestLimits(max_request_bytes=1 << 22, max_audio_seconds=20)


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
    return _encoded(seconds, "mp4", "aac")


def avi_bytes(seconds: float) -> bytes:
    """PCM audio in an AVI container: FFmpeg reads it, but AVI is no audio demuxer the
    ingress lets FFmpeg use (AUDIO_DEMUXERS)."""
    return _encoded(seconds, "avi", "pcm_s16le")


def _encoded(seconds: float, container: str, codec: str) -> bytes:
    import av

    buf = BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=16000)
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
        (png_bytes(), "not audio in a format this server decodes"),  # no image demuxers
        (avi_bytes(1.0), "not audio in a format this server decodes"),
        (wav_with_codec(0x1234), "codec"),
        (wav_bytes(tone_clip(21.0, 440)), "21.0 s long, more than limits.max_audio_seconds = 20"),
        (flac_bytes(25.0), "25.0 s"),
        (m4a_bytes(22.0), "more than limits.max_audio_seconds"),
    ],
    ids=["empty", "text", "png", "avi", "unknown-codec", "long-wav", "long-flac", "long-m4a"],
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


# ------------------------------------------------------------------ through the ingress
class StubTranscription:
    """vLLM's speech-to-text serving object in the replica, reduced to what the tests look
    at: the audio bytes and the request vLLM's route parsed from the relayed form."""

    def __init__(self) -> None:
        self.seen: list = []

    async def create_transcription(self, audio_data, request, raw_request=None):
        from vllm.entrypoints.speech_to_text.transcription.protocol import (
            TranscriptionResponse,
            TranscriptionUsageAudio,
        )

        self.seen.append((audio_data, request))
        if request.stream:
            return self._events()
        text = f"{len(audio_data)} bytes in {request.language}"
        return TranscriptionResponse(text=text, usage=TranscriptionUsageAudio(seconds=1))

    async def create_translation(self, audio_data, request, raw_request=None):
        from vllm.entrypoints.speech_to_text.translation.protocol import TranslationResponse

        self.seen.append((audio_data, request))
        return TranslationResponse(text=f"{len(audio_data)} bytes from {request.language}")

    async def _events(self):
        for word in ("one", "two"):
            yield f"data: {json.dumps({'choices': [{'delta': {'content': word}}]})}\n\n"
        yield "data: [DONE]\n\n"


@pytest.fixture(scope="module")
def speech_ingress():
    """The ingress in front of a fake handle of model "whisper", whose replica is vLLM's app
    of a transcribing model with a stub serving object (no engine)."""
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from rbln_ray.serve.ingress import OpenAIIngress, build_ingress_app
    from tests.unit.test_http_routes import KEY, FakeServer

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "whisper"])
    replica = build_app(args, ("generate", "transcription"), None)
    stub = StubTranscription()
    replica.state.openai_serving_transcription = stub
    replica.state.openai_serving_translation = stub
    replica.state.server = types.SimpleNamespace(should_exit=False)
    servers = {"whisper": FakeServer("whisper", replica)}
    ingress = OpenAIIngress.__new__(OpenAIIngress)
    ingress.configure(servers, KEY, LIMITS, {}, [], "app")
    return build_ingress_app(ingress), servers["whisper"], stub


def upload(app, path: str, files, data) -> httpx.Response:
    from tests.unit.test_http_routes import KEY

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
            auth = {"Authorization": f"Bearer {KEY}"}
            return await client.post(path, files=files, data=data, headers=auth)

    return asyncio.run(go())


WAV = wav_bytes(tone_clip(1.0, 440))


@pytest.mark.parametrize("path", ["/v1/audio/transcriptions", "/v1/audio/translations"])
def test_an_upload_is_relayed_byte_for_byte_to_the_model_it_names(speech_ingress, path) -> None:
    app, server, stub = speech_ingress
    files = {"file": ("a.wav", WAV, "audio/wav")}
    r = upload(app, path, files, {"model": "whisper", "language": "en"})
    assert r.status_code == 200, r.text
    assert r.json()["text"].startswith(f"{len(WAV)} bytes ")  # vLLM's route parsed the form
    assert stub.seen[-1][1].language == "en"
    call = server.calls[-1]
    assert call.path == path and dict(call.headers)[b"content-type"].startswith(
        b"multipart/form-data; boundary="
    )
    assert WAV in call.body and stub.seen[-1][0] == WAV


def test_a_streamed_transcription_is_relayed_as_vllm_streams_it(speech_ingress) -> None:
    app, _, _ = speech_ingress
    files = {"file": ("a.wav", WAV, "audio/wav")}
    r = upload(app, "/v1/audio/transcriptions", files, {"model": "whisper", "stream": "true"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert [json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1]] == ["one", "two"]


@pytest.mark.parametrize(
    ("files", "data", "status", "needle"),
    [
        ({"file": ("a.wav", WAV)}, {"model": "nope"}, 404, "does not exist"),
        ({"file": ("a.wav", WAV)}, {}, 400, "model: field required"),
        ({"file": ("a.wav", WAV)}, {"model": "whisper", "response_format": "yaml"}, 400,
         "response_format"),
        (None, {"model": "whisper"}, 400, "file"),
        ({"file": ("a.txt", b"not audio at all" * 8)}, {"model": "whisper"}, 400, "not audio"),
        ({"file": ("a.wav", wav_bytes(tone_clip(21.0, 440)))}, {"model": "whisper"}, 400,
         "max_audio_seconds"),
        ({"file": ("a.wav", b"\0" * (LIMITS.max_request_bytes + 1))}, {"model": "whisper"}, 413,
         "exceeds"),
    ],
    ids=["unknown-model", "no-model", "bad-field", "no-file", "not-audio", "too-long",
         "too-big"],
)  # fmt: skip
def test_bad_uploads_are_refused_before_any_replica(speech_ingress, files, data, status,
                                                    needle) -> None:  # fmt: skip
    app, server, _ = speech_ingress
    before = len(server.calls)
    r = upload(app, "/v1/audio/transcriptions", files, data)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and needle in error["message"], error
    assert len(server.calls) == before


def test_a_json_body_is_not_an_upload(speech_ingress) -> None:
    from tests.unit.test_http_routes import KEY, post

    app, server, _ = speech_ingress
    before = len(server.calls)
    r = post(app, "/v1/audio/transcriptions", {"model": "whisper", "file": "x"}, key=KEY)
    assert r.status_code == 400, r.text
    assert len(server.calls) == before


def test_a_wav_header_is_read_without_decoding_the_samples() -> None:
    """The duration comes from the header: a WAV that declares 1 s holds 1 s of samples."""
    with wave.open(BytesIO(WAV)) as w:
        assert w.getnframes() == 16000


def test_an_upload_only_ffmpeg_reads_reaches_the_replica_as_wav(speech_ingress) -> None:
    """An M4A upload is decoded in the ingress (restricted FFmpeg) and relayed as 16-bit WAV,
    so the replica's vLLM reads it with libsndfile and never opens FFmpeg on client bytes;
    its samples are FFmpeg's own decode of the upload (an independent decode, PyAV's)."""
    import av
    import soundfile

    app, server, stub = speech_ingress
    m4a = m4a_bytes(2.0)
    r = upload(app, "/v1/audio/transcriptions", {"file": ("a.m4a", m4a, "audio/mp4")},
               {"model": "whisper", "language": "en"})  # fmt: skip
    assert r.status_code == 200, r.text
    relayed = stub.seen[-1][0]
    assert relayed[:4] == b"RIFF" and stub.seen[-1][1].language == "en"
    got, rate = soundfile.read(BytesIO(relayed), dtype="float32")
    with av.open(BytesIO(m4a)) as container:
        # fltp frames: [channels, samples]; mixed to mono as the ingress does
        reference = np.concatenate([f.to_ndarray().mean(axis=0) for f in container.decode(audio=0)])
    assert rate == 16000 and len(got) == len(reference)
    assert np.abs(got - np.clip(reference, -1, 1)).max() < 2 / 32768  # 16-bit rounding


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"n": "50"}, "n=50 exceeds the limit of 8"),
        ({"max_completion_tokens": "99999"}, "max_tokens=99999 exceeds the limit"),
        ({"n": "8", "use_beam_search": "true", "max_completion_tokens": "10000"}, "exceeds"),
    ],
    ids=["n", "max-tokens", "beam"],
)
def test_uploads_are_held_to_the_same_limits_as_json_bodies(speech_ingress, fields, needle):
    """The form fields of an upload pass the admission limits a JSON body's fields do."""
    app, server, _ = speech_ingress
    before = len(server.calls)
    r = upload(app, "/v1/audio/transcriptions", {"file": ("a.wav", WAV, "audio/wav")},
               {"model": "whisper", **fields})  # fmt: skip
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert len(server.calls) == before
