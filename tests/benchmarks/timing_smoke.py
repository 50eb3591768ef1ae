"""Timing-mode decode calls on a compiled tiny model: wall time, CPU time, modelled time.

argv[1]: compiled model dir (batch 4). Prints ``RESULT {...}``.
"""

import json
import os
import sys
import time

os.environ["RBLN_RAY_DEVICE"] = "emulated"
os.environ["RBLN_RAY_EMULATOR_MODE"] = "timing"
os.environ["RBLN_RAY_NODE_ID"] = f"timing-smoke-{os.getpid()}"

if __name__ == "__main__":
    from rbln_ray.emulator import ensure_runtime

    ensure_runtime()
    import torch
    from optimum.rbln import RBLNAutoModelForCausalLM

    from rbln_ray.emulator import call_log

    model = RBLNAutoModelForCausalLM.from_pretrained(sys.argv[1], export=False)
    decoder = model.decoders[4]
    ids = torch.full((4, 1), 7, dtype=torch.long)
    pos = torch.full((4, 1), 100, dtype=torch.int32)
    tables = torch.arange(4, dtype=torch.int16).view(4, 1)
    first = decoder(input_ids=ids, cache_position=pos, block_tables=tables).logits
    # Given output buffers (optimum's prefill passes its own, out=), timing mode writes its
    # zeros into them within the call: a buffer's stale contents never reach the caller.
    stale = torch.ones_like(first)
    returned = decoder.runtime(ids, pos, tables, out=stale)
    stale_zeroed = returned is stale and bool((stale == 0).all())
    call_log.reset()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(3):
        decoder(input_ids=ids, cache_position=pos, block_tables=tables)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    calls = call_log.snapshot()["calls"]
    print(
        "RESULT "
        + json.dumps(
            {
                "runtime_repr": repr(decoder.runtime),
                "logits_shape": list(first.shape),
                "logits_all_zero": bool((first == 0).all()),
                "stale_buffers_zeroed": stale_zeroed,
                "cpu_s": cpu,
                "wall_s": wall,
                "calls": calls,
            }
        ),
        flush=True,
    )
