"""Model-parallel pipeline stages at run time: one worker per stage, as vLLM pipeline ranks.

* :class:`~rbln_ray.pipeline.stage.StageModel` runs one stage's compiled graphs;
* :class:`~rbln_ray.pipeline.worker.PipelineWorker` runs one stage inside an
  ``RBLNRayExecutor`` actor as one vLLM pipeline-parallel rank; each rank passes the step and
  its hidden states to the next one.

Compiling the stages (and their manifest, ``rbln_pipeline.json``) is
:func:`rbln_ray.compile.compile_pipeline`'s.
"""
