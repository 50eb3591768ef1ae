"""What tests share that is not a fixture: the reference, the subprocess protocol, models.

* :func:`hf_greedy`: transformers' own greedy continuation, the independent reference every
  correctness test compares against (models and results cached per process);
* :func:`run_python` / :func:`result_json`: scripts run in a fresh process print one
  ``RESULT <json>`` line (a cluster script ``CLUSTER_RESULT <json>``); the last one counts;
* :func:`compiled_model`: a tiny model compiled on the emulator (cached by content);
* :func:`free_port`, prompt sets, request builders, :func:`count_refills`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from rbln_ray.common.ports import free_port  # noqa: F401  (tests import it from here)

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"  # the scripts tests run in fresh processes
PYTHON = sys.executable

# Mixed prompt lengths the greedy tests share (token ids of the tiny models' vocab).
EIGHT_PROMPTS = [
    [5],
    [100, 200, 300, 400, 500, 600, 700],
    list(range(1000, 1037)),
    [7] * 130,  # crosses a 128-token prefill chunk
    [9, 8, 7],
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
    [3000 + i for i in range(60)],
    [42, 4095, 1, 2],
]


def result_json(stdout: str, tag: str = "RESULT") -> dict[str, Any] | None:
    """The JSON of the last ``<tag> <json>`` line of ``stdout``; None if there is none."""
    prefix = f"{tag} "
    lines = [line for line in stdout.splitlines() if line.startswith(prefix)]
    return json.loads(lines[-1][len(prefix) :]) if lines else None


def run_python(
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    timeout: float = 600,
    tag: str = "RESULT",
    check: bool = True,
    python: str | Path = PYTHON,
    full_env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> tuple[dict[str, Any] | None, subprocess.CompletedProcess]:
    """Run ``python <argv>`` in a fresh process; its result and the finished process.

    The process gets this one's environment with the emulator on, plus ``env`` (or exactly
    ``full_env``). ``check``: it must exit 0 and print a result (else the assertion shows
    its output tails).
    """
    proc = subprocess.run(
        [str(python), *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=full_env
        if full_env is not None
        else {**os.environ, "RBLN_RAY_DEVICE": "emulated", **(env or {})},
    )
    result = result_json(proc.stdout, tag)
    if check:
        assert proc.returncode == 0 and result is not None, (
            f"rc {proc.returncode}",
            proc.stdout[-3000:],
            proc.stderr[-6000:],
        )
    return result, proc


def run_script(script: str, *args: str, timeout: float = 600, env: dict | None = None) -> dict:
    """Run ``tests/scripts/<script>`` in a fresh process and return its ``RESULT`` JSON."""
    result, _ = run_python([str(SCRIPTS / script), *args], env=env, timeout=timeout)
    assert result is not None
    return result


_HF_MODELS: dict[str, Any] = {}
_HF_RESULTS: dict[tuple, list[int]] = {}


def hf_greedy(
    model_dir: Path | str, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """transformers' own greedy continuation (new token ids only) of each prompt, unpadded.

    Never stops at EOS and never masks it: matches vLLM's ``ignore_eos=True``.
    """
    import torch
    from transformers import AutoModelForCausalLM

    key_dir = str(model_dir)
    if key_dir not in _HF_MODELS:
        # .float(): a pre-quantized checkpoint (gpt-oss MXFP4) is dequantized to bfloat16 by
        # transformers on CPU; its values are exact in float32, where the comparison runs.
        model = AutoModelForCausalLM.from_pretrained(key_dir, dtype=torch.float32).float().eval()
        model.generation_config.eos_token_id = None
        _HF_MODELS[key_dir] = model
    model = _HF_MODELS[key_dir]
    outs = []
    with torch.no_grad():
        for ids in prompts:
            key = (key_dir, tuple(ids), max_new_tokens)
            if key not in _HF_RESULTS:
                x = torch.tensor([ids])
                y = model.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=model.config.pad_token_id,
                )
                _HF_RESULTS[key] = y[0, len(ids) :].tolist()
            outs.append(_HF_RESULTS[key])
    return outs


def greedy_request(prompt: list[int], max_tokens: int) -> dict:
    """A ``rbln_llm_run.py`` request: greedy, ``ignore_eos``, exactly ``max_tokens``."""
    return {
        "prompt_token_ids": prompt,
        "params": {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True},
    }


def compiled_model(family: str = "llama", model: dict | None = None, **settings: Any) -> Path:
    """A tiny model of ``family`` (``model``: further ``TinyModelSpec`` fields) compiled on the
    emulator (cached by content and settings)."""
    os.environ.setdefault("RBLN_RAY_DEVICE", "emulated")
    from rbln_ray.compile import CompileSettings, resolve_compiled_dir
    from rbln_ray.models import build_tiny_model

    defaults: dict[str, Any] = {
        "batch_size": 4,
        "max_seq_len": 512,
        "decoder_batch_sizes": (4, 2, 1),
    }
    if settings.get("attn_impl") == "flash_attn":
        # optimum-rbln's ATOM limits: partition >= 1024 and max_seq_len >= 2 partitions.
        defaults.update(kvcache_partition_len=1024, max_seq_len=2048)
    return resolve_compiled_dir(
        build_tiny_model(family=family, **(model or {})),
        CompileSettings(**{**defaults, **settings}),
    )


EMBED_MAX_LEN = 128  # the tiny encoder's compiled max_seq_len in tests
EMBED_BATCH = 4


def compiled_encoder(family: str = "bert") -> Path:
    """A tiny encoder of ``family`` compiled on the emulator (batch 4 x 128 tokens; cached)."""
    os.environ.setdefault("RBLN_RAY_DEVICE", "emulated")
    from rbln_ray.compile import CompileSettings, resolve_compiled_dir
    from rbln_ray.models import build_tiny_encoder

    settings = CompileSettings(batch_size=EMBED_BATCH, max_seq_len=EMBED_MAX_LEN)
    return resolve_compiled_dir(build_tiny_encoder(family=family), settings)


def vllm_embeddings(
    model_dirs: list[Path], texts: list[str], query: str, device: str = "auto", **extra: Any
) -> dict[str, dict[str, Any]]:
    """``tests/scripts/vllm_embed.py``'s results per model dir (one process, one engine after
    another): embeddings or class probabilities of ``texts``, scores against ``query``. Plain
    vLLM-CPU in float32 with ``device="auto"`` (no runtime, so no RBLN plugin), rbln-ray with
    ``"emulated"``; ``extra`` are further spec keys of the script."""
    spec = {
        "models": [str(d) for d in model_dirs],
        "texts": texts,
        "query": query,
        "max_model_len": EMBED_MAX_LEN,
        "batch_size": EMBED_BATCH,
        **extra,
    }
    out = run_script("vllm_embed.py", json.dumps(spec), env={"RBLN_RAY_DEVICE": device})
    return {Path(m): r for m, r in out.items()}


def count_refills(history: list) -> int:
    """Prefills that ran while other requests were mid-decode (they decoded before and after).

    ``history`` is the runner's ``StepStats.history``: (step, kind, request ids). A refill is a
    freed compiled batch slot reused without draining the batch: continuous batching.
    """
    decode_steps: dict[str, list[int]] = {}
    for step, kind, ids in history:
        if kind == "decode":
            for req in ids:
                decode_steps.setdefault(req, []).append(step)
    return sum(
        1
        for step, kind, ids in history
        if kind == "prefill"
        and any(min(v) < step < max(v) for r, v in decode_steps.items() if r != ids[0])
    )
