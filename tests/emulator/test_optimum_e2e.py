"""optimum-rbln compiles, saves and reloads (fresh process) tiny decoders token-exactly.

The reference is transformers' own greedy ``generate`` on the same weights, per prompt.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from rbln_ray.compile import CompileSettings, compile_hf_model
from tests.helpers import hf_greedy

NEW_TOKENS = 16
RUNNER = Path(__file__).with_name("run_compiled.py")
ROOT = Path(__file__).resolve().parents[2]

# (family, attn_impl, use_attention_mask); flash uses max_seq_len 2048 / partition 1024,
# the smallest optimum accepts for ATOM.
CASES = [
    ("llama", "eager", False),
    ("qwen2", "eager", False),
    ("qwen3", "eager", False),
    ("mistral", "eager", False),
    ("llama", "flash_attn", False),
    ("qwen3", "flash_attn", False),
    ("llama", "eager", True),
    ("qwen2", "flash_attn", True),
]


def _prompts(flash: bool) -> list[list[int]]:
    rng = random.Random(1234)
    # flash: 1100 crosses a partition in prefill, 1018 + 16 crosses it while decoding
    lengths = [1100, 5, 1018, 37] if flash else [300, 5, 130, 37]
    return [[rng.randrange(10, 4000) for _ in range(n)] for n in lengths]


def _tables(flash: bool) -> list[list[int]]:
    # non-identity placement; the 4th row's blocks are the serving test's scratch space
    return [[5, 2], [0, 7], [3, 6], [1, 4]] if flash else [[2], [0], [3], [1]]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, tiny_models):
    cache: dict[tuple, Path] = {}

    def get(family: str, attn: str, mask: bool) -> Path:
        key = (family, attn, mask)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{family}-{attn}-{int(mask)}")
            flash = attn == "flash_attn"
            settings = CompileSettings(
                batch_size=4,
                max_seq_len=2048 if flash else 512,
                attn_impl=attn,
                kvcache_partition_len=1024 if flash else None,
                decoder_batch_sizes=(4, 2, 1),
                use_attention_mask=mask,
            )
            compile_hf_model(tiny_models[family], out, settings)
            cache[key] = out
        return cache[key]

    return get


@pytest.mark.parametrize("family,attn,mask", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_fresh_process_matches_transformers(compiled, tiny_models, tmp_path, family, attn, mask):
    flash = attn == "flash_attn"
    out_dir = compiled(family, attn, mask)
    assert sorted(p.name for p in out_dir.glob("*.rbln")) == [
        "decoder_batch_1.rbln",
        "decoder_batch_2.rbln",
        "decoder_batch_4.rbln",
        "prefill.rbln",
    ]
    prompts = _prompts(flash)
    request = tmp_path / "request.json"
    request.write_text(
        json.dumps({"prompts": prompts, "tables": _tables(flash), "new_tokens": NEW_TOKENS})
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(RUNNER), str(out_dir), str(request)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = hf_greedy(tiny_models[family], prompts, NEW_TOKENS)
    assert result["generate"] == expected
    assert result["serving"] == expected[:3]
