"""The copier: a small Llama whose weights are set by hand to copy spans of its prompt.

Why: speculation by prompt lookup (vLLM's ``ngram``) pays on input-grounded work (code edits,
summaries, RAG answers) because a real LLM's answer there repeats spans of its prompt. The
demo model has not learnt to copy, and training a small model to copy did not get there in
the minutes a setup can spend (BENCHMARKS section 12). Copying is what an *induction circuit*
does, and that circuit can be written down directly, so the copier is built, not trained:

* layer 1: head ``k`` (k = 1..7) attends to the token ``k`` positions back and writes a
  projection of that token's code into a subspace of its own. Its query and key read only a
  constant dimension of the residual, so its score depends on position alone; RoPE makes it
  ``sum_j cos((d - k) theta_j)`` over the fast rotary pairs, which peaks at distance d = k.
* layer 2: one head scores each earlier position ``n`` by how well the seven tokens before
  ``n`` equal the current token and the six before it (weights falling from 1 to 0.37),
  through the slow rotary pairs, which ``rope_theta = 1e18`` leaves unrotated within the
  context. It copies the token at ``n`` into an output subspace, which the LM head reads.
* MLPs are zero.

The copy is only as good as its match: where the same context occurs more than once in the
prompt with different continuations, the copier averages them and may go wrong, as a real
model can, and without a match it copies from wherever the best partial match is (on random
prompts it soon repeats the prompt). Its greedy copy rate on held-out spans is measured when
it is built and stored beside its weights (``rbln_ray_copier.json``). It keeps the demo
model's tokenizer and family, so every path that serves the demo model serves it. Used by
the speculation benchmarks (``--model copier``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from rbln_ray.common.paths import atomic_dir, cache_dir, file_lock
from rbln_ray.models.demo import corpus_ids, demo_model_dir

logger = logging.getLogger(__name__)

SEPARATOR = "\n\n"  # between a span and its copy, as in the grounded benchmark prompts


@dataclass(frozen=True)
class CopierShape:
    """The copier's construction; every field is part of its cache key."""

    embed_dim: int = 64  # a token's random unit vector, in E and OUT
    hidden_size: int = 1024
    num_heads: int = 8  # layer 1 needs one per lag
    head_dim: int = 128
    intermediate_size: int = 128  # the MLPs are zero; vLLM and optimum need them to exist
    max_position_embeddings: int = 1024
    rope_theta: float = 1e18  # rotary pairs from ``positional_pairs`` on stay unrotated
    positional_pairs: int = 16  # the fast rotary pairs layer 1's position heads use
    # Layer 2's match: the current token, one back, two back, ... Seven tokens of context
    # keep the copy on track in Python, whose three-token contexts repeat often.
    match_weights: tuple[float, ...] = (1.0, 0.85, 0.72, 0.61, 0.52, 0.44, 0.37)
    match_dim: int = 13  # numbers per token in P1..P(lags): lags x match_dim unrotated dims
    position_logit_gap: float = 30.0  # layer 1: the right distance over its neighbours
    match_logit: float = 20.0  # layer 2: per unit of matched weight
    output_logit: float = 30.0  # the copied token's logit
    seed: int = 0


def copier_state(shape: CopierShape, vocab: int) -> dict:
    """The copier's weights as a transformers ``LlamaForCausalLM`` state dict (module
    docstring). Residual layout: E (the token's code), one constant dimension, P1..P(lags)
    (the tokens 1..lags back, ``match_dim`` numbers each), OUT (the copied token's code)."""
    import math

    import torch

    e, hd, h, m = shape.embed_dim, shape.head_dim, shape.hidden_size, shape.match_dim
    lags = len(shape.match_weights)
    tok = slice(0, e)
    const = e
    back = [slice(e + 1 + i * m, e + 1 + (i + 1) * m) for i in range(lags)]  # P1..P(lags)
    out = slice(back[-1].stop, back[-1].stop + e)
    if out.stop > h or lags > shape.num_heads:
        raise ValueError(f"{shape} does not fit its residual stream or heads")
    gen = torch.Generator().manual_seed(shape.seed)
    codes = torch.randn(vocab, e, generator=gen)
    codes /= codes.norm(dim=1, keepdim=True)
    # P1..P(lags) hold a token as ``m`` numbers: an orthonormal projection of its code,
    # scaled to keep a unit norm on average.
    proj = torch.linalg.qr(torch.randn(e, m, generator=gen))[0].T * math.sqrt(e / m)
    # RMSNorm divides by the residual's RMS; with unit token vectors and a unit constant
    # that is known at each norm: layer 1 sees E and the constant, layer 2 also P1..P(lags),
    # the final norm also OUT. ``normed`` is the factor each applies.
    normed = [math.sqrt(h / n) for n in (2, 2 + lags, 3 + lags)]
    scale = hd**-0.5  # Llama's attention scaling
    theta = shape.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    half = hd // 2  # RoPE pairs dimension j with j + half (transformers' rotate_half)
    pos = torch.arange(shape.positional_pairs)
    # Score gap between the peak (d = k) and its neighbours, per unit amplitude squared.
    gap = float((1 - torch.cos(theta[pos])).sum())
    amp = math.sqrt(shape.position_logit_gap / (gap * scale))
    static = [*range(shape.positional_pairs, half), *range(half + shape.positional_pairs, hd)]
    if len(static) < lags * m:
        raise ValueError(f"{shape}: {len(static)} unrotated head dims, {lags * m} needed")
    blocks = [static[i * m : (i + 1) * m] for i in range(lags)]
    eye = torch.eye(e)
    eye_m = torch.eye(m)

    state: dict[str, torch.Tensor] = {}
    embed = torch.zeros(vocab, h)
    embed[:, tok] = codes
    embed[:, const] = 1.0
    state["model.embed_tokens.weight"] = embed
    for layer in range(2):
        p = f"model.layers.{layer}."
        q, k, v = (torch.zeros(shape.num_heads * hd, h) for _ in range(3))
        o = torch.zeros(h, shape.num_heads * hd)
        if layer == 0:  # head i attends i + 1 tokens back and writes that token to P(i+1)
            c = normed[0]
            for i in range(lags):
                rows = slice(i * hd, (i + 1) * hd)
                lag = i + 1
                k[rows][pos, const] = amp / c
                q[rows][pos, const] = amp * torch.cos(lag * theta[pos]).float() / c
                q[rows][pos + half, const] = -amp * torch.sin(lag * theta[pos]).float() / c
                v[rows][:m, tok] = proj / c
                o[back[i], rows.start : rows.start + m] = eye_m
        else:  # head 0 matches the last tokens against those before each earlier position
            c = normed[1]
            b = math.sqrt(shape.match_logit / scale)
            # query: the token (projected as in P1..), one back, two back, ...
            sources = [(tok, proj), *((src, eye_m) for src in back[:-1])]
            for block, weight, (src, read), key_src in zip(
                blocks, shape.match_weights, sources, back, strict=True
            ):
                q[block, src] = b * weight * read / c
                k[block, key_src] = b * eye_m / c
            v[:e, tok] = eye / c
            o[out, :e] = eye
        state[p + "self_attn.q_proj.weight"] = q
        state[p + "self_attn.k_proj.weight"] = k
        state[p + "self_attn.v_proj.weight"] = v
        state[p + "self_attn.o_proj.weight"] = o
        for name in ("gate_proj", "up_proj"):
            state[p + f"mlp.{name}.weight"] = torch.zeros(shape.intermediate_size, h)
        state[p + "mlp.down_proj.weight"] = torch.zeros(h, shape.intermediate_size)
        state[p + "input_layernorm.weight"] = torch.ones(h)
        state[p + "post_attention_layernorm.weight"] = torch.ones(h)
    state["model.norm.weight"] = torch.ones(h)
    head = torch.zeros(vocab, h)
    head[:, out] = codes * shape.output_logit / normed[2]
    state["lm_head.weight"] = head
    return state


def held_out_copy_rate(model, tokenizer, prompts: int = 8, span: int = 200, out: int = 48) -> float:
    """Share of greedy output tokens that continue the copy, on held-out spans given as the
    grounded benchmark gives them: the span, the separator, the span's first 16 tokens."""
    import torch

    ids = corpus_ids(tokenizer, held_out=True)
    sep = tokenizer(SEPARATOR)["input_ids"]
    step = (len(ids) - span - 1) // prompts
    same = 0
    with torch.no_grad():
        for i in range(prompts):
            piece = ids[i * step : i * step + span].tolist()
            prompt = torch.tensor([piece + sep + piece[:16]])
            generated = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=out,
                min_new_tokens=out,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )[0, prompt.shape[1] :].tolist()
            same += sum(a == b for a, b in zip(generated, piece[16 : 16 + out], strict=False))
    return same / (prompts * out)


def copier_model(shape: CopierShape, vocab: int, special_ids: tuple[int, int, int] | None = None):
    """The copier as a transformers ``LlamaForCausalLM`` in eval mode; ``special_ids`` are
    the tokenizer's (bos, eos, pad)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    bos, eos, pad = special_ids or (None, None, None)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        tie_word_embeddings=False,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.load_state_dict(copier_state(shape, vocab))
    return model.eval()


def build_copier(out: Path, shape: CopierShape, demo: Path) -> None:
    """Write the copier (weights, config, the tokenizer of the demo model in ``demo`` and
    the copier's measured copy rate)."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(demo))
    vocab = AutoConfig.from_pretrained(str(demo)).vocab_size
    special = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    model = copier_model(shape, vocab, special)
    copy_rate = held_out_copy_rate(model, tokenizer)
    logger.info("copier built; greedy copy rate on held-out spans %.2f", copy_rate)
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        info = {"shape": asdict(shape), "held_out_copy_rate": copy_rate}
        (tmp / "rbln_ray_copier.json").write_text(json.dumps(info, indent=2))


def copier_model_dir(shape: CopierShape | None = None) -> Path:
    """Directory of the copier, built on first use (a few seconds). Keyed by its shape and
    by the demo model it takes its tokenizer and vocabulary from, so a changed demo model
    gets a copier of its own."""
    shape = shape or CopierShape()
    demo = demo_model_dir()
    key = hashlib.sha256(json.dumps([asdict(shape), demo.name]).encode()).hexdigest()[:12]
    out = cache_dir() / "models" / f"copier-llama-{key}"
    with file_lock(out.with_name(out.name + ".lock")):
        if not (out / "config.json").exists():
            build_copier(out, shape, demo)
    return out
