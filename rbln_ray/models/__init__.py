"""Small models built locally and deterministically (no model hub needed).

``build_tiny_model`` makes random-weight decoder directories of every decoder family for tests,
``build_tiny_encoder`` encoder (embedding) ones, ``build_tiny_vlm`` vision-language ones,
``build_tiny_whisper`` a speech-to-text one;
``demo_model_dir`` returns a small Llama
trained briefly on local Python sources, cached.
"""

from rbln_ray.models.builder import FAMILIES, TinyModelSpec, build_tiny_model
from rbln_ray.models.demo import demo_model_dir
from rbln_ray.models.encoders import TinyEncoderSpec, build_tiny_encoder
from rbln_ray.models.speech import TinyWhisperSpec, build_tiny_whisper
from rbln_ray.models.tokenizer import build_tokenizer
from rbln_ray.models.vision import TinyVisionLanguageSpec, build_tiny_vlm

__all__ = [
    "FAMILIES",
    "TinyEncoderSpec",
    "TinyModelSpec",
    "TinyVisionLanguageSpec",
    "TinyWhisperSpec",
    "build_tiny_encoder",
    "build_tiny_model",
    "build_tiny_vlm",
    "build_tiny_whisper",
    "build_tokenizer",
    "demo_model_dir",
]
