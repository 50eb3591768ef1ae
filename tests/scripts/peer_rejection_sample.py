"""Side env only: vllm-rbln 0.12.0's own rejection-sampling graph on the emulator.

Compiles ``vllm_rbln.v1.sample.rbln_rejection_sampler.rbln_rejection_sample`` the way its
``RBLNRejectionSamplerImpl`` does (vllm-rbln's ``compile`` helper -> ``torch.compile`` with
``rebel.core.torch_compile.rbln_backend``, a global-context CompileContext, device 0) and runs
it on argv[1] (JSON: the op inputs as lists). Prints ``RESULT {"out": [[...]]}``.
"""

import json
import sys

if __name__ == "__main__":
    import torch
    from vllm.platforms import current_platform  # noqa: F401  (vllm-rbln's platform, as in serving)
    from vllm_rbln.compilation import compile, create_compile_context
    from vllm_rbln.v1.sample.rbln_rejection_sampler import rbln_rejection_sample

    spec = json.loads(sys.argv[1])
    compiled = compile(
        rbln_rejection_sample,
        dynamic=False,
        fullgraph=True,
        compile_context=create_compile_context(use_global_ctx=True),
        use_global_ctx=True,
        global_device_id=0,
        use_cache=False,
    )
    i32 = torch.int32
    out = compiled(
        torch.tensor(spec["draft_token_ids"], dtype=i32),
        torch.tensor(spec["target_logits"], dtype=torch.float32),
        torch.tensor(spec["cu_num_draft_tokens"], dtype=i32),
        torch.ones(len(spec["num_draft_tokens"]), dtype=i32),  # top_k = 1: greedy
        None,
        torch.ones(len(spec["draft_token_ids"])),
        torch.tensor(spec["draft_per_batch"], dtype=i32),
        torch.tensor(spec["bonus_token_ids"], dtype=i32),
        torch.tensor(spec["num_draft_tokens"], dtype=i32),
    )
    print("RESULT " + json.dumps({"out": out.tolist()}), flush=True)
