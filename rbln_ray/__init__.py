"""rbln-ray: a Ray-distributed vLLM backend for Rebellions RBLN NPUs (ATOM).

Layers, one sub-package each: ``emulator`` (CPU stand-in for the ``rebel`` runtime),
``models`` (locally built test/demo models), ``vllm_plugin`` (platform, worker, runner,
loader), ``executor`` (Ray distributed executor), ``serve`` (Ray Serve app), ``client``
(Python handles), ``cli`` (the ``rbln-ray`` command).
"""

__version__ = "0.1.0"
