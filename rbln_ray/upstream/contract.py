"""What an adapter relies on in an upstream library, in a form a test can check.

Why declarations rather than only behaviour tests: a check that resolves each name and
signature runs in milliseconds with nothing started, so the fast tier can guard every private
access; behaviour that a name check cannot see (an attribute set on instances, a call site
that looks a function up by name) has its own kinds below.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Upstream:
    """A library rbln-ray adapts to: its name, its distribution and the version pinned."""

    name: str
    distribution: str
    pinned: str

    def installed(self) -> str:
        try:
            return importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"


@dataclass(frozen=True)
class Requirement:
    """One thing of an upstream an adapter uses.

    ``target`` is ``"module:Qualified.name"``. ``kind``:

    * ``"callable"``: resolves to something callable taking at least ``params`` (by name, in
      that order, ignoring ``self``/``cls``);
    * ``"attribute"``: resolves (a class or module attribute);
    * ``"instance attribute"``: ``"module:Class.attr"`` is assigned as ``self.attr`` in a
      method of the class or one of its bases (instances carry it; the class does not);
    * ``"called by name"``: ``"module:name"`` is called as a bare ``name(...)`` somewhere in
      that module, so replacing the module attribute changes what the call runs;
    * ``"source mentions"``: the source of ``"module:Qualified.name"`` contains every string
      of ``params`` (a literal an adapter rewrites, e.g. a command Ray composes).
    """

    target: str
    used_by: str
    kind: str = "callable"
    params: tuple[str, ...] = ()

    def problem(self) -> str | None:
        """None when the upstream still provides this; else what is wrong."""
        module_name, _, qualname = self.target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            return f"module {module_name} does not import ({exc})"
        if self.kind == "called by name":
            return _called_by_name(module, qualname)
        if self.kind == "source mentions":
            return _mentions(_resolve(module, qualname), self.params)
        if self.kind == "instance attribute":
            owner_name, _, attr = qualname.rpartition(".")
            owner = _resolve(module, owner_name)
            if owner is None:
                return f"{module_name}.{owner_name} is missing"
            return _assigned_on_self(owner, attr)
        obj = _resolve(module, qualname)
        if obj is None:
            return "is missing"
        if self.kind == "attribute":
            return None
        if not callable(obj):
            return f"is a {type(obj).__name__}, not callable"
        return _missing_params(obj, self.params)


def _resolve(module: Any, qualname: str) -> Any:
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _missing_params(fn: Any, params: tuple[str, ...]) -> str | None:
    if not params:
        return None
    try:
        names = [p for p in inspect.signature(fn).parameters if p not in ("self", "cls")]
    except (TypeError, ValueError):
        return None  # builtins without a signature: existence is all that can be checked
    if names[: len(params)] != list(params):
        return f"takes ({', '.join(names)}), expected ({', '.join(params)}, ...)"
    return None


def _assigned_on_self(cls: type, attr: str) -> str | None:
    for klass in inspect.getmro(cls):
        if klass is object:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        for node in ast.walk(ast.parse(source)):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AnnAssign | ast.AugAssign):
                targets = [node.target]
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and target.attr == attr
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                ):
                    return None
    return f"no method of {cls.__name__} or its bases assigns self.{attr}"


def _called_by_name(module: Any, name: str) -> str | None:
    if getattr(module, name, None) is None:
        return f"{module.__name__} has no module attribute {name}"
    tree = ast.parse(inspect.getsource(module))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name:
            return None
    return f"{module.__name__} no longer calls {name}(...) by its module-level name"


def _mentions(obj: Any, texts: tuple[str, ...]) -> str | None:
    if obj is None:
        return "is missing"
    source = inspect.getsource(obj)
    missing = [t for t in texts if t not in source]
    return f"no longer contains {missing}" if missing else None


def check(upstream: Upstream, requirements: tuple[Requirement, ...]) -> list[str]:
    """Every broken requirement, each a sentence naming the upstream, both versions, the
    target and the rbln-ray code that uses it (empty: the contract holds)."""
    found = []
    for req in requirements:
        problem = req.problem()
        if problem is not None:
            found.append(
                f"{upstream.name} {upstream.installed()} (rbln-ray pins {upstream.pinned}): "
                f"{req.target} ({req.kind}) {problem}; used by {req.used_by}"
            )
    return found
