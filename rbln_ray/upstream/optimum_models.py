"""optimum-rbln classes rbln-ray adds: encoders optimum-rbln 0.12 compiles with its generic
code but exports no class for, registered through optimum's public ``RBLNAutoModel.register``
/ ``RBLNAutoConfig.register``.

Why here: optimum's ``RBLNAutoModelForSequenceClassification`` looks for
``RBLNBertForSequenceClassification`` (a BERT cross-encoder) and finds none, and it exports
ModernBERT only as a masked LM (``RBLNModernBertForMaskedLM``: vocabulary logits, not the
hidden states an embedding model pools). A few lines of subclassing give both, on optimum's own
generic compile path (``modeling_generic``) and, for ModernBERT, its own compile wrapper
(the 2-D padding mask passed through, so the local-attention layers build their own window
masks). The one import that is not public API (``ModernBertModelWrapper``'s module) is a
requirement in :mod:`.optimum_internals`.

This module imports optimum-rbln (which imports ``rebel``) at import time: import it only
where a runtime is active (:func:`rbln_class` does).
"""

from __future__ import annotations

from typing import Any

import torch
from optimum.rbln import RBLNAutoConfig, RBLNAutoModel
from optimum.rbln.transformers.configuration_generic import (
    RBLNModelForSequenceClassificationConfig,
    RBLNTransformerEncoderForFeatureExtractionConfig,
)
from optimum.rbln.transformers.modeling_generic import (
    RBLNModelForSequenceClassification,
    RBLNTransformerEncoderForFeatureExtraction,
)
from optimum.rbln.transformers.models.modernbert.modernbert_architecture import (
    ModernBertModelWrapper,
)


class RBLNBertForSequenceClassificationConfig(RBLNModelForSequenceClassificationConfig):
    """A BERT cross-encoder's compile config (optimum's generic sequence classifier's)."""


class RBLNBertForSequenceClassification(RBLNModelForSequenceClassification):
    """A BERT cross-encoder: its graph takes segment ids (``token_type_ids``), which tell the
    query from the document in a pair."""

    rbln_model_input_names = ["input_ids", "attention_mask", "token_type_ids"]


class RBLNModernBertModelConfig(RBLNTransformerEncoderForFeatureExtractionConfig):
    """A ModernBERT embedding model's compile config."""


class RBLNModernBertModel(RBLNTransformerEncoderForFeatureExtraction):
    """ModernBERT's hidden states, compiled as optimum compiles its masked LM (SDPA attention,
    the padding mask passed through to the model)."""

    rbln_model_input_names = ["input_ids", "attention_mask"]

    @classmethod
    def get_pytorch_model(cls, *args: Any, **kwargs: Any) -> Any:
        kwargs["attn_implementation"] = "sdpa"  # as RBLNModernBertForMaskedLM: never FA2
        return super().get_pytorch_model(*args, **kwargs)

    @classmethod
    def _wrap_model_if_needed(cls, model: torch.nn.Module, rbln_config: Any) -> torch.nn.Module:
        return ModernBertModelWrapper(model, rbln_config).eval()


CLASSES: dict[str, type] = {
    c.__name__: c for c in (RBLNBertForSequenceClassification, RBLNModernBertModel)
}
_CONFIGS = (RBLNBertForSequenceClassificationConfig, RBLNModernBertModelConfig)

for _config in _CONFIGS:  # on import: every process that can load one has imported this
    RBLNAutoConfig.register(_config, exist_ok=True)
for _cls in CLASSES.values():
    RBLNAutoModel.register(_cls, exist_ok=True)


def rbln_class(name: str) -> type:
    """The optimum-rbln class called ``name``: optimum's own, or one of rbln-ray's above."""
    import optimum.rbln

    found = CLASSES.get(name) or getattr(optimum.rbln, name, None)
    if found is None:
        raise LookupError(f"optimum-rbln 0.12 has no class {name}")
    return found
