"""File names that mark a compiled RBLN directory, shared by the layers that write and read it.

Why in ``common``: the compile layer writes them, the vLLM plugin detects artifacts by them,
and the emulator's timing mode reads a pipeline stage's share of the model from the manifest
(the emulator sits below every other layer, so it cannot import the compile layer).
"""

RBLN_CONFIG = "rbln_config.json"  # optimum-rbln's compiled directory
PIPELINE_MANIFEST = "rbln_pipeline.json"  # a staged directory (rbln_ray.pipeline)
