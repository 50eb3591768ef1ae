"""Capacity planning for ATOM serving (``rbln-ray plan``), from the emulator's timing model."""

from rbln_ray.planning.planner import (
    Limits,
    Option,
    Plan,
    Workload,
    compiled_shape,
    plan,
    shape_from_dims,
)

__all__ = ["Limits", "Option", "Plan", "Workload", "compiled_shape", "plan", "shape_from_dims"]
