"""Import shim placed on PYTHONPATH by the rbln-ray emulator for child processes.

With ``RBLN_RAY_DEVICE=emulated`` it activates the emulator and ``import rebel`` yields it;
otherwise it hands over to a real ``rebel`` later on ``sys.path`` or raises ImportError.
"""

import importlib.machinery
import importlib.util
import os
import sys

# Read directly, not through rbln_ray.common.envs: in the hand-over branch this shim must not
# import rbln_ray (a real rebel process may not have it on its path).
_here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if os.environ.get("RBLN_RAY_DEVICE", "auto").strip().lower() == "emulated":
    del sys.modules[__name__]
    from rbln_ray.emulator.switch import activate

    activate()
else:
    _paths = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    _spec = importlib.machinery.PathFinder.find_spec(__name__, _paths)
    if _spec is None or _spec.loader is None:
        del sys.modules[__name__]
        raise ImportError(
            "No module named 'rebel' (rbln-ray shim: set RBLN_RAY_DEVICE=emulated for the emulator)"
        )
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[__name__] = _module
    _spec.loader.exec_module(_module)
