"""Emulated REBEL devices (RBLN-CR13): selection, optimum-rbln's own per-chiplet budgets,
``rbln-ray devices`` / ``rbln-ray plan --device rebel``, and a compile + ``vllm.LLM`` run
token-exact against transformers.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import uuid
from types import SimpleNamespace

import pytest
import rebel
import torch

from rbln_ray.emulator import DeviceError, devices
from rbln_ray.npu import kinds
from rbln_ray.npu.cost_model import REBEL_SPEC, DeviceSpec
from tests.helpers import ROOT, compiled_model, greedy_request, hf_greedy, run_script

GiB = 2**30
REBEL_ENV = {kinds.KIND_ENV: "rebel"}


@pytest.fixture
def on_rebel(monkeypatch):
    monkeypatch.setenv(kinds.KIND_ENV, "rebel")


def _tiny_graph(npu: str | None):
    class AddKV(torch.nn.Module):
        def forward(self, x, kv):
            return (x + kv.sum()).reshape(-1)

    ctx = rebel.CompileContext()
    kv = torch.zeros(4, 2, 1, 16, 8, device="meta")
    ctx.mark_static_address(kv, "past_key_values_0")
    info = [("x", [2], "float32"), ("past_key_values_0", list(kv.shape), "float32")]
    return rebel.compile_from_torch(AddKV(), info, npu=npu, compile_context=ctx)


def test_kind_is_chosen_by_env_and_reported_by_rebel(monkeypatch):
    monkeypatch.delenv(kinds.KIND_ENV, raising=False)
    assert rebel.get_npu_name(0) == "RBLN-CA25"
    for value in ("rebel", "REBEL", "RBLN-CR13"):
        monkeypatch.setenv(kinds.KIND_ENV, value)
        assert rebel.get_npu_name(0) == "RBLN-CR13"
    monkeypatch.setenv(kinds.KIND_ENV, "gaudi")
    with pytest.raises(kinds.DeviceKindError, match="RBLN_RAY_EMULATED_NPU='gaudi'.*rebel"):
        rebel.get_npu_name(0)


def test_budgets_are_optimum_rblns_own():
    from optimum.rbln.utils.runtime_utils import get_available_dram_per_chiplet

    assert kinds.ATOM.chiplet_budget == get_available_dram_per_chiplet(1, "RBLN-CA25")
    assert kinds.REBEL.chiplet_budget == get_available_dram_per_chiplet(4, "RBLN-CR13")
    assert kinds.REBEL.budget == 140 * GiB and kinds.REBEL.chiplets == 4


def test_optimum_sizes_the_kv_cache_over_four_chiplets(on_rebel):
    """optimum's own KV-block search reads the compiled model's per-chiplet allocations."""
    from optimum.rbln.transformers.modeling_attention_utils import (
        RBLNDecoderOnlyFlashAttentionMixin as Mixin,
    )

    cm = _tiny_graph("RBLN-CR13")
    alloc = cm.get_alloc_per_chiplet_by_key()
    assert all(len(v) == 1 and len(v[0]) == 4 for v in alloc.values())  # 1 device x 4 chiplets
    config = SimpleNamespace(npu="RBLN-CR13", memory_budget=None)
    _, kv_sizes, per_chiplet, chiplets = Mixin._collect_chiplet_kvcache_inputs(
        {"prefill": cm}, config
    )
    assert chiplets == {(0, 0), (0, 1), (0, 2), (0, 3)}
    assert per_chiplet == 35 * GiB
    total_kv = 4 * 2 * 16 * 8 * 4
    assert [sum(c) for c in kv_sizes["past_key_values_0"]] == [total_kv]


def test_ledger_checks_each_chiplet(on_rebel):
    key = devices.LEDGER.acquire(3)
    try:
        devices.LEDGER.charge(key, "big", 139 * GiB, "weights")  # 34.75 GiB per chiplet
        with pytest.raises(RuntimeError, match=r"RBLN-CR13.*chiplet 0\) but only 256\.0 MiB"):
            devices.LEDGER.charge(key, "more", 2 * GiB, "kv cache")
        row = next(d for d in devices.list_devices() if d.id == 3)
        assert (row.name, row.memory_total, row.memory_used) == ("RBLN-CR13", 144 * GiB, 139 * GiB)
    finally:
        devices.LEDGER.release(key, "big")


def test_runtimes_refuse_artifacts_of_the_other_family(monkeypatch):
    rebel_graph = _tiny_graph("RBLN-CR13")
    monkeypatch.delenv(kinds.KIND_ENV, raising=False)
    with pytest.raises(DeviceError, match="compiled for RBLN-CR13 but .* are RBLN-CA25"):
        rebel.Runtime(rebel_graph, device=0)
    monkeypatch.setenv(kinds.KIND_ENV, "rebel")
    rt = rebel.Runtime(rebel_graph, device=0)
    assert rt(torch.ones(2)).tolist() == [1.0, 1.0]
    with pytest.raises(DeviceError, match="compiled for RBLN-CA25"):
        rebel.Runtime(_tiny_graph("RBLN-CA25"), device=0)
    del rt
    gc.collect()


def test_timing_spec_follows_the_emulated_kind(on_rebel):
    spec = DeviceSpec.from_env()
    assert spec == REBEL_SPEC
    assert (spec.dram_bytes_per_s, spec.peak_flops) == (2.7e12, 1e15)
    assert DeviceSpec.from_env(kind="atom").dram_bytes_per_s == 256e9


def _cli(*args: str, **env: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "rbln_ray.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), "RBLN_RAY_NODE_ID": uuid.uuid4().hex, **env},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_rbln_ray_devices_shows_rebel():
    out = _cli("devices", **REBEL_ENV)
    rows = [ln.split() for ln in out.splitlines()[1:]]
    assert len(rows) == 4 and all(r[1] == "RBLN-CR13" and r[4] == "147456" for r in rows), out


def test_rbln_ray_plan_for_rebel():
    args = ["plan", "--model", "llama-3-70b", "--input-len", "1024", "--output-len", "256"]
    args += ["--cards-per-node", "16"]
    rebel_plan = json.loads(_cli(*args, "--rate", "10", "--device", "rebel", "--json"))
    atom_plan = json.loads(_cli(*args, "--rate", "10", "--device", "atom", "--json"))
    assert rebel_plan["spec"]["name"] == "REBEL" and rebel_plan["workload"]["prefill_chunk"] == 512
    assert rebel_plan["spec"]["dram_capacity"] == 140 * GiB
    # 140 GiB fits a 70B FP16 model on one device; 16 GiB ATOMs need a shard group of >= 16
    fits = [o for o in rebel_plan["options"] if o["fits"]]
    assert min(o["devices_per_worker"] for o in fits) == 1
    atom_fits = [o for o in atom_plan["options"] if o["fits"]]
    assert min(o["devices_per_worker"] for o in atom_fits) >= 16
    text = _cli(*args, "--rate", "10", "--device", "rebel")
    assert "REBEL card(s)" in text and "140.0 GiB usable" in text


@pytest.mark.slow
def test_compile_and_vllm_llm_on_rebel_are_token_exact(monkeypatch):
    monkeypatch.setenv(kinds.KIND_ENV, "rebel")
    model = compiled_model("llama", max_seq_len=1024)
    cfg = json.loads((model / "rbln_config.json").read_text())
    assert cfg["prefill_chunk_size"] == 512  # optimum-rbln's RBLN-CR default
    assert rebel.RBLNCompiledModel(model / "prefill.rbln").npu == "RBLN-CR13"
    prompts = [[5], [9, 8, 7], list(range(1000, 1037)), [7] * 600, [3000 + i for i in range(60)]]
    spec = {
        "model": str(model),
        "requests": [greedy_request(p, 16) for p in prompts],
    }
    result = run_script("rbln_llm_run.py", json.dumps(spec), env=REBEL_ENV)
    got = [o[0]["token_ids"] for o in result["outputs"]]
    from rbln_ray.models import build_tiny_model

    assert got == hf_greedy(build_tiny_model(family="llama"), prompts, 16)
