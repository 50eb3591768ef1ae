"""Compiling models for RBLN NPUs and the compiled artifact's format, on an RBLN host and under
the emulator alike.

* :mod:`.settings`: :class:`CompileSettings` and the one mapping onto optimum's ``rbln_*``;
* :mod:`.optimum_compile`: one graph set through optimum-rbln's own ``from_pretrained``;
  :mod:`.family_compile` wraps it with a family's options and clear rejections;
* :mod:`.pipeline_compile` / :mod:`.stage_graph` / :mod:`.pipeline_manifest`: S pipeline
  stages from one HF decoder, and the manifest that describes them;
* :mod:`.artifact`: :class:`CompiledArtifact`, what every layer above reads of a compiled
  directory;
* :mod:`.compiled_cache`: compile an HF directory on first use, into rbln-ray's cache.

Heavy imports (torch, optimum) happen inside the functions that compile.
"""

from __future__ import annotations

from rbln_ray.compile.artifact import ArtifactError, CompiledArtifact, is_compiled_dir
from rbln_ray.compile.compiled_cache import resolve_compiled_dir
from rbln_ray.compile.optimum_compile import compile_hf_model
from rbln_ray.compile.pipeline_compile import compile_pipeline
from rbln_ray.compile.pipeline_manifest import PipelineManifest, StageSpec, split_layers
from rbln_ray.compile.settings import CompileSettings
from rbln_ray.families.registry import UnsupportedModelError, family_for_dir

__all__ = [
    "ArtifactError",
    "CompileSettings",
    "CompiledArtifact",
    "PipelineManifest",
    "StageSpec",
    "UnsupportedModelError",
    "compile_hf_model",
    "compile_pipeline",
    "family_for_dir",
    "is_compiled_dir",
    "resolve_compiled_dir",
    "split_layers",
]
