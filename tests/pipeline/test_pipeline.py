"""Pipeline stages across nodes (issue #6 acceptance) on a 2-node × 2-RBLN Ray cluster.

One cluster and one set of compiled artifacts per module; each scenario runs
``pipeline_script.py`` in a fresh process (vLLM and Ray keep per-process state).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from tests.helpers import EIGHT_PROMPTS, count_refills, hf_greedy
from tests.ray_cluster import ENGINE_ENV, run_engine_script, wait_all_rbln_free

SCRIPT = Path(__file__).with_name("pipeline_script.py")
NUM_LAYERS = 4
COMPILE = {"batch_size": 4, "max_seq_len": 512, "decoder_batch_sizes": [4, 2, 1]}


# -- no cluster needed ----------------------------------------------------------------------


def test_split_layers_is_contiguous_and_even() -> None:
    from rbln_ray.compile.pipeline_manifest import split_layers

    assert split_layers(4, 2) == [(0, 2), (2, 4)]
    assert split_layers(5, 2) == [(0, 3), (3, 5)]
    assert split_layers(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError):
        split_layers(2, 3)


@pytest.mark.slow
@pytest.mark.parametrize(("stages", "attn_impl"), [(2, "eager"), (4, "eager"), (2, "flash_attn")])
def test_stage_graphs_in_process_match_transformers(
    tmp_path: Path, stages: int, attn_impl: str
) -> None:
    """The stage graphs alone (no Ray, no vLLM), chained in one process: greedy decoding of
    prompts crossing a prefill chunk equals transformers'. Localises a graph bug fast."""
    import torch

    os.environ.update(ENGINE_ENV)
    from rbln_ray.compile import CompileSettings, compile_pipeline
    from rbln_ray.models import build_tiny_model
    from rbln_ray.pipeline.stage import StageModel, StepPlan

    hf = build_tiny_model(family="llama", num_layers=NUM_LAYERS)
    settings = dict(COMPILE, attn_impl=attn_impl)
    if attn_impl == "flash_attn":
        settings.update(max_seq_len=2048, kvcache_partition_len=1024)
    out = compile_pipeline(hf, tmp_path / "staged", stages, CompileSettings(**settings))
    models = [StageModel.load(out, s, [0]) for s in range(stages)]
    manifest = models[0].manifest
    blocks_per_seq = manifest.max_seq_len // manifest.kvcache_block_size
    prompts, new_tokens = [[5], list(range(1000, 1037)), [7] * 130], 6

    def chain(plan: StepPlan, x: torch.Tensor) -> torch.Tensor:
        for model in models:
            x = model.run(plan, x)
        return x

    got = []
    for slot, prompt in enumerate(prompts):
        table = torch.arange(slot * blocks_per_seq, (slot + 1) * blocks_per_seq).short()
        n = len(prompt)
        positions = torch.arange(n, dtype=torch.int32)[None]
        logits = chain(StepPlan("prefill", positions, table, n), torch.tensor([prompt]))
        tokens = [int(logits[0, -1].argmax())]
        for i in range(new_tokens - 1):
            plan = StepPlan("decode", torch.tensor([[n + i]], dtype=torch.int32), table[None])
            tokens.append(int(chain(plan, torch.tensor([[tokens[-1]]]))[0, -1].argmax()))
        got.append(tokens)
    models.clear()  # release the runtimes (and their emulated device) now
    assert got == hf_greedy(hf, prompts, new_tokens)


# -- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 4-layer tiny Llama compiled as one optimum graph set (S=1) and as 2 and 4 stages."""
    os.environ.update(ENGINE_ENV)
    from rbln_ray.compile import CompileSettings, compile_hf_model, compile_pipeline
    from rbln_ray.emulator import ensure_runtime
    from rbln_ray.models import build_tiny_model

    ensure_runtime()
    root = tmp_path_factory.mktemp("pipeline-artifacts")
    hf = Path(build_tiny_model(family="llama", num_layers=NUM_LAYERS))
    out = {"hf": hf, "s1": root / "s1"}
    settings = CompileSettings(**COMPILE)
    compile_hf_model(hf, out["s1"], settings)
    for stages in (2, 4):
        out[f"s{stages}"] = compile_pipeline(hf, root / f"s{stages}", stages, settings)
    return out


def run_script(address: str, spec: dict, timeout: float = 600) -> dict:
    return run_engine_script(SCRIPT, address, spec, timeout)


def assert_spread(devices: list[dict], stages: int) -> None:
    """One worker per stage, no (node, device) shared, stages spread over both nodes."""
    assert sorted(d["stage"] for d in devices) == list(range(stages))
    placed = {(d["node"], d["rbln_devices"]) for d in devices}
    assert len(placed) == stages, devices  # no device shared
    nodes = [d["node"] for d in sorted(devices, key=lambda d: d["stage"])]
    assert len(set(nodes)) == min(stages, 2), nodes
    if stages == 2:
        assert nodes[0] != nodes[1]


# -- acceptance -----------------------------------------------------------------------------


@pytest.mark.multinode
@pytest.mark.slow
def test_two_and_four_stages_match_single_stage_and_transformers(cluster, artifacts) -> None:
    """Acceptance 1 + 2: S = 2 and S = 4 (SPREAD) give transformers' greedy tokens, like the
    single-stage artifact; each stage is its own worker on its own device, across nodes."""
    max_tokens = 16
    expected = hf_greedy(artifacts["hf"], EIGHT_PROMPTS, max_tokens)
    single = run_script(
        cluster,
        {"models": [str(artifacts["s1"])], "prompts": EIGHT_PROMPTS, "max_tokens": max_tokens},
    )
    assert single["engines"][0]["tokens"] == expected
    staged = run_script(
        cluster,
        {
            "models": [str(artifacts["s2"]), str(artifacts["s4"])],
            "prompts": EIGHT_PROMPTS,
            "max_tokens": max_tokens,
            "strategy": "SPREAD",
        },
    )
    for engine, stages in zip(staged["engines"], (2, 4), strict=True):
        assert engine["tokens"] == expected, f"S={stages}"
        assert_spread(engine["devices"], stages)
        layers = [d["layers"] for d in sorted(engine["devices"], key=lambda d: d["stage"])]
        assert layers[0][0] == 0 and layers[-1][1] == NUM_LAYERS
    assert wait_all_rbln_free() == 4


@pytest.mark.multinode
@pytest.mark.slow
def test_continuous_batching_32_requests_two_stages(cluster, artifacts) -> None:
    """32 requests on a batch-4, 2-stage model: each equals its solo greedy result, and
    freed slots are refilled while other requests are mid-decode."""
    rng = random.Random(7)
    lengths = [1, 300] + [rng.randint(1, 300) for _ in range(30)]
    prompts = [[rng.randrange(4096) for _ in range(n)] for n in lengths]
    max_tokens = [1, 64] + [rng.randint(1, 64) for _ in range(30)]
    result = run_script(
        cluster,
        {
            "models": [str(artifacts["s2"])],
            "prompts": prompts,
            "max_tokens": max_tokens,
            "rpc": ["step_stats"],
        },
    )
    (engine,) = result["engines"]
    expected = [
        hf_greedy(artifacts["hf"], [p], m)[0] for p, m in zip(prompts, max_tokens, strict=True)
    ]
    assert engine["tokens"] == expected

    stats = engine["rpc"]["step_stats"][0]  # rank 0 (every rank runs every step)
    history = stats["history"]
    assert stats["prefill_requests"] == 32
    assert max(len(ids) for _, kind, ids in history if kind == "decode") == 4
    # Two micro-batches in flight (vLLM's batch queue of S = 2): more requests decode at once
    # than one compiled batch holds.
    live: dict[str, tuple[int, int]] = {}
    for step, _kind, ids in history:
        for req in ids:
            first, _ = live.get(req, (step, step))
            live[req] = (first, step)
    assert max(sum(a <= s <= b for a, b in live.values()) for s, _, _ in history) > 4
    refills = count_refills(history)
    assert refills >= 10, f"only {refills} prefills interleaved with running decodes"
    # The other stage ran every step too.
    assert engine["rpc"]["step_stats"][1]["stage_device_seconds"] > 0
    assert wait_all_rbln_free() == 4


@pytest.mark.multinode
@pytest.mark.slow
@pytest.mark.parametrize("kill_stage", [1])
def test_killed_stage_fails_requests_fast(cluster, artifacts, kill_stage: int) -> None:
    """Acceptance 3: SIGKILL a later stage (rank 1) mid-generation → every in-flight
    request errors within 30 s, nothing hangs, and the devices are released."""
    prompts = [[1, 17, 42, 99, 7], [5, 6, 7, 8, 9, 10, 11], [300, 200, 100]]
    result = run_script(
        cluster,
        {
            "scenario": "kill",
            "models": [str(artifacts["s2"])],
            "prompts": prompts,
            "max_tokens": 400,
            "kill_stage": kill_stage,
            "strategy": "SPREAD",
        },
    )
    print(result)
    assert result["pending"] == 0
    assert len(result["errors"]) == len(prompts)
    assert all("finished without error" not in e for e in result["errors"]), result["errors"]
    assert result["error_s"] < 30, result
    assert wait_all_rbln_free() == 4
