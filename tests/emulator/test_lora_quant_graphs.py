"""Compiled-in LoRA adapters and quantized checkpoints, through optimum-rbln on the emulator.

The graphs are driven by hand (prefill per row, then one decode batch mixing the rows), and
each row is compared with an independent plain-torch reference: transformers with the row's
adapter merged into its weights, or with the checkpoint dequantized (fp8 KV: keys and values
rounded through float8 before attention). Each case also shows the test has teeth: adapted
rows differ from the base model, quantized tokens from the float model's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from rbln_ray.compile import CompileSettings
from rbln_ray.compile.family_compile import compile_model
from rbln_ray.models import build_tiny_model
from rbln_ray.models.adapters import build_tiny_adapter
from rbln_ray.models.quantized import build_tiny_quantized_model
from tests.helpers import hf_greedy, hf_greedy_merged, hf_greedy_quantized

NEW = 8
PROMPTS = [list(range(7, 47)), [300 + 3 * i for i in range(53)], [11, 12, 13]]
SETTINGS = CompileSettings(batch_size=4, max_seq_len=256, decoder_batch_sizes=(4,))


def _drive(model, prompts: list[list[int]], ids: list[int] | None) -> list[list[int]]:
    """Greedy tokens of each prompt: one prefill per row (slot = row), then decode steps of
    the compiled batch 4 with every row at once (row 3 padding); ``ids``: each row's adapter."""
    extra = (lambda i: {"lora_int_ids": torch.tensor([i], dtype=torch.int32)}) if ids else None
    tokens, pos = [], []
    for slot, prompt in enumerate(prompts):
        out = model.prefill_decoder(
            input_ids=torch.tensor([prompt]),
            cache_position=torch.arange(len(prompt), dtype=torch.int32).unsqueeze(0),
            block_tables=torch.tensor([slot], dtype=torch.int16),
            **(extra(ids[slot]) if extra else {}),
        )
        tokens.append([int(out.logits[0, -1].argmax())])
        pos.append(len(prompt))
    rows = len(prompts)
    for _ in range(NEW - 1):
        kw = {}
        if ids:
            kw["lora_int_ids"] = torch.tensor(ids + [0] * (4 - rows), dtype=torch.int32)
        out = model.decoders[4](
            input_ids=torch.tensor([[t[-1]] for t in tokens] + [[0]] * (4 - rows)),
            cache_position=torch.tensor([[p] for p in pos] + [[0]] * (4 - rows), dtype=torch.int32),
            block_tables=torch.tensor([[s] for s in range(rows)] + [[3]], dtype=torch.int16),
            **kw,
        )
        for r in range(rows):
            tokens[r].append(int(out.logits[r, -1].argmax()))
            pos[r] += 1
    return tokens


def _logit_errors(qdir: Path, family: str, prompt: list[int], logits: torch.Tensor):
    """Max |logit difference| of ``logits`` against the dequantized reference and against the
    float model, at the prompt's last token."""
    from transformers import AutoModelForCausalLM

    from tests.helpers import quant_reference_model

    x = torch.tensor([prompt])
    with torch.no_grad():
        ref = quant_reference_model(qdir)(x).logits[0, -1]
        hf = build_tiny_model(family=family)
        plain = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)(x)
    return float((logits - ref).abs().max()), float((logits - plain.logits[0, -1]).abs().max())


def _load(path: Path):
    from optimum.rbln import RBLNAutoModelForCausalLM

    from rbln_ray.compile.lora import loadable_dir

    return RBLNAutoModelForCausalLM.from_pretrained(
        str(loadable_dir(path)), export=False, rbln_device=0
    )


@pytest.mark.parametrize(
    ("family", "weights", "kv"),
    [
        ("llama", "int8", "fp16"),
        ("llama", "fp8", "fp16"),
        ("llama", "int8", "fp8"),
        ("qwen3", "fp8", "fp8"),
    ],
)
def test_quantized_graphs_match_dequantized_reference(tmp_path, family, weights, kv) -> None:
    qdir = build_tiny_quantized_model(weights, kv, family=family)
    out = compile_model(qdir, tmp_path / "q", SETTINGS)
    raw = json.loads((out / "rbln_config.json").read_text())
    assert raw["quantization"] == {
        "format": "rbln",
        "weights": weights,
        "activations": "fp16",
        "kv_caches": kv,
    }
    import rebel

    cm = rebel.RBLNCompiledModel(str(out / "prefill.rbln"))
    kv_dtypes = {d for _, d in cm.kv_shapes.values()}
    assert kv_dtypes == ({"float8_e4m3fn"} if kv == "fp8" else {"float32"}), kv_dtypes
    model = _load(out)
    got = _drive(model, PROMPTS, None)
    assert got == hf_greedy_quantized(qdir, PROMPTS, NEW)
    # the last prompt token's logits: the graph computes the reference's arithmetic (fp32
    # rounding apart), visibly different from the float model's
    prompt = PROMPTS[1]
    logits = model.prefill_decoder(
        input_ids=torch.tensor([prompt]),
        cache_position=torch.arange(len(prompt), dtype=torch.int32).unsqueeze(0),
        block_tables=torch.tensor([0], dtype=torch.int16),
    ).logits[0, -1]
    ref_err, float_err = _logit_errors(qdir, family, prompt, logits)
    assert ref_err < 1e-3 < float_err, (ref_err, float_err)
    # teeth: the float model's tokens differ somewhere
    assert got != hf_greedy(build_tiny_model(family=family), PROMPTS, NEW)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_lora_graphs_mix_base_and_two_adapters(tmp_path, family) -> None:
    """One decode batch runs base, adapter a (r 4: q,v) and adapter b (r 8, rsLoRA: o, gate,
    down) rows at once; each row equals transformers with its adapter merged."""
    hf = build_tiny_model(family=family)
    a = build_tiny_adapter(hf, r=4, alpha=8, targets=("q_proj", "v_proj"), seed=1)
    b = build_tiny_adapter(
        hf, r=8, alpha=16, targets=("o_proj", "gate_proj", "down_proj"), seed=2, use_rslora=True
    )
    settings = SETTINGS.model_copy(update={"lora_modules": {"a": str(a), "b": str(b)}})
    out = compile_model(hf, tmp_path / "lora", settings)
    recorded = json.loads((out / "rbln_config.json").read_text())["lora_config"]
    assert [x["lora_path"] for x in recorded["adapters"]] == [
        str((out / "lora_adapters" / n).resolve()) for n in ("a", "b")
    ]
    # the artifact loads from anywhere: moved, its own adapter copies are used
    moved = tmp_path / "moved"
    os.rename(out, moved)
    got = _drive(_load(moved), PROMPTS, [0, 1, 2])
    expected = [
        hf_greedy_merged(hf, adapter, [prompt], NEW)[0]
        for prompt, adapter in zip(PROMPTS, [None, a, b], strict=True)
    ]
    assert got == expected
    base = hf_greedy(hf, PROMPTS, NEW)
    assert got[1] != base[1] and got[2] != base[2]  # teeth: both adapters change tokens


def test_fp8_kv_doubles_the_kv_blocks_a_memory_budget_holds(tmp_path) -> None:
    """Issue 33: under the same DRAM budget, optimum's block estimate (flash attention, auto
    blocks) gives the fp8-KV artifact at least twice the KV blocks of the same int8 checkpoint
    with model-dtype KV, and vLLM's block count (rbln-ray's layout of them) follows. The
    budget binds for the model-dtype KV (fp32 on the emulator: 8 MiB per layer tensor at 32
    blocks), not for fp8."""
    from rbln_ray.compile.artifact import load_artifact
    from rbln_ray.compile.optimum_compile import compile_hf_model
    from rbln_ray.compile.quantization import QuantSpec
    from rbln_ray.vllm_plugin.kv_blocks import BlockLayout

    settings = CompileSettings(
        batch_size=8,
        max_seq_len=4096,
        attn_impl="flash_attn",
        kvcache_partition_len=1024,
        decoder_batch_sizes=(8,),
    )
    full = 8 * 4096 // 1024
    blocks, vllm_blocks = {}, {}
    for kv in ("fp16", "fp8"):
        qdir = build_tiny_quantized_model("int8", kv, max_position_embeddings=4096)
        extra = {"quantization": QuantSpec("int8", kv).as_optimum(), "memory_budget": "36MB"}
        out = compile_hf_model(qdir, tmp_path / kv, settings, extra=extra, hf_kwargs={})
        art = load_artifact(out)
        blocks[kv] = art.kvcache_num_blocks
        layout = BlockLayout.for_artifact(  # as the platform maps them (block_layout)
            art.kvcache_block_size, art.kvcache_num_blocks, art.max_seq_len, art.prefill_chunk_size
        )
        vllm_blocks[kv] = layout.num_inner
    assert blocks["fp16"] < full and blocks["fp8"] >= 2 * blocks["fp16"], blocks
    assert vllm_blocks["fp8"] >= 2 * vllm_blocks["fp16"] > 0, vllm_blocks
