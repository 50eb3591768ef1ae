"""The demo model: a small Llama trained briefly on local Python sources, cached, and how it is
compiled.

Why: a random-weight model proves token-exactness but writes gibberish; an operator trying
``rbln-ray serve`` should see recognisable (Python-like) text. Nothing can be downloaded, so
the model is trained here once, on the standard library sources, with a progress bar, and
cached under the user cache dir. Training is seeded; results may differ in the last bits
across machines, which is fine: tests compare serving output with transformers' output on
whatever weights were trained.

A served model named ``"demo"`` (:data:`DEMO_MODEL`) is this model compiled with
:data:`DEMO_COMPILE` under whatever compile settings its config sets: :func:`resolve_model`
is the one place that turns the name into a directory and settings, for ``rbln-ray serve``
(which compiles in the foreground) and a Serve replica alike.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rbln_ray.common.paths import atomic_dir, cache_dir, file_lock
from rbln_ray.compile.settings import CompileSettings
from rbln_ray.models.builder import TinyModelSpec, make_config
from rbln_ray.models.tokenizer import build_tokenizer, corpus_files

logger = logging.getLogger(__name__)


# What a config names the demo model by.
DEMO_MODEL = "demo"
# The demo model's compile settings: batch 4 with smaller decode graphs for light load.
DEMO_COMPILE = {"batch_size": 4, "max_seq_len": 1024, "decoder_batch_sizes": (4, 2, 1)}


@dataclass(frozen=True)
class DemoTraining:
    """Training recipe; part of the cache key so a changed recipe retrains."""

    steps: int = 500
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    warmup: int = 30
    seed: int = 0


DEMO_SPEC = TinyModelSpec(
    family="llama",
    hidden_size=256,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=688,
    vocab_size=4096,
    max_position_embeddings=1024,
    initializer_range=0.02,
    seed=0,
)


def corpus_ids(tokenizer, held_out: bool = False):
    """Token ids of the training corpus (or of the held-out stdlib files), as one 1-D tensor."""
    import torch

    train_files = corpus_files()
    files = corpus_files(offset_files=len(train_files)) if held_out else train_files
    ids: list[int] = []
    for path in files:
        ids.extend(tokenizer(path.read_text(errors="replace"))["input_ids"])
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def mean_loss(model, ids, seq_len: int = 128, max_windows: int = 64) -> float:
    """Mean next-token cross-entropy of ``model`` over non-overlapping windows of ``ids``."""
    import torch

    n = min(max_windows, (len(ids) - 1) // seq_len)
    windows = ids[: n * seq_len].view(n, seq_len)
    losses = []
    with torch.no_grad():
        for chunk in windows.split(16):
            losses.append(model(input_ids=chunk, labels=chunk).loss.item() * len(chunk))
    return sum(losses) / n


def train_demo_model(out: Path, recipe: DemoTraining) -> None:
    """Train the demo Llama on the stdlib corpus and save it (with tokenizer) to ``out``."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_tokenizer(DEMO_SPEC.vocab_size))
    config = make_config(
        DEMO_SPEC, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    )
    torch.manual_seed(recipe.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ids = corpus_ids(tokenizer)
    gen = torch.Generator().manual_seed(recipe.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.01)

    def lr_at(step: int) -> float:
        if step < recipe.warmup:
            return (step + 1) / recipe.warmup
        frac = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    start = time.monotonic()
    bar = tqdm(range(recipe.steps), desc="training demo model (first use only)", unit="step")
    for _ in bar:
        offs = torch.randint(0, len(ids) - recipe.seq_len - 1, (recipe.batch_size,), generator=gen)
        batch = torch.stack([ids[o : o + recipe.seq_len] for o in offs.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    held_out = mean_loss(model, corpus_ids(tokenizer, held_out=True))
    took = time.monotonic() - start
    logger.info("demo model trained in %.0f s; held-out loss %.3f", took, held_out)
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        info = {"spec": asdict(DEMO_SPEC), "training": asdict(recipe), "held_out_loss": held_out}
        (tmp / "rbln_ray_demo.json").write_text(json.dumps(info, indent=2))


def demo_model_dir(recipe: DemoTraining | None = None) -> Path:
    """Directory of the trained demo model, training it on first use (a few minutes)."""
    import hashlib

    recipe = recipe or DemoTraining()
    key = hashlib.sha256(
        json.dumps([DEMO_SPEC.key_fields(), asdict(recipe)], sort_keys=True).encode()
    ).hexdigest()[:12]
    out = cache_dir() / "models" / f"demo-llama-{key}"
    with file_lock(out.with_name(out.name + ".lock")):
        if not (out / "config.json").exists():
            train_demo_model(out, recipe)
    return out


def demo_compile(given: CompileSettings | None = None) -> CompileSettings:
    """The demo model's compile settings: :data:`DEMO_COMPILE` under the settings ``given``
    sets explicitly (a config's ``compile:``)."""
    explicit = given.model_dump(exclude_unset=True) if given is not None else {}
    return CompileSettings(**{**DEMO_COMPILE, **explicit})


def resolve_model(
    model: str, settings: CompileSettings | None = None
) -> tuple[str, CompileSettings]:
    """``(directory, compile settings)`` of a served model: ``"demo"`` is the trained demo
    model (trained on first use) with :func:`demo_compile`; any other model is its own
    directory with the settings as given."""
    if model == DEMO_MODEL:
        return str(demo_model_dir()), demo_compile(settings)
    return model, settings or CompileSettings()
