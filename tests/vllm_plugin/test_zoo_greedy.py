"""Every model-zoo family under ``vllm.LLM`` on the RBLN backend, token-exact against
transformers, under continuous batching.

One engine per (family, attention) artifact runs all prompts at once on a batch-4 model:
short prompts decode while longer ones are prefilled chunk by chunk in between (for the
families whose prefill can resume), slots free and refill, and every request's greedy
tokens must equal transformers' own ``generate`` on the same weights, and one request's
sampled-token logprobs transformers' log-softmax (greedy equality alone cannot see a
monotonic change of the logits such as Gemma2's final soft-capping). Prompts are longer
than the tiny models' sliding window (64), and decoding crosses it. The artifact is
compiled by the code path ``rbln-ray compile`` uses (``rbln_ray.compile.family_compile``).
"""

from __future__ import annotations

import json
import random

import pytest

from rbln_ray.families.registry import DECODERS as FAMILIES
from rbln_ray.families.registry import GREEDY_TEST
from rbln_ray.families.tiny import DEFAULT_WINDOW
from rbln_ray.models import build_tiny_model
from tests.helpers import (
    SCRIPTS,
    compiled_model,
    count_refills,
    greedy_request,
    hf_greedy,
    run_python,
)

# The first test also sets up every engine run (one process for all of them).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

# Every (family, attention) the zoo table says this test verifies (the others are
# test_llm_greedy.py's); mistral runs with a sliding window on every layer.
CASES = [
    (name, impl)
    for name, fam in FAMILIES.items()
    for impl in ("eager", "flash_attn")
    if fam.verified_by.get(impl, "").startswith(GREEDY_TEST)
]
LEARNED_POSITIONS = ("gpt2", "opt")  # flash needs max_seq_len 2048 positions


def model_spec(family: str, attn_impl: str) -> dict:
    """``TinyModelSpec`` fields beyond the family."""
    spec: dict = {}
    if family == "mistral":
        spec["sliding_window"] = DEFAULT_WINDOW
    if attn_impl == "flash_attn" and family in LEARNED_POSITIONS:
        spec["max_position_embeddings"] = 2048
    return spec


def workload(flash: bool) -> tuple[list[list[int]], list[int]]:
    """Short prompts first (they decode while the long ones prefill), then prompts spanning
    several 128-token chunks and several windows."""
    rng = random.Random(15)
    lengths = [3, 40, 70, 9, 300, 200, 130, 61]
    if flash:
        lengths.append(1100)  # crosses a 1024-token partition
    prompts = [[rng.randrange(4096) for _ in range(n)] for n in lengths]
    max_tokens = [24, 16, 8, 20, 16, 12, 16, 10] + ([8] if flash else [])
    return prompts, max_tokens


# The request whose sampled-token logprobs are also compared: greedy equality checks only
# the argmax, which a monotonic transform (Gemma2's final-logit soft-capping) leaves alone.
LOGPROB_REQUEST = 4  # 300 tokens: several windows and chunks


def requests(flash: bool) -> list[dict]:
    prompts, max_tokens = workload(flash)
    out = [greedy_request(p, m) for p, m in zip(prompts, max_tokens, strict=True)]
    out[LOGPROB_REQUEST]["params"]["logprobs"] = 0  # the sampled token's only
    return out


def hf_logprobs(model_dir, prompt: list[int], tokens: list[int]) -> list[float]:
    """transformers' log-softmax of each generated token given everything before it."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).float().eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    chosen = logits.log_softmax(-1).gather(1, torch.tensor(tokens).view(-1, 1))
    return chosen.view(-1).tolist()


@pytest.fixture(scope="module")
def zoo_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, str], dict]:
    """Every selected case's engine run, all in one process (vLLM's imports paid once), one
    engine after another; each case's artifact compiled once (cached on disk by content)."""
    params = [
        getattr(getattr(item, "callspec", None), "params", {})
        for item in request.session.items
        if item.module is request.module
    ]
    selected = [(p["family"], p["attn_impl"]) for p in params if "family" in p]
    cases = [case for case in CASES if case in selected]
    runs = []
    for family, attn_impl in cases:
        model = compiled_model(family, model=model_spec(family, attn_impl), attn_impl=attn_impl)
        reqs = requests(attn_impl == "flash_attn")
        runs.append({"model": str(model), "requests": reqs, "rpc": ["step_stats"]})
    # and one engine start on an architecture rbln-ray does not serve (vLLM knows Phi3)
    runs.append({"model": str(unsupported_model(tmp_path_factory.mktemp("phi3"))), "requests": []})
    spec = tmp_path_factory.mktemp("zoo") / "runs.json"
    spec.write_text(json.dumps({"runs": runs}))
    result, proc = run_python([str(SCRIPTS / "rbln_llm_run.py"), f"@{spec}"], timeout=1800)
    logs = proc.stderr.split("=== rbln_llm_run: run ")[1:]  # the script's RUN_MARK
    for run, log in zip(result["runs"], logs, strict=True):
        if "error" in run:  # its root cause is in the engine's log, not in the exception
            run["log"] = log[-4000:]
    return dict(zip([*cases, UNSUPPORTED], result["runs"], strict=True))


UNSUPPORTED = ("phi3", "unsupported")


def unsupported_model(out):
    """A Phi-3 config directory: an architecture optimum-rbln 0.12 has no class for."""
    from transformers import Phi3Config

    config = Phi3Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=2)
    config.architectures = ["Phi3ForCausalLM"]
    config.save_pretrained(out)
    return out


def test_engine_start_refuses_an_unsupported_architecture(
    zoo_runs: dict[tuple[str, str], dict],
) -> None:
    error = zoo_runs[UNSUPPORTED].get("error", "")
    assert "architecture ['Phi3ForCausalLM'] is not supported by rbln-ray" in error
    assert "supported: LlamaForCausalLM" in error and "Gemma2ForCausalLM" in error


@pytest.mark.parametrize(("family", "attn_impl"), CASES, ids=[f"{f}-{a}" for f, a in CASES])
def test_family_greedy_matches_transformers(
    zoo_runs: dict[tuple[str, str], dict], family: str, attn_impl: str
) -> None:
    result = zoo_runs[(family, attn_impl)]
    assert "error" not in result, f"{result.get('error')}\n{result.get('log')}"
    spec = model_spec(family, attn_impl)
    prompts, max_tokens = workload(attn_impl == "flash_attn")
    hf_dir = build_tiny_model(family=family, **spec)
    got = [o[0]["token_ids"] for o in result["outputs"]]
    # greedy continuations are prefixes of longer ones: one reference run per prompt
    expected = [
        full[:m]
        for full, m in zip(
            hf_greedy(hf_dir, prompts, max(max_tokens)),
            max_tokens,
            strict=True,
        )
    ]
    assert got == expected
    output = result["outputs"][LOGPROB_REQUEST][0]
    tokens = got[LOGPROB_REQUEST]
    served = [step[str(t)] for step, t in zip(output["logprobs"], tokens, strict=True)]
    reference = hf_logprobs(hf_dir, prompts[LOGPROB_REQUEST], tokens)
    assert served == pytest.approx(reference, abs=2e-3)

    history = result["rpc"]["step_stats"][0]["history"]
    assert count_refills(history) >= 1, "no prefill ran while other requests were decoding"
    config = json.loads((hf_dir / "config.json").read_text())
    sliding = FAMILIES[family].sliding_window_used(config)
    resumable = FAMILIES[family].prefill_resumable
    assert result["config"]["enable_prefix_caching"] is not (sliding or not resumable)
    prefills: dict[str, list[int]] = {}
    for step, kind, ids in history:
        if kind == "prefill":
            prefills.setdefault(ids[0], []).append(step)
    chunked = [steps for steps in prefills.values() if len(steps) > 1]
    if resumable:
        # a long prompt's chunks ran in separate steps with decodes between them
        assert any(s[-1] - s[0] > len(s) - 1 for s in chunked), prefills
    else:
        assert not chunked, "a non-resumable family's prompt was prefilled in several steps"
