"""rbln-ray's typed engine options and the placement plan built from them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rbln_ray.compile import CompileSettings
from rbln_ray.vllm_plugin.options import (
    COMPILED_DIR_KEY,
    KEYS,
    RBLNOptionError,
    RBLNOptions,
    record,
)


def test_defaults_and_typed_values() -> None:
    assert RBLNOptions.from_additional_config(None) == RBLNOptions()
    options = RBLNOptions.from_additional_config(
        {
            "rbln_compile": {"batch_size": 8, "decoder_batch_sizes": [8, 4]},
            "rbln_decode_steps_between_chunks": 3,
            "rbln_placement_strategy": "spread",
            "rbln_placement_timeout_s": "12.5",
            "rbln_ray_driver_pid": "1234",
            "other_plugin_key": object(),  # not ours: left alone
        }
    )
    assert options.compile == CompileSettings(batch_size=8, decoder_batch_sizes=(8, 4))
    assert options.decode_steps_between_chunks == 3
    assert (options.placement_strategy, options.placement_timeout_s) == ("SPREAD", 12.5)
    assert options.driver_pid == 1234


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"rbln_decode_steps_between_chunk": 2}, "unknown rbln-ray options"),
        ({"rbln_decode_steps_between_chunks": -1}, "integer >= 0"),
        ({"rbln_decode_steps_between_chunks": True}, "integer >= 0"),
        ({"rbln_placement_strategy": "NEAR"}, "expected one of"),
        ({"rbln_placement_timeout_s": 0}, "seconds > 0"),
        ({"rbln_placement_timeout_s": "soon"}, "seconds > 0"),
        ({"rbln_compile": {"batchsize": 4}}, "unknown RBLN compile settings"),
        ({"rbln_compile": {"attn_impl": "sdpa"}}, "attn_impl must be"),
    ],
)
def test_bad_options_name_the_key(extra: dict, message: str) -> None:
    with pytest.raises(RBLNOptionError, match=message):
        RBLNOptions.from_additional_config(extra)


def test_only_decided_keys_are_written() -> None:
    config = SimpleNamespace(additional_config=None)
    record(config, COMPILED_DIR_KEY, "/models/x")
    assert RBLNOptions.from_vllm_config(config).compiled_dir == "/models/x"
    with pytest.raises(KeyError, match="not an option rbln-ray writes"):
        record(config, "rbln_placement_strategy", "PACK")
    assert all(key.startswith("rbln_") for key in KEYS)


def test_additional_config_must_be_a_dict() -> None:
    with pytest.raises(RBLNOptionError, match="must be a dict"):
        RBLNOptions.from_vllm_config(SimpleNamespace(additional_config=["x"]))


def test_placement_plan_bundles_and_reuse_of_a_given_group() -> None:
    from rbln_ray.executor import placement

    plan = placement.PlacementPlan(num_workers=2, devices_per_worker=2, strategy="SPREAD")
    assert plan.bundles() == [{"RBLN": 2.0, "CPU": 1.0}] * 2
    assert plan.describe() == "2 workers × 2 RBLN devices (+1 CPU each, strategy SPREAD)"
    # A Serve replica's group: the replica's own CPU bundle first, then the workers'.
    given = SimpleNamespace(bundle_specs=[{"CPU": 1}, {"RBLN": 2, "CPU": 1}, {"RBLN": 2}])
    group, bundles, created = placement.acquire(given, plan)
    assert (group, bundles, created) == (given, [1, 2], False)
    small = SimpleNamespace(bundle_specs=[{"CPU": 1}, {"RBLN": 1, "CPU": 1}])
    with pytest.raises(placement.PlacementError, match="needs 2 workers × 2 RBLN"):
        placement.acquire(small, plan)
