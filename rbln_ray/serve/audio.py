"""The ingress's checks of a speech-to-text upload (``/v1/audio/transcriptions`` and
``/v1/audio/translations``), before a replica decodes anything.

The routes themselves are vLLM's: the ingress clones them (a multipart form validated by
vLLM's ``TranscriptionRequest`` / ``TranslationRequest``) and relays the body as it came to
the replica named by the form's ``model``, whose vLLM app runs ``OpenAIServingTranscription``
/ ``OpenAIServingTranslation`` (decoding, resampling to 16 kHz, 30-second windows, SSE).

What this module adds in front (:func:`prepare_upload`): the audio's header is read
(:func:`probe_audio`), and a file that is no audio, an audio stream no decoder here reads
(an unsupported codec), or audio longer than ``limits.max_audio_seconds`` is a 400 naming
the problem. Reading a header decodes nothing. The replica enforces the duration cap again
(:func:`replica_env`: vLLM's own decode limit), so a header that lies about its length buys
nothing.

FFmpeg (which reads what libsndfile cannot: MP4/M4A, WebM, AAC) parses untrusted uploads
here only with the audio demuxers (:data:`AUDIO_DEMUXERS`; none that opens other files or
URLs, such as HLS playlists or concat lists) and the ``file``/``pipe`` protocols. vLLM in the
replica would open an upload with every demuxer, so an upload libsndfile cannot read is
decoded here, under those restrictions, and relayed as 16-bit WAV (:func:`prepare_upload`):
the replica then reads it with libsndfile and never starts FFmpeg.
"""

from __future__ import annotations

import io
import uuid
from dataclasses import dataclass
from typing import Any

from rbln_ray.serve.config import RequestLimits

# FFmpeg demuxers an upload may be read with (WAV, FLAC, Ogg, MP3, raw AAC, MP4/M4A/MOV,
# Matroska/WebM), and the only protocols: a listed name matches a demuxer whose name
# contains it (FFmpeg's av_match_list).
AUDIO_DEMUXERS = "wav,w64,flac,ogg,mp3,aac,mov,mp4,m4a,matroska,webm"
FFMPEG_OPTIONS = {"format_whitelist": AUDIO_DEMUXERS, "protocol_whitelist": "file,pipe"}


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
        with av.open(io.BytesIO(data), options=FFMPEG_OPTIONS) as container:
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


def readable_by_libsndfile(data: bytes) -> bool:
    import soundfile

    try:
        soundfile.info(io.BytesIO(data))
    except (soundfile.LibsndfileError, RuntimeError, ValueError):
        return False
    return True


def decode_to_wav(data: bytes, limits: RequestLimits) -> bytes | tuple[int, str]:
    """The upload's first audio stream, decoded with the restricted FFmpeg and mixed to mono,
    as 16-bit WAV at its own rate; or (400, why) if it does not decode within the duration
    cap."""
    import av
    import numpy as np
    import soundfile

    chunks, rate, total = [], 0, 0
    try:
        with av.open(io.BytesIO(data), options=FFMPEG_OPTIONS) as container:
            stream = container.streams.audio[0]
            rate = stream.rate
            cap = (limits.max_audio_seconds + 1) * rate
            for frame in container.decode(stream):
                samples = as_float(frame.to_ndarray())
                if frame.format.is_planar:
                    samples = samples.mean(axis=0)
                else:  # interleaved: [1, samples x channels]
                    samples = samples.reshape(-1, len(frame.layout.channels)).mean(axis=1)
                chunks.append(samples)
                total += len(samples)
                if total > cap:
                    return 400, (
                        f"file: the audio decodes to more than limits.max_audio_seconds = "
                        f"{limits.max_audio_seconds} s"
                    )
    except (av.FFmpegError, IndexError, ValueError) as exc:
        return 400, f"file: the audio does not decode ({exc})"
    if not chunks:
        return 400, "file: the audio stream holds no samples"
    out = io.BytesIO()
    pcm = np.clip(np.concatenate(chunks), -1.0, 1.0)
    soundfile.write(out, pcm, rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


def as_float(samples: Any) -> Any:
    """Decoded samples as float32 in [-1, 1] (integer formats come back unscaled)."""
    import numpy as np

    if np.issubdtype(samples.dtype, np.unsignedinteger):
        middle = (np.iinfo(samples.dtype).max + 1) / 2
        return (samples.astype(np.float32) - middle) / middle
    if np.issubdtype(samples.dtype, np.integer):
        return samples.astype(np.float32) / (np.iinfo(samples.dtype).max + 1)
    return samples.astype(np.float32)


def prepare_upload(data: bytes, limits: RequestLimits) -> bytes | tuple[int, str] | None:
    """What to relay for an uploaded audio file: None (the upload as it came: libsndfile
    reads it), WAV bytes (it needs FFmpeg: decoded here, module docstring), or (HTTP
    status, message) of its first problem."""
    problem = check_audio(data, limits)
    if problem is not None:
        return problem
    if readable_by_libsndfile(data):
        return None
    return decode_to_wav(data, limits)


async def upload_bytes(form: Any) -> bytes | tuple[int, str]:
    """A parsed multipart form's ``file`` part, or (400, why) without one."""
    from starlette.datastructures import UploadFile

    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        return 400, "file: field required (the audio file, as a multipart file part)"
    data = await upload.read()
    await upload.seek(0)
    return data


def with_file(form: Any, data: bytes, filename: str) -> tuple[bytes, str]:
    """The multipart body of ``form`` with its ``file`` part replaced by ``data`` (WAV), and
    its content type (a new boundary)."""
    boundary = uuid.uuid4().hex
    parts = []
    for name, value in form.multi_items():
        if name == "file":
            head = (f'Content-Disposition: form-data; name="file"; filename="{filename}"\r\n'
                    "Content-Type: audio/wav\r\n\r\n")  # fmt: skip
            payload = data
        else:
            head = f'Content-Disposition: form-data; name="{name}"\r\n\r\n'
            payload = str(value).encode()
        parts.append(f"--{boundary}\r\n{head}".encode() + payload + b"\r\n")
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"
