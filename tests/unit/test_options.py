"""rbln-ray's typed engine options and the placement plan built from them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rbln_ray.compile import CompileSettings
from rbln_ray.vllm_plugin.options import (
    EngineDecisions,
    PlacementSettings,
    RBLNAdditionalConfig,
    RBLNOptionError,
    RBLNOptions,
    decide,
    engine_decisions,
    engine_options,
)


def test_defaults_and_typed_values() -> None:
    assert RBLNOptions.from_additional_config(None) == RBLNOptions()
    options = RBLNOptions.from_additional_config(
        {
            "rbln_compile": {"batch_size": 8, "decoder_batch_sizes": [8, 4]},
            "rbln_decode_steps_between_chunks": 3,
            "rbln_placement_strategy": "spread",
            "rbln_placement_timeout_s": "12.5",
            "other_plugin_key": object(),  # not ours: left alone
        }
    )
    assert options.compile == CompileSettings(batch_size=8, decoder_batch_sizes=(8, 4))
    assert options.decode_steps_between_chunks == 3
    assert (options.placement_strategy, options.placement_timeout_s) == ("SPREAD", 12.5)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"rbln_decode_steps_between_chunk": 2}, "unknown rbln-ray options"),
        ({"rbln_decode_steps_between_chunks": -1}, "between_chunks.*greater than or equal to 0"),
        ({"rbln_decode_steps_between_chunks": True}, "decode_steps_between_chunks.*integer"),
        ({"rbln_placement_strategy": "NEAR"}, "placement_strategy.*'PACK'"),
        ({"rbln_placement_timeout_s": 0}, "placement_timeout_s.*greater than 0"),
        ({"rbln_placement_timeout_s": "soon"}, "placement_timeout_s.*number"),
        ({"rbln_compiled_dir": "/x"}, "unknown rbln-ray options"),  # decisions are not options
        ({"rbln_compile": {"batchsize": 4}}, "unknown RBLN compile settings"),
        ({"rbln_compile": {"attn_impl": "sdpa"}}, "attn_impl.*'eager' or 'flash_attn'"),
    ],
)
def test_bad_options_name_the_key(extra: dict, message: str) -> None:
    with pytest.raises(RBLNOptionError, match=message):
        RBLNOptions.from_additional_config(extra)


def test_decisions_travel_beside_the_users_keys_and_survive_pickling() -> None:
    import pickle

    user = {"rbln_decode_steps_between_chunks": 2, "other": 1}
    config = SimpleNamespace(additional_config=user)
    assert engine_options(config).decode_steps_between_chunks == 2
    decide(config, compiled_dir="/models/x", ray_address="127.0.0.1:6379", driver_pid=7)
    state = config.additional_config
    assert isinstance(state, RBLNAdditionalConfig) and state.user == user  # user's dict as given
    assert state.get("other") == 1
    again = pickle.loads(pickle.dumps(config))  # how the config reaches the engine core
    assert engine_decisions(again) == EngineDecisions("/models/x", "127.0.0.1:6379", 7)
    # the Ray address is not part of the hash: every replica of a deployment hashes alike
    other = SimpleNamespace(additional_config=dict(user))
    decide(other, compiled_dir="/models/x", ray_address="10.0.0.1:6379", driver_pid=8)
    assert other.additional_config.compute_hash() == state.compute_hash()


def test_one_default_per_setting_shared_by_engine_options_and_serve_config() -> None:
    """The Serve config's placement fields and compile settings are the engine options'
    classes (read from the classes, not copies of their values)."""
    from rbln_ray.serve.config import ModelDeploymentConfig

    assert issubclass(ModelDeploymentConfig, PlacementSettings)
    assert issubclass(RBLNOptions, PlacementSettings)
    fields = ModelDeploymentConfig.model_fields
    for name, field in PlacementSettings.model_fields.items():
        assert fields[name].default == field.default
    assert fields["compile"].annotation is CompileSettings
    model = ModelDeploymentConfig(name="m", model="demo", compile={"batch_size": 2})
    placement = {"rbln_" + k: v for k, v in model.placement().model_dump().items()}
    options = RBLNOptions.from_additional_config(
        {"rbln_compile": model.compile.as_dict(), **placement}
    )
    assert options.compile == model.compile and options.placement() == model.placement()


def test_cli_compile_flags_are_generated_from_the_settings_class() -> None:
    from rbln_ray.cli.main import parser

    args = parser().parse_args(
        ["compile", "hf", "out", "--batch-size", "2", "--decoder-batch-sizes", "2,1"]
    )
    from rbln_ray.cli.compile_flags import settings_from_args

    settings = settings_from_args(args)
    assert settings == CompileSettings(batch_size=2, decoder_batch_sizes=(2, 1))
    flags = {a.dest for a in parser()._subparsers._group_actions[0].choices["compile"]._actions}
    assert set(CompileSettings.model_fields) <= flags


def test_additional_config_must_be_a_dict() -> None:
    with pytest.raises(RBLNOptionError, match="must be a dict"):
        engine_options(SimpleNamespace(additional_config=["x"]))


def test_placement_plan_bundles_and_reuse_of_a_given_group() -> None:
    from rbln_ray.executor import placement

    plan = placement.PlacementPlan(2, 2, PlacementSettings(placement_strategy="SPREAD"))
    assert plan.bundles() == [{"RBLN": 2.0, "CPU": 1.0}] * 2
    assert plan.describe() == "2 workers × 2 RBLN devices (+1 CPU each, strategy SPREAD)"
    # A Serve replica's group: the replica's own CPU bundle first, then the workers'.
    given = SimpleNamespace(bundle_specs=[{"CPU": 1}, {"RBLN": 2, "CPU": 1}, {"RBLN": 2}])
    group, bundles, created = placement.acquire(given, plan)
    assert (group, bundles, created) == (given, [1, 2], False)
    small = SimpleNamespace(bundle_specs=[{"CPU": 1}, {"RBLN": 1, "CPU": 1}])
    with pytest.raises(placement.PlacementError, match="needs 2 workers × 2 RBLN"):
        placement.acquire(small, plan)
