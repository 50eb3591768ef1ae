"""An RBLN scheduler driven like vLLM's engine core, in process, on a hand-written artifact.

The artifact is an ``rbln_config.json`` beside an HF ``config.json`` and no weights: the
platform, scheduler and runner read only shapes from it. Used by the scheduler and runner
unit tests (no engine, no device, no subprocess).
"""

from __future__ import annotations

import json
from pathlib import Path

BATCH, MAX_LEN, CHUNK = 4, 512, 128


def write_artifact(root: Path, spec_tokens: int = 0, **rbln: int) -> Path:
    """``spec_tokens``: list verify graphs of that many drafts (+1) for every decode batch
    in its ``rbln_spec.json`` (speculative decoding; the files themselves are not read)."""
    from transformers import LlamaConfig

    out = root / "artifact"
    LlamaConfig(
        vocab_size=4096,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
        max_position_embeddings=MAX_LEN,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(out)
    config = {
        "cls_name": "RBLNLlamaForCausalLMConfig",
        "batch_size": BATCH,
        "max_seq_len": MAX_LEN,
        "kvcache_block_size": MAX_LEN,
        "kvcache_num_blocks": BATCH,
        "prefill_chunk_size": CHUNK,
        "decoder_batch_sizes": [4, 2, 1],
        "attn_impl": "eager",
        **rbln,
    }
    (out / "rbln_config.json").write_text(json.dumps(config))
    if spec_tokens:
        width = spec_tokens + 1
        graphs = [
            {"name": f"verify_batch_{b}_w{width}", "batch": b, "width": width, "file": f"{b}"}
            for b in config["decoder_batch_sizes"]
        ]
        manifest = {"format": 1, "spec_tokens": spec_tokens, "graphs": graphs}
        (out / "rbln_spec.json").write_text(json.dumps(manifest))
    return out


class Harness:
    """An RBLN scheduler plus the engine core's bookkeeping around it."""

    def __init__(self, artifact: Path, **engine: object) -> None:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        args = EngineArgs(model=str(artifact), skip_tokenizer_init=True, seed=0, **engine)
        self.config = args.create_engine_config()
        cache = self.config.cache_config
        # The engine core sets this after profiling the KV cache; there is none here.
        cache.num_gpu_blocks = cache.num_gpu_blocks_override
        spec = FullAttentionSpec(
            block_size=cache.block_size,
            num_kv_heads=1,
            head_size=1,
            dtype=__import__("torch").float32,
        )
        kv = KVCacheConfig(
            num_blocks=cache.num_gpu_blocks_override,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["rbln.kv"], spec)],
        )
        cls = self.config.scheduler_config.get_scheduler_cls()
        self.scheduler = cls(
            vllm_config=self.config,
            kv_cache_config=kv,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=cache.block_size,
        )
        hash_fn = get_hash_fn_by_name(cache.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(cache.block_size, hash_fn)
        self.steps: list[tuple[str, dict[str, int]]] = []

    def add(self, req_id: str, prompt: list[int], max_tokens: int) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
        request = Request(req_id, prompt, params, None, block_hasher=self.hasher)
        self.scheduler.add_request(request)

    def step(self):
        """One schedule + a model output that samples token 7 for every finished prefill."""
        from vllm.v1.outputs import ModelRunnerOutput

        output = self.scheduler.schedule()
        plan = output.rbln_plan
        ids = list(output.num_scheduled_tokens)
        sampled = []
        for req_id in ids:
            request = self.scheduler.requests[req_id]
            done = request.num_computed_tokens >= request.num_tokens
            sampled.append([7] if done else [])
        self.steps.append((plan.kind, dict(output.num_scheduled_tokens)))
        result = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
        )
        self.scheduler.update_from_output(output, result)
        return output

    def run(self, limit: int = 500) -> None:
        for _ in range(limit):
            if not self.scheduler.has_requests():
                return
            self.step()
        raise AssertionError(f"requests still unfinished after {limit} steps")
