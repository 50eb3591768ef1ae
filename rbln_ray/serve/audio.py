"""The ingress's checks of a speech-to-text upload (``/v1/audio/transcriptions`` and
``/v1/audio/translations``), before a replica decodes anything.

The routes themselves are vLLM's: the ingress clones them (a multipart form validated by
vLLM's ``TranscriptionRequest`` / ``TranslationRequest``) and relays the body as it came to
the replica named by the form's ``model``, whose vLLM app runs ``OpenAIServingTranscription``
/ ``OpenAIServingTranslation`` (decoding, resampling to 16 kHz, 30-second windows, SSE).

What this module adds in front (:func:`check_upload`): the audio's header is read
(:func:`probe_audio`), and a file that is no audio, an audio stream no decoder here reads
(an unsupported codec), or audio longer than ``limits.max_audio_seconds`` is a 400 naming
the problem. Reading a header decodes nothing. The replica enforces the duration cap again
(:func:`replica_env`: vLLM's own decode limit), so a header that lies about its length buys
nothing.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

from rbln_ray.serve.config import RequestLimits


@dataclass(frozen=True)
class AudioInfo:
    """What an audio file's header says."""

    seconds: float | None  # None: the container does not say
    codec: str


def probe_audio(data: bytes) -> AudioInfo | str:
    """The audio's duration and codec from its header, or why it is not audio this server
    can decode. The decoders vLLM uses, in its order: libsndfile (``soundfile``: WAV, FLAC,
    OGG, MP3, ...), then FFmpeg's demuxers and decoders (PyAV: MP4/M4A, WebM, ...)."""
    import soundfile

    try:
        info = soundfile.info(io.BytesIO(data))
        return AudioInfo(info.frames / info.samplerate, f"{info.format}/{info.subtype}")
    except (soundfile.LibsndfileError, RuntimeError, ValueError):
        pass
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            audio = [s for s in container.streams if s.type == "audio"]
            if not audio:
                kinds = ", ".join(f"{s.type} ({s.codec_context.name})" for s in container.streams)
                return f"the file holds no audio stream ({kinds or 'no streams'})"
            stream = audio[0]
            if stream.codec_context is None:
                return (
                    f"the audio stream's codec (in a {container.format.name} container) is "
                    "not supported: no decoder for it"
                )
            seconds = None
            if stream.duration is not None and stream.time_base is not None:
                seconds = float(stream.duration * stream.time_base)
            elif container.duration is not None:
                seconds = container.duration / av.time_base
            return AudioInfo(seconds, f"{container.format.name}/{stream.codec_context.name}")
    except av.FFmpegError as exc:
        return f"the file is not audio in a format this server decodes ({exc.strerror})"


def check_audio(data: bytes, limits: RequestLimits) -> tuple[int, str] | None:
    """(HTTP status, message) of the first problem with an uploaded audio file, or None."""
    if not data:
        return 400, "file: the uploaded audio file is empty"
    info = probe_audio(data)
    if isinstance(info, str):
        return 400, f"file: {info}"
    cap = limits.max_audio_seconds
    if info.seconds is not None and info.seconds > cap:
        return 400, (
            f"file: the audio is {info.seconds:.1f} s long, more than "
            f"limits.max_audio_seconds = {cap}"
        )
    return None


def replica_env(limits: RequestLimits) -> dict[str, str]:
    """vLLM's own decode limit in a replica, set to the app's cap (before its serving objects
    are created)."""
    return {"VLLM_MAX_AUDIO_DECODE_DURATION_S": str(limits.max_audio_seconds)}


async def check_upload(form: Any, limits: RequestLimits) -> tuple[int, str] | None:
    """(HTTP status, message) of the first problem with a parsed multipart form's ``file``
    part (:func:`check_audio`, off the event loop), or None."""
    import asyncio

    from starlette.datastructures import UploadFile

    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        return 400, "file: field required (the audio file, as a multipart file part)"
    data = await upload.read()
    await upload.seek(0)
    return await asyncio.to_thread(check_audio, data, limits)
