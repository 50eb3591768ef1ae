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
import signal
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
    # A session of its own, so a timeout ends the whole tree (a script's vLLM engine cores
    # own Ray actors: left alive, they would hold devices the next test waits for).
    with subprocess.Popen(
        [str(python), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        start_new_session=True,
        env=full_env
        if full_env is not None
        else {**os.environ, "RBLN_RAY_DEVICE": "emulated", **(env or {})},
    ) as popen:
        try:
            stdout, stderr = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            os.killpg(popen.pid, signal.SIGKILL)
            exc.stdout, exc.stderr = popen.communicate()
            raise
    proc = subprocess.CompletedProcess(popen.args, popen.returncode, stdout, stderr)
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

    def load():
        import torch
        from transformers import AutoModelForCausalLM

        # .float(): a pre-quantized checkpoint (gpt-oss MXFP4) is dequantized to bfloat16 by
        # transformers on CPU; its values are exact in float32, where the comparison runs.
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).float()

    return _greedy(str(model_dir), load, prompts, max_new_tokens)


def hf_greedy_merged(
    model_dir: Path | str, adapter_dir: Path | str | None, prompts: list[list[int]], n: int
) -> list[list[int]]:
    """:func:`hf_greedy` of the model with a PEFT LoRA adapter merged into its weights
    (``W += alpha / r * B @ A``; rsLoRA: ``alpha / sqrt(r)``), computed here in plain torch:
    the reference for compiled-in adapters. ``adapter_dir`` None: the base model."""
    if adapter_dir is None:
        return hf_greedy(model_dir, prompts, n)

    def load():
        import math

        import torch
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        cfg = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
        r, alpha = cfg["r"], cfg["lora_alpha"]
        scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        lora = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
        state = model.state_dict()
        for key, a in lora.items():
            if key.endswith("lora_A.weight"):
                b = lora[key.replace("lora_A", "lora_B")]
                target = key.removeprefix("base_model.model.").replace(".lora_A", "")
                state[target] = state[target] + scaling * (b @ a)
        model.load_state_dict(state)
        return model

    return _greedy(f"{model_dir}+{adapter_dir}", load, prompts, n)


def quant_reference_model(qdir: Path | str):
    """transformers computing what a quantized checkpoint means, in plain torch: every
    quantized projection dequantized (``q.float() * weight_scale``), and with fp8 KV scales
    every key and value (after RoPE) rounded through float8_e4m3fn
    (``(x / s).clamp(+-448).to(fp8).float() * s``) before eager attention."""
    import torch
    from safetensors.torch import load_file
    from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.models.llama.modeling_llama import eager_attention_forward

    tensors = load_file(str(Path(qdir) / "model.safetensors"))
    state, kv_scales = {}, {}
    for key, t in tensors.items():
        if key.endswith(".weight_scale"):
            continue
        if key.endswith(("self_attn.k_scale", "self_attn.v_scale")):
            layer = int(key.split(".")[2])
            kv_scales.setdefault(layer, {})[key.rsplit(".", 1)[-1]] = t.float()
            continue
        scale = tensors.get(key.removesuffix("weight") + "weight_scale")
        state[key] = t.float() * scale.float() if scale is not None else t.float()

    def fake_fp8(x, s):
        return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype) * s

    def fp8_kv_attention(module, query, key, value, attention_mask, **kw):
        # the scales live on the module: the registry is global, models of other
        # checkpoints (cached by _greedy) register the same name
        s = module.test_kv_scales
        key, value = fake_fp8(key, s["k_scale"]), fake_fp8(value, s["v_scale"])
        return eager_attention_forward(module, query, key, value, attention_mask, **kw)

    # a custom attention needs its mask function too, else the prefill is not causal
    AttentionInterface.register("test_fp8_kv", fp8_kv_attention)
    AttentionMaskInterface.register("test_fp8_kv", eager_mask)
    config = AutoConfig.from_pretrained(str(qdir))
    del config.quantization_config
    attn = "test_fp8_kv" if kv_scales else "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    model.tie_weights()
    for layer, scales in kv_scales.items():
        model.model.layers[layer].self_attn.test_kv_scales = scales
    return model


def hf_greedy_quantized(qdir: Path | str, prompts: list[list[int]], n: int) -> list[list[int]]:
    """:func:`hf_greedy` of :func:`quant_reference_model`."""
    return _greedy(f"quantized:{qdir}", lambda: quant_reference_model(qdir), prompts, n)


def _greedy(key_dir: str, load, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    import torch

    if key_dir not in _HF_MODELS:
        model = load().eval()
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


def perturbed_model(src: Path, scale: float, seed: int = 1) -> Path:
    """A copy of the HF model ``src`` with Gaussian noise of ``scale`` x each weight's std
    added to every decoder-layer weight (cached): a draft model that agrees with ``src`` on
    most, not all, greedy tokens."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from rbln_ray.common.paths import atomic_dir, cache_dir

    out = cache_dir() / "models" / f"{Path(src).name}-noise{scale:g}-s{seed}"
    if (out / "config.json").exists():
        return out
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".layers." in name and param.dim() == 2:
                param.add_(torch.randn(param.shape, generator=gen) * param.std() * scale)
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        for f in Path(src).iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(f, tmp / f.name)
    return out
