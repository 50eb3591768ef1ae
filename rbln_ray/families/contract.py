"""The family contract: what a family's own module provides, by kind.

Why written down: the compile, the tiny-model builders, the model runner and vLLM's registry
each take something from a family's module (its processor, how its tower is compiled, how a
prompt becomes embeddings, how a tiny model is built). Without a contract each caller asked
the module whether it defined a hook (``hasattr``), each new family added a probe, and a
misspelt hook was silently skipped. Now a family's module defines its code as a subclass of
its kind's contract below and names one instance ``CODE``; :meth:`rbln_ray.families.registry.
Family.code` returns it, checked (a missing required member is an error naming it), and
``tests/unit/test_families.py`` checks every registered family. A hook with a default here is
one a family overrides only where it differs; callers always call it.

This module imports nothing of rbln-ray (the registry imports it) and nothing heavy: a
family's module brings transformers and vLLM with it when it is first used.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

# What the tiny models' chat template appends for the model's answer (a family whose
# processor ends a prompt itself says otherwise: PaliGemma).
GENERATION_PROMPT = "<|assistant|>\n"


class FamilyCode:
    """What every family's code is: its kind's contract plus ``REQUIRED``, the class
    attributes a concrete family must set (those the contract has no default for)."""

    REQUIRED: ClassVar[tuple[str, ...]] = ()

    def missing(self) -> list[str]:
        """The required class attributes this family's code does not set."""
        return [name for name in self.REQUIRED if not hasattr(type(self), name)]


class VisionCode(FamilyCode, ABC):
    """A vision-language family's code (:class:`~rbln_ray.families.registry.VisionFamily`):
    how its prompts carry images, how the runner turns a prompt into input embeddings
    (``Embedder``, a :class:`~rbln_ray.families.vision_base.PromptEmbedder`), how it is
    compiled and how its tiny model is built. Its module also declares the architecture to
    vLLM when the record names a ``declaration``."""

    REQUIRED = ("PLACEHOLDER", "SPECIAL_TOKENS", "Embedder")

    # What one image is in a prompt (its chat template's rendering of one); "" when the
    # processor puts the images before the text itself (the record's images_at_start).
    PLACEHOLDER: ClassVar[str]
    VIDEO_PLACEHOLDER: ClassVar[str] = ""  # what one video is (families with videos)
    # Tokens the tiny model's tokenizer gets as special tokens, and the named ones its
    # processor looks up (``tokenizer.image_token``: attribute -> token).
    SPECIAL_TOKENS: ClassVar[Sequence[str]]
    NAMED_TOKENS: ClassVar[Mapping[str, str]] = {}
    GENERATION_PROMPT: ClassVar[str] = GENERATION_PROMPT
    # TinyVisionLanguageSpec fields the family sets when a spec leaves them unset (None).
    SPEC_DEFAULTS: ClassVar[Mapping[str, Any]] = {}
    # The family's own HF processor class (transformers' without torchvision, or loaded from
    # its parts); None: transformers' AutoProcessor loads it.
    PROCESSOR: ClassVar[type | None] = None
    Embedder: ClassVar[type]  # the runner's prompt embedder (PromptEmbedder subclass)

    @abstractmethod
    def tiny_model(self, spec: Any, tokenizer: Any) -> tuple[Any, Any]:
        """``(transformers model, HF processor)`` of a tiny model of this family at ``spec``
        (:class:`rbln_ray.models.TinyVisionLanguageSpec`), over ``tokenizer`` (the local
        tokenizer with :attr:`SPECIAL_TOKENS` and the chat template)."""

    def load_processor(self, model_dir: str | Path, **kwargs: Any) -> Any:
        """The HF processor of a directory of this family (HF or compiled)."""
        if self.PROCESSOR is not None:
            return self.PROCESSOR.from_pretrained(str(model_dir), **kwargs)
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(str(model_dir), **kwargs)

    def hf_config(self, model_dir: str | Path) -> Any:
        """The transformers config optimum-rbln must compile and load a directory with, when
        ``AutoConfig`` may resolve its ``model_type`` to another class in an engine process
        (vLLM registers its own for some); None: optimum's ``AutoConfig`` is right."""
        return None

    def compile_settings(self, settings: Any) -> Any:
        """The language model's compile settings as this family compiles them (it may adjust
        or refuse them, raising ``ValueError`` with the reason)."""
        return settings

    def language_rbln_config(self, hf_dir: str | Path, language: dict[str, Any]) -> dict:
        """``rbln_config`` entries the decoder must be compiled with whatever the settings
        say (``language``: what they compile to)."""
        return {}

    def vision_rbln_config(self, hf_dir: str | Path) -> dict[str, Any]:
        """``rbln_config`` entries of the vision tower (optimum's defaults: none)."""
        return {}

    def after_compile(self, hf_dir: str | Path, out: Path) -> None:
        """What the compiled artifact needs besides optimum's output: the family's own
        processor (optimum saves only what ``AutoProcessor`` loads, which cannot load it
        here), so vLLM finds one beside the artifact."""
        if self.PROCESSOR is not None:
            self.load_processor(hf_dir).save_pretrained(out)


class SpeechCode(FamilyCode, ABC):
    """A speech-to-text family's code (:class:`~rbln_ray.families.registry.SpeechFamily`):
    how optimum-rbln compiles it and how its tiny model and tokenizer are built."""

    @abstractmethod
    def decoder_length(self, hf_config: Mapping[str, Any]) -> int:
        """Tokens of one decoder sequence, prompt included (the model's own limit: optimum
        compiles the decoder for it)."""

    @abstractmethod
    def rbln_kwargs(self, batch_size: int) -> dict[str, Any]:
        """optimum-rbln's ``rbln_*`` compile arguments for a decoder of ``batch_size`` rows,
        as rbln-ray's speech runner serves it."""

    @abstractmethod
    def tiny_tokenizer(self, vocab: Mapping[str, int], merges: Sequence[tuple[str, str]]) -> Any:
        """The family's tokenizer over a local byte-level BPE (its text vocabulary and merges),
        with the family's special tokens where its checkpoints have them."""

    @abstractmethod
    def tiny_model(self, spec: Any, tokenizer: Any) -> tuple[Any, Any]:
        """``(transformers model, HF processor)`` of a tiny model at ``spec``
        (:class:`rbln_ray.models.TinyWhisperSpec`) over ``tokenizer``."""
