"""RBLN_RAY_DEVICE: the emulator never shadows a real rebel and reaches child processes."""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.helpers import ROOT, run_python

PROBE = """
    import sys
    from rbln_ray.emulator import ensure_runtime, is_emulated
    try:
        used = ensure_runtime()
    except Exception as e:
        print("ERROR", type(e).__name__, e)
        sys.exit(3)
    import rebel
    print(used, is_emulated(), getattr(rebel, "REAL", False))
"""


@pytest.fixture
def fake_rebel(tmp_path) -> Path:
    pkg = tmp_path / "site" / "rebel"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("REAL = True\n")
    return pkg.parent


def _run(code: str, mode: str, pythonpath: list[Path | str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RBLN_RAY_DEVICE")}
    env["RBLN_RAY_DEVICE"] = mode
    env["PYTHONPATH"] = os.pathsep.join(map(str, [ROOT, *pythonpath]))
    _, proc = run_python(["-c", textwrap.dedent(code)], full_env=env, timeout=120, check=False)
    return proc


def test_auto_leaves_a_real_rebel_alone(fake_rebel):
    proc = _run(PROBE, "auto", [fake_rebel])
    assert proc.stdout.split() == ["rbln", "False", "True"], proc.stderr


def test_auto_without_rebel_does_not_turn_the_emulator_on():
    proc = _run(PROBE, "auto", [])
    assert proc.returncode != 0 and "No module named 'rebel'" in proc.stderr


def test_emulated_refuses_when_a_real_rebel_is_imported(fake_rebel):
    code = "import rebel\n" + textwrap.dedent(PROBE)
    proc = _run(code, "emulated", [fake_rebel])
    assert proc.returncode == 3 and "already imported" in proc.stdout


def test_rbln_mode_requires_the_real_runtime(fake_rebel):
    missing = _run(PROBE, "rbln", [])
    assert missing.returncode == 3 and "no real 'rebel'" in missing.stdout
    present = _run(PROBE, "rbln", [fake_rebel])
    assert present.stdout.split() == ["rbln", "False", "True"]


def test_activation_reaches_children_through_the_environment(fake_rebel):
    from rbln_ray.emulator import switch

    shim = switch.SHIM_DIR
    # a child that imports rebel directly (no ensure_runtime), as Ray's accelerator probe does
    code = "import rebel; print(rebel.__version__, rebel.device_count(), rebel.get_npu_name())"
    child = _run(code, "emulated", [shim])
    assert child.stdout.split() == ["0.12.0+emulated", "4", "RBLN-CA25"], child.stderr
    # the shim hands over to a real rebel in any other mode, and never emulates by itself
    handed = _run("import rebel; print(rebel.REAL)", "auto", [shim, fake_rebel])
    assert handed.stdout.strip() == "True", handed.stderr
    absent = _run("import rebel", "auto", [shim])
    assert absent.returncode != 0 and "RBLN_RAY_DEVICE=emulated" in absent.stderr


QUIET_PROBE = """
    import warnings
    original = warnings.showwarning
    from rbln_ray.emulator import ensure_runtime
    ensure_runtime()
    if RESTORE:
        warnings.showwarning = original
    import optimum.rbln
    warnings.simplefilter("always")
    warnings.warn("some other import warning", ImportWarning)
"""


@pytest.mark.parametrize("restore", [False, True])
def test_emulator_silences_only_the_missing_compiler_warning(restore: bool) -> None:
    proc = _run(QUIET_PROBE.replace("RESTORE", str(restore)), "emulated", [])
    assert proc.returncode == 0, proc.stderr
    assert "some other import warning" in proc.stderr
    # Without the emulator's hook (restored), optimum-rbln's own warning is what shows.
    assert ("requires rebel-compiler" in proc.stderr) is restore, proc.stderr
