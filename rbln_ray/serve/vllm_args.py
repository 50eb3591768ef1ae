"""A model's options parsed exactly as ``vllm serve`` parses its command line.

Why argv and not ``setattr`` on vLLM's parsed namespace: vLLM's parser turns many options
into objects (``--structured-outputs-config '{...}'`` into a ``StructuredOutputsConfig``,
``--compilation-config`` into a dict vLLM then validates, ``--enable-auto-tool-choice`` into a
flag with a ``--no-`` twin). Setting the attribute after parsing leaves a plain dict where
vLLM expects its config object: ``args.structured_outputs_config.reasoning_parser`` (read by
vLLM's ``init_app_state``) then raises, and the reasoning parser never reaches the serving
layer. So rbln-ray renders a model's ``engine_kwargs`` (``{python_name: value}``) into the
argv a user would type and hands it to vLLM's own parser and ``validate_parsed_serve_args``:
a model's config means what the same options mean to ``vllm serve``, and its mistakes get
vLLM's messages.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from typing import Any

from rbln_ray.upstream import vllm_internals

# Set by rbln-ray from a model's name and directory; never from engine_kwargs.
RESERVED = {"model": "model", "served_model_name": "name"}


def _parser() -> Any:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def _flag_value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, dict | list) else str(value)


def engine_argv(kwargs: dict[str, Any], parser: Any = None) -> list[str]:
    """The ``vllm serve`` arguments that mean ``kwargs`` (python option names, as in
    ``AsyncEngineArgs`` / vLLM's parsed namespace); ``ValueError`` naming an unknown one."""
    parser = parser or _parser()
    actions = {a.dest: a for a in vllm_internals.parser_actions(parser) if a.option_strings}
    argv: list[str] = []
    for key, value in kwargs.items():
        if key in RESERVED:
            raise ValueError(
                f"engine_kwargs: {key!r} is set from the model's {RESERVED[key]!r} field"
            )
        action = actions.get(key)
        if action is None:
            raise ValueError(f"engine_kwargs: unknown vLLM option {key!r}")
        flag = action.option_strings[0]
        if value is None:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else action.option_strings[1])
        elif action.nargs == 0:  # store_true / store_false: the flag or nothing
            if bool(value) != bool(action.default):
                argv.append(flag)
        elif isinstance(action, argparse._AppendAction):
            for item in value if isinstance(value, list | tuple) else [value]:
                argv += [flag, _flag_value(item)]
        elif action.nargs in ("+", "*") or isinstance(action.nargs, int):
            items = value if isinstance(value, list | tuple) else [value]
            argv += [flag, *(_flag_value(item) for item in items)]
        else:
            argv += [flag, _flag_value(value)]
    return argv


def serve_namespace(model_path: str, name: str, kwargs: dict[str, Any]) -> argparse.Namespace:
    """``vllm serve MODEL --served-model-name NAME <kwargs as flags>``'s parsed and validated
    arguments, with the tool and reasoning parser plugins it names imported (as vLLM's
    server does before building its app)."""
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    parser = _parser()
    argv = ["--model", model_path, "--served-model-name", name, *engine_argv(kwargs, parser)]
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on a bad value: raise with its message
        text = said.getvalue()
        why = text[text.find("error:") :].strip() if "error:" in text else f"exit {exc.code}"
        raise ValueError(f"model {name}: vLLM rejects the options {argv[4:]}: {why}") from None
    validate_parsed_serve_args(args)
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    if args.tool_parser_plugin and len(args.tool_parser_plugin) > 3:
        ToolParserManager.import_tool_parser(args.tool_parser_plugin)
    if args.reasoning_parser_plugin and len(args.reasoning_parser_plugin) > 3:
        ReasoningParserManager.import_reasoning_parser(args.reasoning_parser_plugin)
    # vllm serve finds an unknown parser name only when its app starts; say it at config time
    try:
        if args.tool_call_parser:
            ToolParserManager.get_tool_parser(args.tool_call_parser)
        if args.reasoning_parser:
            ReasoningParserManager.get_reasoning_parser(args.reasoning_parser)
    except KeyError as exc:
        raise ValueError(f"model {name}: {exc.args[0]}") from None
    return args
