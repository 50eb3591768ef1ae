"""``rbln-ray compile``'s settings flags, generated from :class:`CompileSettings`.

Why generated: a flag written by hand repeats a field's name, type, default and help, and
drifts from the class the Serve config and the engine options use. Every flag defaults to
"not given", so the settings class's own default (or optimum's) applies.
"""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any

from rbln_ray.compile.settings import CompileSettings


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _argument(annotation: Any) -> dict[str, Any]:
    """argparse options for a field's type (``X | None`` is X; a tuple of ints a comma list;
    a Literal its choices; a bool a --x/--no-x pair; a dict NAME=VALUE words)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return {"choices": list(typing.get_args(annotation))}
    if origin is tuple:
        return {"type": str, "metavar": "N,N,..."}
    if origin is dict:  # NAME=VALUE pairs, as vLLM's --lora-modules
        return {"type": str, "nargs": "+", "metavar": "NAME=DIR"}
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    return {"type": annotation}


def add_compile_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per :class:`CompileSettings` field."""
    group = parser.add_argument_group("compile settings")
    for name, field in CompileSettings.model_fields.items():
        default = "" if field.default is None else f" (default: {field.default})"
        group.add_argument(
            _flag(name),
            dest=name,
            default=None,
            help=f"{field.description}{default}",
            **_argument(field.annotation),
        )


def settings_from_args(args: argparse.Namespace) -> CompileSettings:
    """The settings the flags given name; every other field at its default."""
    given = {
        name: getattr(args, name)
        for name in CompileSettings.model_fields
        if getattr(args, name, None) is not None
    }
    return CompileSettings.from_dict(given)
