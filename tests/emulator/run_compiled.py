"""Run in a fresh process: load a compiled dir with optimum-rbln and greedy-decode prompts.

Usage: ``python run_compiled.py <compiled_dir> <request.json>``; prints one JSON line with
token ids from ``generate()`` and from the serving calls (``prefill_decoder`` + ``decoders``)
using a permuted block table, padding rows and every decoder batch size.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rbln_ray.emulator import ensure_runtime


def serving(model, prompts: list[list[int]], tables: list[list[int]], new: int) -> list[list[int]]:
    """Greedy decode through the serving entry points; row 3 is always a padding row."""
    import torch

    cfg = model.rbln_config
    nblk = cfg.max_seq_len // cfg.kvcache_block_size
    pad_tables = [[-1] * nblk, tables[3]]  # "no block", then a scratch block
    live = len(prompts)
    tokens: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        logits = model.prefill_decoder(
            input_ids=torch.tensor([prompt], dtype=torch.int64),
            cache_position=torch.arange(len(prompt), dtype=torch.int32)[None],
            block_tables=torch.tensor(tables[i], dtype=torch.int16),
        ).logits
        assert tuple(logits.shape) == (1, 1, cfg_vocab(model)), logits.shape
        tokens.append([int(logits[0, -1].argmax())])

    def call(bs: int, rows: list[int], pad: list[int]) -> None:
        ids = [[tokens[r][-1]] for r in rows] + [[0]] * (bs - len(rows))
        pos = [[len(prompts[r]) + len(tokens[r]) - 1] for r in rows] + [[0]] * (bs - len(rows))
        bt = [tables[r] for r in rows] + [pad] * (bs - len(rows))
        kwargs = {}
        if cfg.use_attention_mask:
            # a serving layer passes its own [bs,1,1,max_seq_len] mask (1 = attend)
            mask = torch.zeros(bs, 1, 1, cfg.max_seq_len, dtype=torch.float32)
            for j, (p,) in enumerate(pos):
                mask[j, :, :, : p + 1] = 1
            kwargs["attention_mask"] = mask
        out = model.decoders[bs](
            input_ids=torch.tensor(ids, dtype=torch.int64),
            cache_position=torch.tensor(pos, dtype=torch.int32),
            block_tables=torch.tensor(bt, dtype=torch.int16),
            **kwargs,
        ).logits
        assert tuple(out.shape) == (bs, 1, cfg_vocab(model)), out.shape
        for j, r in enumerate(rows):
            tokens[r].append(int(out[j, -1].argmax()))

    for step in range(new - 1):
        pad = pad_tables[step % 2]
        if step % 3 == 0:
            call(4, list(range(live)), pad)
        elif step % 3 == 1:
            call(2, [0, 1], pad)
            call(2, [2], pad)
        else:
            for r in range(live):
                call(1, [r], pad)
    return tokens


def cfg_vocab(model) -> int:
    return model.config.get_text_config().vocab_size


def main() -> None:
    if ensure_runtime() != "emulated":
        raise SystemExit("expected the emulator to be active")
    import torch
    from optimum.rbln import RBLNAutoModelForCausalLM

    request = json.loads(Path(sys.argv[2]).read_text())
    model = RBLNAutoModelForCausalLM.from_pretrained(sys.argv[1], export=False)
    model.generation_config.eos_token_id = None
    prompts = request["prompts"]
    new = request["new_tokens"]
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros(len(prompts), width, dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    generated = [row[width:].tolist() for row in out]
    served = serving(model, prompts[:3], request["tables"], new)
    print(json.dumps({"generate": generated, "serving": served}))


if __name__ == "__main__":
    main()
