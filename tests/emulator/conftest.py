"""The emulator's ``rebel`` in this process, for tests that import ``rebel`` / optimum at
module level (collection runs before any fixture). Only ``sys.modules`` changes here; the
environment children inherit is the session fixture's (tests/conftest.py)."""

from rbln_ray.emulator import activate, is_emulated

if not is_emulated():
    activate(propagate=False)
