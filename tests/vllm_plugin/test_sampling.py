"""vLLM's sampling parameters on the RBLN backend behave as vLLM documents them."""

from __future__ import annotations

import json
import re

import pytest

from rbln_ray.models import build_tiny_model
from tests.helpers import compiled_model, hf_greedy, run_script

pytestmark = pytest.mark.slow

PROMPT = [100, 200, 300, 400, 500, 600, 700]
CHOICES = ["def main():", "class Parser:", "import os"]
REGEX = r"[0-9]{3}-[a-z]{4}"


def test_sampling_parameters() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir = build_tiny_model(family="llama")
    tok = AutoTokenizer.from_pretrained(hf_dir)
    greedy = hf_greedy(hf_dir, [PROMPT], 24)[0]
    greedy_text = tok.decode(greedy)
    stop = greedy_text[12:16]
    assert stop and greedy_text.index(stop) >= 1

    def req(**params):
        return {"prompt_token_ids": PROMPT, "params": {"max_tokens": 24, **params}}

    requests = {
        "seed1": req(temperature=1.0, seed=1),
        "seed1_again": req(temperature=1.0, seed=1),
        "seed2": req(temperature=1.0, seed=2),
        "top_k1": req(temperature=0.8, top_k=1, seed=5),
        "tiny_top_p": req(temperature=1.0, top_p=1e-6, seed=6),
        "max5": req(temperature=0.0, max_tokens=5, ignore_eos=True),
        "stop": req(temperature=0.0, stop=[stop], ignore_eos=True),
        "n3": req(temperature=1.0, n=3, seed=3),
        "logprobs": req(temperature=0.0, logprobs=5, ignore_eos=True),
        # Grammar-masked steps (sampled after the engine's bitmask) share batches with the
        # requests above, whose outputs must stay exact.
        "choice": req(temperature=0.0, structured_outputs={"choice": CHOICES}),
        "regex": req(temperature=1.0, seed=7, structured_outputs={"regex": REGEX}),
    }
    spec = {"model": str(compiled_model("llama")), "requests": list(requests.values())}
    result = run_script("rbln_llm_run.py", json.dumps(spec))
    outs = dict(zip(requests, result["outputs"], strict=True))

    ids = {name: o[0]["token_ids"] for name, o in outs.items()}
    assert ids["seed1"] == ids["seed1_again"]
    assert ids["seed1"] != ids["seed2"]
    assert ids["seed1"] != greedy[: len(ids["seed1"])], "temperature 1 sampling looks greedy"
    assert ids["top_k1"] == greedy[: len(ids["top_k1"])]
    assert ids["tiny_top_p"] == greedy[: len(ids["tiny_top_p"])]
    assert ids["max5"] == greedy[:5] and outs["max5"][0]["finish_reason"] == "length"
    assert outs["stop"][0]["finish_reason"] == "stop"
    assert outs["stop"][0]["text"] == greedy_text[: greedy_text.index(stop)]
    assert len(outs["n3"]) == 3 and len({tuple(c["token_ids"]) for c in outs["n3"]}) > 1
    assert outs["choice"][0]["text"] in CHOICES, outs["choice"]
    assert re.fullmatch(REGEX, outs["regex"][0]["text"]), outs["regex"]

    # logprobs: the top-5 plus the sampled token, with values from the model's log-softmax.
    steps = outs["logprobs"][0]["logprobs"]
    assert ids["logprobs"] == greedy and len(steps) == 24
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + greedy])).logits[0]
    reference = torch.log_softmax(logits[len(PROMPT) - 1 : -1], dim=-1)
    for i, step in enumerate(steps):
        assert 5 <= len(step) <= 6
        assert str(greedy[i]) in step
        for token, value in step.items():
            assert value == pytest.approx(reference[i, int(token)].item(), abs=1e-3)
        assert max(step.values()) == pytest.approx(step[str(greedy[i])])
