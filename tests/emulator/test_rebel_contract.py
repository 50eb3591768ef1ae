"""Contract: every ``rebel`` name and ``torch.ops.rbln*`` op that optimum-rbln 0.12.0 (this
venv) and vllm-rbln 0.12.0 (the side env, ``make peer-env``) reference exists in the emulator,
unless an explicit exclusion (``EXCLUDED_PATHS``: code paths the emulator does not serve;
``EXCLUDED_NAMES``: model-zoo names) gives the reason.

References are found by parsing every module of both packages (``ast``): ``import rebel...``
/ ``from rebel... import X`` and the attribute chains on those names; ``torch.ops.<rbln ns>.<op>``
chains; attributes read on objects named ``runtime`` (``rebel.Runtime`` methods such as
``_copy_kv_cache``); and ``getattr(torch.ops.<rbln ns>, <computed name>)`` sites, whose
names are expanded from the string pieces in that file (``DYNAMIC_SITES``). A new dynamic
site, an exclusion that no longer matches anything, or a missing name fails the test, naming
it and where it is used.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import rebel
import torch

from benchmarks.peer_env import peer_site_packages

# Code the emulator deliberately does not serve: vllm-rbln's vLLM-model path (--model-impl
# vllm: vLLM's own model code compiled with torch.compile, with its own attention kernels) and
# its network KV transfer. The emulator serves the optimum path (a compiled optimum-rbln
# artifact), the default for a compiled directory. Path prefix -> reason.
EXCLUDED_PATHS: dict[str, str] = {
    "vllm_rbln/v1/attention/": "attention backends and kernels of the vLLM-model path "
    "(Triton via rebel.triton, rbln_triton_ops, *_naive_* custom ops, MLA)",
    "vllm_rbln/model_executor/layers/": "vLLM layers of the vLLM-model path (MoE collectives, "
    "FP8/NVFP4 MoE kernels)",
    "vllm_rbln/patches/": "patches of vLLM models for the vLLM-model path (DeepSeek-V2, A.X K2)",
    "vllm_rbln/distributed/": "NIXL KV / EC transfer connectors (device memory registered with a "
    "network transport: rebel.kv_cache, rebel.context_of)",
    "vllm_rbln/v1/worker/rbln_worker.py": "the vLLM-model path's worker (rebel.flags, "
    "rebel.profiler)",
    "vllm_rbln/v1/worker/mega_cache.py": "the vLLM-model path's compile-cache bundles "
    "(rebel.core.mega_cache)",
    "vllm_rbln/v1/worker/dynamic_kv_sizer.py": "the vLLM-model path's dynamic KV sizing "
    "(Runtime.reset_adaptive_buffers)",
}
# Names optimum-rbln uses for models beyond the families rbln-ray serves
# (rbln_ray.families.registry: its sliding-window, MoE, attention-sink and FP8-KV ops are
# emulated and so checked here).
# Name pattern -> reason.
EXCLUDED_NAMES: dict[str, str] = {
    # The scanner expands decoderonly_architecture.py's computed op names over every
    # prefix, but optimum never builds these: its SlidingWindowAttentionOp sets quantization
    # None and asserts "Sliding window attention does not support quantization".
    r"^torch\.ops\.rbln_custom_ops\.paged_sliding_window_attn_\w+_kv_fp8$": "never emitted",
}


@dataclass(frozen=True)
class Ref:
    name: str
    where: str  # package-relative path:line


def _chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` -> ["a", "b", "c"]; None if the chain does not start at a plain name."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


class _Scanner(ast.NodeVisitor):
    def __init__(self, where: Callable[[ast.AST], str]) -> None:
        self.where = where
        self.aliases: dict[str, str] = {}  # local name -> rebel dotted name
        self.refs: list[Ref] = []
        self.dynamic: list[str] = []

    def add(self, name: str, node: ast.AST) -> None:
        self.refs.append(Ref(name, self.where(node)))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name == "rebel" or alias.name.startswith("rebel."):
                self.add(alias.name, node)
                if alias.asname:
                    self.aliases[alias.asname] = alias.name
                else:
                    self.aliases["rebel"] = "rebel"

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level == 0 and (module == "rebel" or module.startswith("rebel.")):
            for alias in node.names:
                self.add(f"{module}.{alias.name}", node)
                self.aliases[alias.asname or alias.name] = f"{module}.{alias.name}"

    def visit_Attribute(self, node: ast.Attribute) -> None:
        parts = _chain(node)
        if parts:
            if parts[0] in self.aliases:
                self.add(".".join([self.aliases[parts[0]], *parts[1:]]), node)
            elif parts[:2] == ["torch", "ops"] and len(parts) >= 4 and parts[2].startswith("rbln"):
                self.add(".".join(parts[:4]), node)
            elif len(parts) >= 2 and parts[-2] == "runtime":
                self.add(f"rebel.Runtime.{parts[-1]}", node)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) >= 2:
            target = _chain(node.args[0])
            computed = not isinstance(node.args[1], ast.Constant)
            if target and target[:2] == ["torch", "ops"] and target[-1].startswith("rbln"):
                if computed:
                    self.dynamic.append(self.where(node))
                else:
                    self.add(f"torch.ops.{target[2]}.{node.args[1].value}", node)
        self.generic_visit(node)


def _attention_op_names(tree: ast.AST) -> set[str]:
    """decoderonly_architecture.py builds ``<prefix><phase>[_kv_fp8]``: prefixes are its
    ``"paged_..._attn_"`` literals, phase is ``prefill`` or ``decode`` (``get_attn_op_name``)."""
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}
    prefixes = {s for s in strings if isinstance(s, str) and re.fullmatch(r"paged_\w*attn_", s)}
    suffixes = ["", "_kv_fp8"] if "_kv_fp8" in strings else [""]
    return {
        f"torch.ops.rbln_custom_ops.{p}{phase}{suffix}"
        for p in prefixes
        for phase in ("prefill", "decode")
        for suffix in suffixes
    }


# file (package-relative) with computed op names -> how to expand them from its source
DYNAMIC_SITES: dict[str, Callable[[ast.AST], set[str]]] = {
    "optimum/rbln/transformers/models/decoderonly/decoderonly_architecture.py": (
        _attention_op_names
    ),
}


def _scan(root: Path, prefix: str) -> tuple[list[Ref], list[str], int]:
    """References in every module under ``root`` (paths reported as ``prefix/...``)."""
    refs, dynamic, files = [], [], 0
    for path in sorted(root.rglob("*.py")):
        rel = f"{prefix}/{path.relative_to(root).as_posix()}"
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        files += 1
        scanner = _Scanner(lambda node, rel=rel: f"{rel}:{getattr(node, 'lineno', 0)}")
        scanner.visit(tree)
        refs += scanner.refs
        dynamic += scanner.dynamic
        if scanner.dynamic and rel in DYNAMIC_SITES:
            refs += [Ref(n, f"{rel} (computed)") for n in DYNAMIC_SITES[rel](tree)]
    return refs, dynamic, files


def _packages() -> Iterator[tuple[str, Path, str]]:
    spec = importlib.util.find_spec("optimum.rbln")
    assert spec and spec.submodule_search_locations, "optimum-rbln is not installed"
    yield "optimum-rbln", Path(next(iter(spec.submodule_search_locations))), "optimum/rbln"
    yield "vllm-rbln", peer_site_packages() / "vllm_rbln", "vllm_rbln"  # raises if absent


def resolves(name: str) -> bool:
    """Whether the active (emulated) ``rebel``/torch.ops provides ``name``."""
    parts = name.split(".")
    if parts[:2] == ["torch", "ops"]:
        return hasattr(getattr(torch.ops, parts[2]), parts[3])
    if parts[:2] == ["rebel", "Runtime"] and len(parts) == 3:
        return hasattr(rebel.Runtime, parts[2])
    obj = rebel
    for i, part in enumerate(parts[1:], start=2):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            return False
    return True


def excluded(ref: Ref) -> str | None:
    """The exclusion (path prefix or name pattern) that covers ``ref``, if any."""
    path = next((p for p in EXCLUDED_PATHS if ref.where.startswith(p)), None)
    return path or next((p for p in EXCLUDED_NAMES if re.search(p, ref.name)), None)


def missing(refs: list[Ref]) -> dict[str, list[str]]:
    """Referenced names neither provided nor excluded -> where they are used."""
    out: dict[str, list[str]] = {}
    for ref in refs:
        if excluded(ref) is None and not resolves(ref.name):
            out.setdefault(ref.name, []).append(ref.where)
    return out


@pytest.fixture(scope="module")
def scanned() -> dict[str, tuple[list[Ref], list[str], int]]:
    assert getattr(rebel, "__rbln_ray_emulated__", False), "the emulator must be active"
    return {label: _scan(root, prefix) for label, root, prefix in _packages()}


def test_every_referenced_rebel_name_and_rbln_op_is_emulated(scanned):
    report = []
    for label, (refs, _, files) in scanned.items():
        assert files > 100 and len(refs) > 50, f"{label}: scanned {files} files, {len(refs)} refs"
        for name, where in sorted(missing(refs).items()):
            report.append(f"{label}: {name}  (used at {', '.join(where[:3])})")
    assert not report, "names the emulator lacks:\n" + "\n".join(report)


def test_known_call_sites_are_seen(scanned):
    """The scan itself works: names this issue was about are found where they are used."""
    names = {r.name for label in scanned for r in scanned[label][0]}
    for name in (
        "rebel.core.torch_compile.rbln_backend",
        "rebel.manual_seed",
        "rebel.capture_reports",
        "rebel.CompileContext",
        "rebel.Runtime._copy_kv_cache",
        "torch.ops.rbln.argmax",
        "torch.ops.rbln.top_k_top_p",
        "torch.ops.rbln.rejection_sample",
        "rebel.compile_from_torch",
        "torch.ops.rbln_custom_ops.paged_flash_causal_attn_decode",  # computed name
    ):
        assert name in names, name


def test_no_unexpanded_dynamic_op_lookups(scanned):
    unknown = [
        site
        for _, dynamic, _ in scanned.values()
        for site in dynamic
        if site.rsplit(":", 1)[0] not in DYNAMIC_SITES
    ]
    assert not unknown, f"computed torch.ops.rbln* names at {unknown}: add them to DYNAMIC_SITES"


def test_every_exclusion_still_covers_a_missing_name(scanned):
    """No exclusion rots: each one still hides at least one name the emulator lacks."""
    used = {excluded(r) for label in scanned for r in scanned[label][0] if not resolves(r.name)}
    stale = [p for p in [*EXCLUDED_PATHS, *EXCLUDED_NAMES] if p not in used]
    assert not stale, f"exclusions covering nothing the emulator lacks (remove them): {stale}"


def test_the_check_names_a_removed_symbol(scanned, monkeypatch):
    """Remove emulated names and the contract reports exactly them."""
    refs = [r for label in scanned for r in scanned[label][0]]
    monkeypatch.delattr(rebel, "manual_seed")
    monkeypatch.delattr(rebel.Runtime, "_copy_kv_cache")
    assert sorted(missing(refs)) == ["rebel.Runtime._copy_kv_cache", "rebel.manual_seed"]
