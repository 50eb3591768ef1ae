"""Speculative decoding's verify graphs, compiled inside optimum-rbln's own compile, against
transformers.

A verify call scores ``W`` tokens per row in one decode graph; its logits at every position
must be transformers' logits of the same sequence (eager attention with the block count
given, flash attention across a partition boundary with optimum sizing the KV cache itself,
and an explicit attention mask). The KV it writes is the model's KV: a second verify at the
same positions with other drafts (a rejection's roll-back) and optimum's own decode graph
after it read it back exactly.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from rbln_ray.common.artifact_files import SPEC_MANIFEST
from rbln_ray.compile import CompiledArtifact, CompileSettings, compile_hf_model
from rbln_ray.compile.spec_graphs import load_verify_runtimes

K, B = 3, 2
W = K + 1
TOL = 1e-4

CASES = {
    # eager: kvcache_num_blocks given (optimum's eager default): graphs added after compile
    "eager": dict(attn_impl="eager", max_seq_len=256, decoder_batch_sizes=(2, 1)),
    # flash: optimum sizes the KV cache from the compiled graphs, verify graphs included
    "flash": dict(
        attn_impl="flash_attn",
        max_seq_len=2048,
        kvcache_partition_len=1024,
        decoder_batch_sizes=(2, 1),
    ),
    "mask": dict(
        attn_impl="eager", max_seq_len=256, decoder_batch_sizes=(2, 1), use_attention_mask=True
    ),
}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, tiny_models):
    cache: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in cache:
            out = tmp_path_factory.mktemp(f"spec-{case}")
            settings = CompileSettings(batch_size=B, spec_tokens=K, **CASES[case])
            compile_hf_model(tiny_models["llama"], out, settings)
            cache[case] = out
        return cache[case]

    return get


@pytest.fixture(scope="module")
def reference(tiny_models):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    return model.eval()


def ref_logits(reference, tokens: list[int], first: int) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([tokens])).logits[0, first:]


def load(out: Path, device: int = 0):
    from optimum.rbln import RBLNAutoModelForCausalLM

    model = RBLNAutoModelForCausalLM.from_pretrained(str(out), export=False, rbln_device=device)
    art = CompiledArtifact.load(out)
    return model, art, load_verify_runtimes(out, art.verify_graphs, device)


def mask_for(art, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if not art.use_attention_mask:
        return ()
    span = torch.arange(art.max_seq_len)
    return ((span.view(1, 1, 1, -1) <= positions.view(positions.shape[0], 1, -1, 1)).float(),)


def prefill(model, art, prompts, tables) -> None:
    for prompt, table in zip(prompts, tables, strict=True):
        model.prefill_decoder(
            input_ids=torch.tensor([prompt[:-1]]),
            cache_position=torch.arange(len(prompt) - 1, dtype=torch.int32).unsqueeze(0),
            block_tables=torch.tensor(table, dtype=torch.int16),
        )


def verify(runtime, art, prompts, drafts, tables) -> torch.Tensor:
    ids = torch.tensor([[p[-1], *d] for p, d in zip(prompts, drafts, strict=True)])
    pos = torch.tensor([[len(p) - 1 + i for i in range(W)] for p in prompts], dtype=torch.int32)
    bt = torch.tensor(tables, dtype=torch.int16)
    return runtime(ids, pos, bt, *mask_for(art, pos))


@pytest.mark.parametrize("case", list(CASES))
def test_verify_logits_match_transformers_at_every_position(compiled, reference, case):
    out = compiled(case)
    manifest = json.loads((out / SPEC_MANIFEST).read_text())
    assert {g["name"] for g in manifest["graphs"]} == {"verify_batch_2_w4", "verify_batch_1_w4"}
    assert not any("verify" in p.name for p in out.glob("*.rbln"))  # not optimum's graphs
    config = json.loads((out / "rbln_config.json").read_text())
    assert "verify" not in json.dumps(config.get("_compile_cfgs", []))
    model, art, runtimes = load(out)
    assert art.spec_tokens == K and sorted(runtimes) == [1, 2]

    g = torch.Generator().manual_seed(0)
    flash = case == "flash"
    lengths = [1023, 40] if flash else [37, 120]  # flash: the window crosses position 1024
    prompts = [torch.randint(3, 4000, (n,), generator=g).tolist() for n in lengths]
    tables = [[0, 1], [2, 3]] if flash else [[0], [1]]
    prefill(model, art, prompts, tables)

    for attempt in range(2):  # the second: other drafts at the same positions (roll-back)
        drafts = [torch.randint(3, 4000, (K,), generator=g).tolist() for _ in prompts]
        logits = verify(runtimes[2], art, prompts, drafts, tables)
        assert tuple(logits.shape) == (B, W, 4096)
        for row, (p, d) in enumerate(zip(prompts, drafts, strict=True)):
            expected = ref_logits(reference, p + d, len(p) - 1)
            assert (logits[row] - expected).abs().max() < TOL, (case, attempt, row)

    # optimum's own decode graph reads the KV the verify call wrote: accept one draft
    pos = torch.tensor([[len(p) + 1] for p in prompts], dtype=torch.int32)
    dec = model.decoders[2](
        input_ids=torch.tensor([[d[1]] for d in drafts]),
        cache_position=pos,
        block_tables=torch.tensor(tables, dtype=torch.int16),
        **({"attention_mask": mask_for(art, pos)[0]} if art.use_attention_mask else {}),
    ).logits
    for row, (p, d) in enumerate(zip(prompts, drafts, strict=True)):
        expected = ref_logits(reference, p + d[:2], len(p) + 1)[0]
        assert (dec[row, -1] - expected).abs().max() < TOL


def test_modelled_mode_computes_and_charges_the_modelled_time(compiled, monkeypatch):
    """Modelled mode: the same outputs as compute mode, each call lasting at least its
    modelled device time (here as llama-3.2-1b), verify calls logged as ``verify``."""
    from rbln_ray.emulator import call_log
    from rbln_ray.emulator.timing import GraphTiming
    from rbln_ray.npu.cost_model import PRESETS, Row, call_cost

    out = compiled("eager")
    prompts = [list(range(10, 47)), list(range(100, 220))]
    drafts = [[5, 6, 7], [8, 9, 10]]
    tables = [[0], [1]]
    model, art, runtimes = load(out)
    prefill(model, art, prompts, tables)
    computed = verify(runtimes[2], art, prompts, drafts, tables)
    del model, runtimes

    monkeypatch.setenv("RBLN_RAY_EMULATOR_MODE", "modelled")
    monkeypatch.setenv("RBLN_RAY_TIMING_SHAPE", f"{out.name}=llama-3.2-1b")
    model, art, runtimes = load(out, device=1)
    prefill(model, art, prompts, tables)
    call_log.reset()
    started = time.perf_counter()
    modelled = verify(runtimes[2], art, prompts, drafts, tables)
    took = time.perf_counter() - started
    assert torch.equal(modelled, computed)

    timing = GraphTiming(runtimes[2]._cm)
    ids = torch.zeros(B, W, dtype=torch.long)
    pos = torch.tensor([[36, 37, 38, 39], [119, 120, 121, 122]], dtype=torch.int32)
    rows, logit_rows, kind = timing.rows((ids, pos))
    assert (kind, logit_rows) == ("verify", B * W)
    assert rows == [Row(W, 36), Row(W, 119)]
    seconds = call_cost(PRESETS["llama-3.2-1b"], rows, B * W, timing.spec).seconds
    assert timing.cost((ids, pos)).seconds == seconds
    (call,) = call_log.snapshot()["calls"]
    assert call["kind"] == "verify" and call["graph"] == out.name
    assert call["modelled_s"] == pytest.approx(seconds)
    assert took >= seconds and call["end"] - call["start"] >= seconds
    assert "modelled" in repr(runtimes[2])
