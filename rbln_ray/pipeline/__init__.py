"""Model-parallel pipeline stages: a decoder split by layer ranges, one worker per stage.

* :func:`compile_pipeline` compiles an HF decoder into S stage graph sets plus a manifest
  (``rbln_pipeline.json``) that configures vLLM like optimum's ``rbln_config.json``;
* :class:`~rbln_ray.pipeline.worker.PipelineWorker` runs one stage inside an
  ``RBLNRayExecutor`` actor as one vLLM pipeline-parallel rank; each rank passes the step and
  its hidden states to the next one.
"""

from __future__ import annotations

from typing import Any

from rbln_ray.pipeline.manifest import (
    MANIFEST,
    PipelineManifest,
    StageSpec,
    is_pipeline_dir,
    split_layers,
)


def compile_pipeline(*args: Any, **kwargs: Any):
    """See :func:`rbln_ray.pipeline.compile.compile_pipeline` (imports optimum lazily)."""
    from rbln_ray.pipeline.compile import compile_pipeline as _compile

    return _compile(*args, **kwargs)


__all__ = [
    "MANIFEST",
    "PipelineManifest",
    "StageSpec",
    "compile_pipeline",
    "is_pipeline_dir",
    "split_layers",
]
