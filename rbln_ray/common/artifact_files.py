"""File names that mark a compiled RBLN directory, shared by the layers that write and read it,
and the Hugging Face architectures a model directory declares.

Why in ``common``: the compile layer writes them, the vLLM plugin detects artifacts by them,
and the emulator's timing mode reads a pipeline stage's share of the model from the manifest
(the emulator sits below every other layer, so it cannot import the compile layer).
"""

from __future__ import annotations

import json
from pathlib import Path

RBLN_CONFIG = "rbln_config.json"  # optimum-rbln's compiled directory
PIPELINE_MANIFEST = "rbln_pipeline.json"  # a staged directory (rbln_ray.pipeline)
HF_CONFIG = "config.json"  # a Hugging Face model directory's (kept in a compiled one too)
# Speculative decoding's verify graphs (rbln_ray.compile.spec_graphs): a manifest beside
# optimum's files, the graphs in a subdirectory (optimum warns about unknown top-level .rbln)
SPEC_MANIFEST = "rbln_spec.json"
SPEC_DIR = "spec"


def architectures(model_dir: str | Path) -> list[str]:
    """``config.json``'s ``architectures`` of an HF or compiled directory (empty if none):
    what decides which family, encoder or vision-language model it is."""
    path = Path(model_dir) / HF_CONFIG
    if not path.is_file():
        return []
    return list(json.loads(path.read_text()).get("architectures") or [])
