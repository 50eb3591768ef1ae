"""A model's ``engine_kwargs`` mean what the same options mean to ``vllm serve``."""

from __future__ import annotations

import pytest

from rbln_ray.serve.config import load_config
from rbln_ray.serve.vllm_args import engine_argv, serve_namespace

TOOLS = {
    "enable_auto_tool_choice": True,
    "tool_call_parser": "hermes",
    "reasoning_parser": "deepseek_r1",
    "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True},
    "logits_processors": ["rbln_ray.models.scripted:ScriptedOutput"],
    "enable_prefix_caching": False,
    "disable_log_stats": True,
    "additional_config": {"rbln_decode_steps_between_chunks": 2},
    "middleware": ["a.b"],
    "max_model_len": 256,
}


def test_kwargs_become_the_flags_a_user_would_type() -> None:
    argv = engine_argv(TOOLS)
    assert argv[:3] == ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    assert "--no-enable-prefix-caching" in argv and "--disable-log-stats" in argv
    i = argv.index("--structured-outputs-config")
    assert argv[i + 1] == '{"backend": "xgrammar", "disable_any_whitespace": true}'
    assert engine_argv({"enable_auto_tool_choice": False}) == ["--no-enable-auto-tool-choice"]
    assert engine_argv({"disable_log_stats": False, "chat_template": None}) == []


def test_config_objects_are_vllms_and_the_reasoning_parser_reaches_the_serving_layer() -> None:
    """``setattr`` left ``structured_outputs_config`` a dict, so vLLM's ``init_app_state``
    could not read ``args.structured_outputs_config.reasoning_parser``; parsed, it is vLLM's
    config object, shared with the engine arguments (where vLLM writes the parser into it)."""
    from vllm.config import StructuredOutputsConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = serve_namespace("/models/m", "m", TOOLS)
    assert isinstance(args.structured_outputs_config, StructuredOutputsConfig)
    assert args.structured_outputs_config.disable_any_whitespace
    assert args.logits_processors == ["rbln_ray.models.scripted:ScriptedOutput"]
    assert args.enable_prefix_caching is False and args.middleware == ["a.b"]
    assert args.additional_config == {"rbln_decode_steps_between_chunks": 2}
    assert args.served_model_name == ["m"] and args.reasoning_parser == "deepseek_r1"
    engine = AsyncEngineArgs.from_cli_args(args)
    assert engine.structured_outputs_config is args.structured_outputs_config


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"no_such_option": 1}, "unknown vLLM option 'no_such_option'"),
        ({"served_model_name": "x"}, "'name' field"),
        ({"max_model_len": "lots"}, "--max-model-len"),
        ({"structured_outputs_config": {"disable_any_whitespace": True}}, "backend"),
        ({"enable_auto_tool_choice": True}, "requires --tool-call-parser"),
        ({"tool_call_parser": "nonexistent"}, "nonexistent"),
        ({"reasoning_parser": "nonexistent"}, "nonexistent"),
    ],
)
def test_bad_options_get_vllms_reason(kwargs: dict, needle: str) -> None:
    with pytest.raises((ValueError, TypeError)) as caught:
        serve_namespace("/models/m", "m", kwargs)
    assert needle in str(caught.value), caught.value


def test_chat_fields_merge_into_engine_kwargs(tmp_path) -> None:
    model = {
        "name": "m",
        "model": str(tmp_path),
        "tool_call_parser": "hermes",
        "enable_auto_tool_choice": True,
        "engine_kwargs": {"reasoning_parser": "deepseek_r1"},
    }
    merged = load_config({"models": [model]}).models[0].vllm_kwargs()
    assert merged == {
        "reasoning_parser": "deepseek_r1",
        "tool_call_parser": "hermes",
        "enable_auto_tool_choice": True,
        "enable_tokenizer_info_endpoint": True,
    }
    twice = {**model, "engine_kwargs": {"tool_call_parser": "llama3_json"}}
    with pytest.raises(ValueError, match="give it once"):
        load_config({"models": [twice]})
