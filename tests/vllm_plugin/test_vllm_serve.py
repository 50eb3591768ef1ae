"""vLLM's own OpenAI server (`vllm serve`) runs on the RBLN plugin; uncompiled dirs are cached."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from rbln_ray.models import build_tiny_model
from tests.helpers import PYTHON, compiled_model, free_port, hf_greedy, run_script

pytestmark = pytest.mark.slow


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Poll the server's /health until it answers 200 (bounded; fails if the server died)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)  # polling interval of a readiness probe, not synchronisation
    raise AssertionError(f"server at {url} not healthy within {timeout} s")


# vLLM holds back a trailing incomplete UTF-8 sequence; references drop it the same way.
def test_vllm_serve_openai_completions_and_chat(tmp_path: Path) -> None:
    import openai
    from transformers import AutoTokenizer

    model = compiled_model("llama")
    port = free_port()
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen(
        [
            PYTHON,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--served-model-name",
            "tiny",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "RBLN_RAY_DEVICE": "emulated"},
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        hf_dir = build_tiny_model(family="llama")
        tok = AutoTokenizer.from_pretrained(hf_dir)

        prompt = "def main(argv):\n"
        ids = tok(prompt)["input_ids"]
        expected = tok.decode(hf_greedy(hf_dir, [ids], 12)[0]).rstrip("\ufffd")
        done = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert done.choices[0].text == expected
        streamed = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in streamed) == expected

        messages = [{"role": "user", "content": "hello there"}]
        chat_text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        chat_ids = tok(chat_text, add_special_tokens=False)["input_ids"]
        chat_expected = tok.decode(hf_greedy(hf_dir, [chat_ids], 10)[0]).rstrip("\ufffd")
        chat = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=10, temperature=0
        )
        assert chat.choices[0].message.content == chat_expected
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def test_uncompiled_hf_dir_is_compiled_once_and_cached(tmp_path: Path) -> None:
    hf_dir = build_tiny_model(family="qwen2")
    spec = json.dumps(
        {
            "model": str(hf_dir),
            "llm_kwargs": {"additional_config": {"rbln_compile": {"batch_size": 2}}},
            "requests": [
                {
                    "prompt_token_ids": [5, 6, 7],
                    "params": {"temperature": 0, "max_tokens": 8, "ignore_eos": True},
                }
            ],
        }
    )
    env = {"RBLN_RAY_CACHE": str(tmp_path / "cache")}
    first = run_script("rbln_llm_run.py", spec, env=env)
    compiled = list((tmp_path / "cache" / "compiled").glob("*/rbln_config.json"))
    assert len(compiled) == 1
    stamp = compiled[0].stat().st_mtime_ns
    second = run_script("rbln_llm_run.py", spec, env=env)
    assert list((tmp_path / "cache" / "compiled").glob("*/rbln_config.json")) == compiled
    assert compiled[0].stat().st_mtime_ns == stamp, "second start recompiled"
    assert first["outputs"] == second["outputs"]
    assert first["outputs"][0][0]["token_ids"] == hf_greedy(hf_dir, [[5, 6, 7]], 8)[0]
    assert first["config"]["max_num_seqs"] == 2
