"""The layer order of docs/ARCHITECTURE.md holds, no modules import each other in a circle,
and the check would catch a violation of either."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import check_layers  # noqa: E402


def test_the_tree_follows_the_layer_order() -> None:
    assert check_layers.violations(ROOT) == []


def test_every_package_is_in_a_layer() -> None:
    packages = {p.name for p in (ROOT / "rbln_ray").iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(check_layers.RANK)


def test_a_backwards_import_fails_the_check(tmp_path: Path) -> None:
    """The emulator importing the vLLM plugin (lazily, inside a function) is reported, and
    so is a relative import reaching up; the script exits 1."""
    tree = tmp_path / "repo"
    shutil.copytree(ROOT / "rbln_ray", tree / "rbln_ray", ignore=shutil.ignore_patterns("*.pyc"))
    shutil.copytree(ROOT / "scripts", tree / "scripts", ignore=shutil.ignore_patterns("*.pyc"))
    (tree / "rbln_ray" / "emulator" / "backwards.py").write_text(
        "def f():\n    from rbln_ray.vllm_plugin import platform\n    return platform\n"
    )
    (tree / "rbln_ray" / "compile" / "upwards.py").write_text("from ..serve import naming\n")
    problems = check_layers.violations(tree)
    assert len(problems) == 2, problems
    rank = check_layers.RANK
    emulator, plugin = rank["emulator"], rank["vllm_plugin"]
    expected = f"emulator (layer {emulator}) imports vllm_plugin (layer {plugin})"
    assert expected in problems[0] + problems[1]
    assert any(f"compile (layer {rank['compile']}) imports serve" in p for p in problems)
    proc = subprocess.run(
        [sys.executable, str(tree / "scripts" / "check_layers.py")], capture_output=True, text=True
    )
    assert proc.returncode == 1 and "2 import(s) against the layer order" in proc.stdout


def test_no_modules_import_each_other_in_a_circle() -> None:
    assert check_layers.circles(ROOT) == []


def test_an_import_circle_fails_the_check(tmp_path: Path) -> None:
    """Two modules of one package importing each other (one lazily, inside a function, as a
    circle is usually hidden) and a three-module circle through a relative import are each
    reported once, with their members; the layer order alone would pass them."""
    tree = tmp_path / "repo"
    shutil.copytree(ROOT / "rbln_ray", tree / "rbln_ray", ignore=shutil.ignore_patterns("*.pyc"))
    shutil.copytree(ROOT / "scripts", tree / "scripts", ignore=shutil.ignore_patterns("*.pyc"))
    npu = tree / "rbln_ray" / "npu"
    (npu / "ring_a.py").write_text("from rbln_ray.npu import ring_b\n")
    lazy = "def f():\n    from rbln_ray.npu.ring_a import x\n    return x\n"
    (npu / "ring_b.py").write_text(lazy)
    (npu / "tri_a.py").write_text("from . import tri_b\n")
    (npu / "tri_b.py").write_text("import rbln_ray.npu.tri_c\n")
    (npu / "tri_c.py").write_text("from rbln_ray.npu.tri_a import y\n")
    assert check_layers.violations(tree) == []
    assert check_layers.circles(tree) == [
        ["rbln_ray.npu.ring_a", "rbln_ray.npu.ring_b"],
        ["rbln_ray.npu.tri_a", "rbln_ray.npu.tri_b", "rbln_ray.npu.tri_c"],
    ]
    proc = subprocess.run(
        [sys.executable, str(tree / "scripts" / "check_layers.py")], capture_output=True, text=True
    )
    assert proc.returncode == 1 and "2 import circle(s) between modules" in proc.stdout
    assert "import circle: rbln_ray.npu.ring_a <-> rbln_ray.npu.ring_b" in proc.stdout
