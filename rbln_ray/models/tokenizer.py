"""A byte-level BPE tokenizer trained on the local Python standard library.

Why: tests and the demo must run offline, so the tokenizer is trained here from text every
machine with Python has. The corpus is a fixed, sorted list of stdlib modules, so the same
Python version always yields the same tokenizer.
"""

from __future__ import annotations

import logging
import sysconfig
from pathlib import Path

from rbln_ray.common.paths import atomic_dir, cache_dir

logger = logging.getLogger(__name__)

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
# Minimal ChatML-like template so chat endpoints work with the locally built models.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TOKENIZER_VERSION = "v1"


def corpus_files(max_bytes: int = 4_000_000, offset_files: int = 0) -> list[Path]:
    """Sorted top-level stdlib ``.py`` files, up to ``max_bytes`` in total.

    ``offset_files`` skips that many files first, which gives held-out text for evaluation.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())[offset_files:]
    chosen, total = [], 0
    for path in files:
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        chosen.append(path)
        total += size
    return chosen


def build_tokenizer(vocab_size: int = 4096, out_dir: Path | None = None) -> Path:
    """Train (once, cached) and save a byte-level BPE tokenizer; return its directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = out_dir or cache_dir() / f"tokenizer-{TOKENIZER_VERSION}-{vocab_size}"
    if (out / "tokenizer.json").exists():
        return out
    logger.info("training a %d-token byte-level BPE tokenizer on local stdlib text", vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(p) for p in corpus_files()], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD
    )
    fast.chat_template = CHAT_TEMPLATE
    with atomic_dir(out) as tmp:
        fast.save_pretrained(tmp)
    return out
