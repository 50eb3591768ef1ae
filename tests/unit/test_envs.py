"""Every ``RBLN_RAY_*`` variable the package reads is declared once, typed and documented."""

from __future__ import annotations

import re

import pytest

from rbln_ray.common import envs
from tests.helpers import ROOT


def test_every_variable_in_the_source_is_declared() -> None:
    used = set()
    for path in (ROOT / "rbln_ray").rglob("*.py"):
        used |= set(re.findall(r"\bRBLN_RAY_[A-Z_]*[A-Z]\b", path.read_text()))
    # Shell-side names of the cluster configs' start commands (not read by Python).
    used -= {"RBLN_RAY_NODE_IP"}
    assert used <= set(envs.NAMES), sorted(used - set(envs.NAMES))
    assert all(var.doc for var in envs.REGISTRY.values())


def test_values_are_typed_and_defaults_apply() -> None:
    assert envs.get("RBLN_RAY_EMULATED_DEVICES", {}) == 4
    assert envs.get("RBLN_RAY_EMULATED_DEVICES", {"RBLN_RAY_EMULATED_DEVICES": "8"}) == 8
    assert envs.get("RBLN_RAY_DEVICE", {"RBLN_RAY_DEVICE": " Emulated "}) == "emulated"
    assert envs.get("RBLN_RAY_TIMING_CALL_US", {"RBLN_RAY_TIMING_CALL_US": "50"}) == 50.0
    assert envs.get("RBLN_RAY_EMULATOR_THREADS", {"RBLN_RAY_EMULATOR_THREADS": ""}) is None


def test_a_bad_value_names_the_variable() -> None:
    with pytest.raises(envs.EnvError, match="RBLN_RAY_EMULATOR_THREADS='0'.*positive"):
        envs.get("RBLN_RAY_EMULATOR_THREADS", {"RBLN_RAY_EMULATOR_THREADS": "0"})
    with pytest.raises(envs.EnvError, match="RBLN_RAY_EMULATED_DEVICES='many'"):
        envs.get("RBLN_RAY_EMULATED_DEVICES", {"RBLN_RAY_EMULATED_DEVICES": "many"})
