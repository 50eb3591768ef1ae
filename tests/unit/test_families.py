"""The family registry: the docs' support matrices, the verification claims they make, the
architecture lookup, the family modules' contract, clear errors for unsupported models and
rejected config values, and the sliding-window cache slots."""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from rbln_ray.cli.main import main as cli_main
from rbln_ray.families import matrix
from rbln_ray.families.registry import (
    DECODERS,
    ENCODERS,
    FAMILIES,
    GREEDY_TEST,
    LLM_GREEDY_TEST,
    POOLING_DECODERS,
    SPEECH,
    UNSUPPORTED,
    VISION,
    UnsupportedModelError,
    VisionFamily,
    family_for_dir,
    get_rbln_model_info,
    vision_for_dir,
)
from rbln_ray.vllm_plugin.kv_blocks import NO_BLOCK
from rbln_ray.vllm_plugin.kv_slots import SlotManager

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _cli_logging_per_test() -> Iterator[None]:
    """The CLI attaches a handler to the then-current stderr (capsys's, closed after the
    test); drop it so the next test's CLI call attaches a fresh one."""
    logger = logging.getLogger("rbln_ray")
    saved = (list(logger.handlers), logger.propagate, logger.level)
    yield
    logger.handlers[:], logger.propagate, logger.level = saved[0], saved[1], saved[2]


# The docs page that shows each kind's support matrix (the site's "Models and families").
MATRIX_PAGES = {
    "decoders": "docs/guides/models.md",
    "encoders": "docs/guides/pooling.md",
    "vision": "docs/guides/vision-language.md",
    "speech": "docs/guides/speech.md",
}


@pytest.mark.parametrize("kind", ["decoders", "encoders", "vision", "speech"])
def test_docs_support_matrices_are_the_registry(kind: str) -> None:
    assert set(MATRIX_PAGES) == set(matrix.matrices())  # a new kind needs a page
    page = MATRIX_PAGES[kind]
    assert matrix.matrices()[kind] in (ROOT / page).read_text(), (
        f"{page}'s {kind} matrix differs from rbln_ray.families.registry; paste `python -c "
        f"'from rbln_ray.families import matrix; print(matrix.matrices()[\"{kind}\"])'`"
    )


def test_the_readme_catalogue_is_the_registry() -> None:
    """The README lists every family the registry serves or refuses."""
    assert matrix.catalogue() in (ROOT / "README.md").read_text(), (
        "README.md's family table differs from rbln_ray.families.registry; paste `python -c "
        "'from rbln_ray.families import matrix; print(matrix.catalogue())'`"
    )


def test_each_refusal_reason_holds_for_the_pinned_packages() -> None:
    """What each refusal in the registry rests on, as facts of the installed transformers,
    optimum-rbln and vLLM (a new refusal needs its facts here)."""
    import importlib
    from importlib.metadata import files

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from vllm import ModelRegistry

    models = ("optimum", "rbln", "transformers", "models")
    optimum = {p.parts[4] for p in files("optimum-rbln") if p.parts[:4] == models}
    assert set(UNSUPPORTED) == {
        "ExaoneForCausalLM",
        "MidmLMHeadModel",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3_5MoeForCausalLM",
        "T5EncoderModel",
    }
    # optimum-rbln compiles EXAONE 3.x and Mi:dm, but transformers has no code to build them
    assert {"exaone", "midm"} <= optimum
    assert not {"exaone", "midm"} & set(CONFIG_MAPPING_NAMES)
    # transformers has Qwen3.5 MoE, optimum-rbln has no class for it
    assert "qwen3_5_moe" in CONFIG_MAPPING_NAMES and "qwen3_5_moe" not in optimum
    # optimum-rbln compiles T5's encoder; vLLM has no model to serve it with
    assert "t5" in optimum and "T5EncoderModel" not in ModelRegistry.get_supported_archs()
    # Gemma 4 with images: transformers' processor (which vLLM's gemma4_mm imports) needs
    # torchvision, which this project cannot install beside torch (why gemma4_vl has its own)
    with pytest.raises(ModuleNotFoundError, match="torchvision"):
        importlib.import_module("transformers.models.gemma4.processing_gemma4")


def test_every_verified_claim_is_a_test_case() -> None:
    """Each 'verified by' names a parametrized case that exists (and so runs in make test)."""
    from tests.vllm_plugin import test_llm_greedy, test_zoo_greedy

    zoo_cases = {f"{GREEDY_TEST}[{f}-{a}]" for f, a in test_zoo_greedy.CASES}
    marks = test_llm_greedy.test_llm_greedy_matches_transformers.pytestmark
    llm_cases = {
        f"{LLM_GREEDY_TEST}[{'-'.join(getattr(case, 'values', case))}]"
        for m in marks
        if m.name == "parametrize"
        for case in m.args[1]
    }
    claims = {ref for fam in DECODERS.values() for ref in fam.verified_by.values()}
    assert claims <= zoo_cases | llm_cases, claims - (zoo_cases | llm_cases)
    # every family is verified under at least one attention implementation, and the tests
    # named by the other kinds' records exist
    assert all(fam.verified_by for fam in DECODERS.values())
    for fam in [*ENCODERS.values(), *VISION.values(), *POOLING_DECODERS.values(), *SPEECH.values()]:
        for ref in fam.verified_by.values():
            assert (ROOT / ref.partition("::")[0]).is_file(), (fam.name, ref)


def test_get_rbln_model_info_and_lookup_errors(tmp_path: Path) -> None:
    assert get_rbln_model_info({"architectures": ["Gemma2ForCausalLM"]}) == (
        "gemma2",
        "RBLNGemma2ForCausalLM",
    )
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MidmLMHeadModel"]}))
    with pytest.raises(UnsupportedModelError) as err:
        family_for_dir(tmp_path)
    message = str(err.value)
    assert UNSUPPORTED["MidmLMHeadModel"] in message  # says why
    assert all(f.architecture in message for f in DECODERS.values())  # and what works
    assert all(f.architecture in message for f in VISION.values())


@pytest.mark.parametrize(
    "arch",
    [
        "Phi3ForCausalLM",
        "MidmLMHeadModel",
        "T5EncoderModel",
        None,
    ],
)
def test_compile_of_unsupported_architecture_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture, arch: str | None
) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": [arch] if arch else []}))
    assert cli_main(["compile", str(hf), str(tmp_path / "out"), "--max-seq-len", "512"]) == 2
    err = capsys.readouterr().err
    assert f"architecture [{arch!r}]" in err if arch else "architecture unknown" in err
    assert "supported: LlamaForCausalLM" in err and "GptOssForCausalLM" in err
    if arch in UNSUPPORTED:  # refused by name, with the reason
        assert UNSUPPORTED[arch] in err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["text", "vision-language"])
def test_qwen3_5_compiles_flash_attention_only(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Its eager attention is not token-exact past one prefill chunk: refused with the reason
    before anything is compiled, for the text-only model and the vision-language one (whose
    language model it is)."""
    os.environ.setdefault("RBLN_RAY_DEVICE", "emulated")
    from rbln_ray.models import build_tiny_model, build_tiny_vlm

    out = tmp_path / "out"
    hf = (
        build_tiny_model(family="qwen3_5_text")
        if kind == "text"
        else build_tiny_vlm(family="qwen3_5")
    )
    assert cli_main(["compile", str(hf), str(out), "--max-seq-len", "2048"]) == 2
    err = capsys.readouterr().err
    assert DECODERS["qwen3_5_text"].refused_attn["eager"] in err, err
    assert "attn_impl='eager' is refused" in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("key", ["num_kv_shared_layers", "enable_moe_block"])
def test_gemma4_checkpoints_it_cannot_serve_are_refused_naming_why(
    key: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Gemma 4 E2B/E4B (KV shared across layers) and 26B-A4B (experts): refused with the
    record's reason before anything is compiled (optimum-rbln 0.12 would fail deep in its
    attention, or compile experts of another activation)."""
    os.environ.setdefault("RBLN_RAY_DEVICE", "emulated")
    from rbln_ray.models import build_tiny_model

    hf = tmp_path / "hf"
    shutil.copytree(build_tiny_model(family="gemma4"), hf)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, key: 2 if "layers" in key else True}))
    out = tmp_path / "out"
    assert cli_main(["compile", str(hf), str(out), "--max-seq-len", "512"]) == 2
    err = capsys.readouterr().err
    assert f"{key}=" in err and DECODERS["gemma4"].refused_config[key] in err, err
    assert "Traceback" not in err and not out.exists()


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("use_bidirectional_attention", "vision"),
        ("use_bidirectional_attention", "all"),
        ("num_kv_shared_layers", 2),
    ],
)
def test_gemma4_with_images_it_cannot_serve_is_refused_naming_why(
    key: str, value: object, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Gemma 4 with images and bidirectional attention (no graph optimum-rbln 0.12 compiles
    attends as transformers does), or with the text family's refusals: refused with the
    reason before anything is compiled."""
    os.environ.setdefault("RBLN_RAY_DEVICE", "emulated")
    from rbln_ray.families.gemma4_vl import BIDIRECTIONAL_REASON
    from rbln_ray.models import build_tiny_vlm

    hf = tmp_path / "hf"
    shutil.copytree(build_tiny_vlm(family="gemma4_vl"), hf)
    config = json.loads((hf / "config.json").read_text())
    config["text_config"][key] = value
    (hf / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    assert cli_main(["compile", str(hf), str(out), "--max-seq-len", "512"]) == 2
    err = capsys.readouterr().err
    reasons = {
        **DECODERS["gemma4"].refused_config,
        "use_bidirectional_attention": BIDIRECTIONAL_REASON,
    }
    why = reasons[key]
    assert f"{key}={value!r}" in err and why in err, err
    assert "Traceback" not in err and not out.exists()


def test_compile_of_a_rejected_config_value_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """optimum-rbln's own validation (a sliding window beyond ATOM's limit) surfaces as one
    line naming the value, the model and the settings, not a compiler traceback."""
    os.environ.setdefault("RBLN_RAY_DEVICE", "emulated")
    from rbln_ray.models import build_tiny_model

    hf = build_tiny_model(
        family="gemma2",
        hidden_size=64,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
        sliding_window=40000,
    )
    out = tmp_path / "out"
    assert cli_main(["compile", str(hf), str(out), "--max-seq-len", "512"]) == 2
    err = capsys.readouterr().err
    assert "Sliding window size (40000) must be at most 32640 on ATOM" in err
    assert "Gemma2ForCausalLM via RBLNGemma2ForCausalLM" in err and "max_seq_len=512" in err
    assert "Traceback" not in err


def test_slot_manager_pins_lowest_free_slot_until_the_request_leaves() -> None:
    slots = SlotManager(3)
    assert [slots.slot(r) for r in ("a", "b", "a", "c")] == [0, 1, 0, 2]
    assert slots.scratch() == NO_BLOCK  # every slot held: padding rows touch none
    with pytest.raises(RuntimeError, match="no free sliding-window cache slot"):
        slots.slot("d")
    slots.release_missing({"a", "c"})  # b finished
    assert slots.scratch() == 1
    assert slots.slot("d") == 1 and slots.slot("c") == 2
    slots.release_missing(set())
    assert slots.assignment() == {} and slots.slot("e") == 0
    with pytest.raises(ValueError):
        SlotManager(0)


@pytest.mark.parametrize("name", list(DECODERS))
def test_build_model_builds_every_family_as_the_table_says(
    tmp_path: Path, capsys: pytest.CaptureFixture, name: str
) -> None:
    """``rbln-ray build-model FAMILY`` writes a transformers model whose config.json is the
    table's architecture and model_type (the loader and the CLI look families up by it)."""
    out = tmp_path / name
    args = ["build-model", name, "--out", str(out), "--hidden-size", "64", "--num-heads", "2"]
    assert cli_main([*args, "--num-kv-heads", "1", "--intermediate-size", "128"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    config = json.loads((out / "config.json").read_text())
    family = DECODERS[name]
    assert (config["architectures"], config["model_type"]) == (
        [family.architecture],
        family.model_type,
    )
    assert family_for_dir(out) is family
    assert get_rbln_model_info(config) == (name, family.optimum_class)


@pytest.mark.parametrize("name", list(VISION))
def test_build_model_builds_every_vision_language_family(
    tmp_path: Path, capsys: pytest.CaptureFixture, name: str
) -> None:
    """``rbln-ray build-model llava`` (or ``qwen2-vl``, ``qwen3_asr``) writes a model
    directory with the image (or audio) processor and the chat template vLLM's multimodal
    processor loads (offline, without torchvision), recognised as its family."""
    from rbln_ray.compile.vision import load_hf_processor
    from rbln_ray.models.vision import image_placeholder

    family = VISION[name]
    out = tmp_path / name
    assert cli_main(["build-model", name, "--out", str(out), "--num-layers", "1"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [family.architecture]
    assert config["text_config"]["num_hidden_layers"] == 1
    assert vision_for_dir(out) is family
    processor = load_hf_processor(out)
    assert processor.chat_template
    media = "audio" if family.transcribes else "image"
    messages = [{"role": "user", "content": [{"type": media}, {"type": "text", "text": "?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    placeholder = image_placeholder(name)
    if placeholder:  # a prompt names each image (or clip) where it stands
        token = processor.audio_token if family.transcribes else processor.image_token
        assert str(token) in placeholder and placeholder in prompt
    else:  # the processor puts the image before the text itself (BLIP-2)
        assert family.images_at_start and "?" in prompt


def test_every_record_names_real_classes_and_consumers_read_the_registry() -> None:
    """Each record's optimum-rbln classes exist in the installed optimum-rbln and its
    transformers architecture in transformers; ``rbln-ray build-model`` offers exactly the
    registry's families; vLLM gets a declaration for exactly the records that name one."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from rbln_ray.cli.main import parser
    from rbln_ray.emulator import ensure_runtime
    from rbln_ray.vllm_plugin import declarations

    ensure_runtime()  # optimum-rbln imports rebel
    import optimum.rbln

    from rbln_ray.upstream.optimum_models import rbln_class

    for fam in FAMILIES.values():
        assert rbln_class(fam.optimum_class), fam.optimum_class  # optimum's, or rbln-ray's
        assert hasattr(transformers, fam.architecture), fam.architecture
    for fam in VISION.values():
        assert hasattr(optimum.rbln, fam.vision_tower), fam.vision_tower
        # a decoder family, or the transformers model_type of one rbln-ray serves no
        # text-only family of
        assert fam.language_family in DECODERS or fam.language_family in CONFIG_MAPPING_NAMES
    build = parser()._subparsers._group_actions[0].choices["build-model"]
    (choice,) = [a for a in build._actions if a.dest == "family"]
    assert set(choice.choices) == {*FAMILIES, "demo"}
    declared = {f.architecture for f in DECODERS.values() if f.declared}
    assert declared == {"Qwen3_5ForCausalLM"}
    assert set(declarations()) == declared | {
        f.architecture for f in VISION.values() if f.declaration
    }


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_registered_family_keeps_its_kinds_contract(name: str) -> None:
    """What the compile, the builders, the runner and vLLM's registry take from a family's
    code is there, as its kind's contract (rbln_ray.families.contract) says: a kind with a
    contract of its own has a module, named after the family, whose ``CODE`` implements it."""
    from rbln_ray.families.contract import FamilyCode, SpeechCode, VisionCode
    from rbln_ray.families.qwen_vl_base import MRopeEmbedder
    from rbln_ray.families.vision_base import Declaration, PromptEmbedder
    from rbln_ray.vllm_plugin import declarations

    fam = FAMILIES[name]
    if fam.contract is FamilyCode:  # decoders, encoders, pooling decoders: the record is all
        assert not fam.module, f"{name} names a module its kind's contract does not use"
        return
    assert fam.module == name  # one module, named after the family
    code = fam.code()
    assert isinstance(code, fam.contract) and code.missing() == []
    assert fam.code() is code  # imported and checked once
    if isinstance(code, SpeechCode):
        assert code.decoder_length({}) > 0
        assert code.rbln_kwargs(4)["rbln_batch_size"] == 4
        return
    assert isinstance(code, VisionCode) and isinstance(fam, VisionFamily)
    # PLACEHOLDER is empty only where the processor places images itself
    assert code.PLACEHOLDER or fam.images_at_start
    assert set(code.SPECIAL_TOKENS)
    for placeholder in (code.PLACEHOLDER, code.VIDEO_PLACEHOLDER):  # made of special tokens
        for token in sorted(code.SPECIAL_TOKENS, key=len, reverse=True):
            placeholder = placeholder.replace(token, "")
        assert placeholder == ""
    assert bool(code.VIDEO_PLACEHOLDER) == ("video" in fam.inputs)
    assert issubclass(code.Embedder, PromptEmbedder)
    # the record's mrope (what the upstream contract checks of optimum) is the embedder's
    assert fam.mrope == issubclass(code.Embedder, MRopeEmbedder)
    if fam.declaration:
        module, _, cls = declarations()[fam.architecture].partition(":")
        declaration = getattr(importlib.import_module(module), cls)
        assert module == f"rbln_ray.families.{name}" and issubclass(declaration, Declaration)
        assert set(declaration.PLACEHOLDERS) == set(fam.inputs)
        for modality in fam.inputs:
            expected = code.VIDEO_PLACEHOLDER if modality == "video" else code.PLACEHOLDER
            assert declaration.get_placeholder_str(modality, 1) == (expected or None)


def test_a_family_module_that_breaks_the_contract_is_named() -> None:
    """Family.code refuses a module whose CODE is not its kind's contract, or leaves a
    required member unset, naming what is wrong (before any caller would trip on it)."""
    import sys
    import types

    from rbln_ray.families.contract import VisionCode

    class Incomplete(VisionCode):
        PLACEHOLDER = "<image>"

        def tiny_model(self, spec, tokenizer):
            raise NotImplementedError

    for module, code, message in (
        ("_contract_probe_a", object(), "not a VisionCode"),
        ("_contract_probe_b", Incomplete(), "sets no SPECIAL_TOKENS, Embedder"),
    ):
        fake = types.ModuleType(f"rbln_ray.families.{module}")
        fake.CODE = code
        sys.modules[fake.__name__] = fake
        try:
            record = VisionFamily(module, "X", "RBLNX", module=module)
            with pytest.raises(TypeError, match=message):
                record.code()
        finally:
            del sys.modules[f"rbln_ray.families.{module}"]


def test_loading_a_compiled_directory_asks_the_registry_at_most_twice(tmp_path: Path) -> None:
    """One dispatch per artifact: from the platform's ``compiled_artifact`` (an engine
    given a compiled directory) the registry is entered twice, once to refuse an unsupported
    architecture before anything else and once to pick the reader, which asks no more
    (counted as calls into registry.py's code from outside it)."""
    import sys
    from types import SimpleNamespace

    from vllm.platforms import current_platform

    import rbln_ray.families.registry as registry
    from rbln_ray.compile.artifact import CompiledArtifact

    assert current_platform.device_name  # vLLM resolves its platform before rbln-ray's loads
    from rbln_ray.vllm_plugin import platform

    art = tmp_path / "llama-compiled"
    art.mkdir()
    (art / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    rbln = {
        "cls_name": "RBLNLlamaForCausalLMConfig",
        "batch_size": 4,
        "max_seq_len": 1024,
        "kvcache_block_size": 1024,
        "kvcache_num_blocks": 5,
        "decoder_batch_sizes": [4, 2, 1],
    }
    (art / "rbln_config.json").write_text(json.dumps(rbln))
    vllm_config = SimpleNamespace(
        additional_config={},
        speculative_config=None,
        lora_config=None,
        cache_config=SimpleNamespace(cache_dtype="auto"),
        model_config=SimpleNamespace(
            model=str(art), original_max_model_len=None, runner_type="generate", hf_config=None
        ),
    )
    entries = []

    def profile(frame, event, arg) -> None:
        caller = frame.f_back
        if (
            event == "call"
            and frame.f_code.co_filename == registry.__file__
            and caller is not None
            and caller.f_code.co_filename != registry.__file__
        ):
            entries.append(f"{caller.f_code.co_name} -> {frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        loaded = platform.compiled_artifact(vllm_config)
    finally:
        sys.setprofile(None)
    assert isinstance(loaded, CompiledArtifact) and loaded.batch_size == 4
    assert entries == ["resolve_compiled_dir -> family_for_dir", "load_artifact -> artifact_family"]


def test_no_code_outside_the_families_package_names_a_family_or_probes_its_code() -> None:
    """Family facts live in rbln_ray/families: elsewhere no comparison with a family's name
    or model_type, and no ``hasattr``/``getattr`` on a family's code (its contract says what
    it has)."""
    import ast

    names = set(FAMILIES) | {f.model_type for f in DECODERS.values()}

    def strings(node: ast.AST) -> set[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return {e.value for e in node.elts if isinstance(e, ast.Constant)}
        return set()

    offenders = []
    for path in sorted((ROOT / "rbln_ray").rglob("*.py")):
        if "families" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Compare):
                for side in (node.left, *node.comparators):
                    if strings(side) & names:
                        offenders.append(f"{where}: compares with {sorted(strings(side) & names)}")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("hasattr", "getattr")
                and node.args
                and "code" in ast.unparse(node.args[0])
            ):
                offenders.append(f"{where}: {ast.unparse(node)}")
    assert not offenders, offenders


def test_a_compiled_directory_is_read_as_its_records_artifact(tmp_path: Path) -> None:
    """load_artifact asks the registry once and reads the directory as the record says: an
    encoder's as an encoder, a Qwen3 checkpoint compiled as its embedder (RBLNQwen3Model) as
    that pooling family's decoder artifact, the same checkpoint compiled as the causal LM as
    Qwen3's (also what the reranker serves), a vision-language model's by its language
    model, with its language family's prefill."""
    from rbln_ray.compile.artifact import CompiledArtifact, load_artifact
    from rbln_ray.compile.encoders import EncoderArtifact
    from rbln_ray.families.registry import artifact_family

    decoder = {
        "batch_size": 2,
        "max_seq_len": 256,
        "kvcache_block_size": 256,
        "kvcache_num_blocks": 3,
        "decoder_batch_sizes": [2],
    }

    def write(name: str, arch: str, rbln: dict) -> Path:
        out = tmp_path / name
        out.mkdir()
        (out / "config.json").write_text(json.dumps({"architectures": [arch]}))
        (out / "rbln_config.json").write_text(json.dumps(rbln))
        return out

    bert = write("bert", "BertModel", {"cls_name": "RBLNBertModelConfig", "batch_size": 2,
                                       "max_seq_len": 64})  # fmt: skip
    assert isinstance(load_artifact(bert), EncoderArtifact)
    embed = write("embed", "Qwen3ForCausalLM", {"cls_name": "RBLNQwen3ModelConfig", **decoder})
    art = load_artifact(embed)
    assert isinstance(art, CompiledArtifact) and art.pooling == "qwen3-embedding"
    causal = write("lm", "Qwen3ForCausalLM", {"cls_name": "RBLNQwen3ForCausalLMConfig", **decoder})
    assert artifact_family(causal, "RBLNQwen3ForCausalLMConfig") is DECODERS["qwen3"]
    assert load_artifact(causal).pooling == ""
    gemma = {"cls_name": "RBLNGemma3ForConditionalGenerationConfig", "language_model": decoder}
    art = load_artifact(write("gemma3_vl", "Gemma3ForConditionalGeneration", gemma))
    assert art.vision_family == "gemma3_vl" and not art.prefill_resumable  # Gemma3's prefill
    with pytest.raises(UnsupportedModelError, match="MidmLMHeadModel"):
        load_artifact(write("midm", "MidmLMHeadModel", {"cls_name": "X", **decoder}))


def test_paligemma_tokens_per_image_are_read_wherever_the_checkpoint_keeps_them() -> None:
    """transformers 5 saves ``num_image_tokens`` on ``text_config`` only, optimum-rbln reads it
    from ``vision_config`` (issue 47): derived from the tower's shape, and a checkpoint whose
    copies disagree or whose tower has no shape is refused naming the field."""
    from rbln_ray.families.paligemma import num_image_tokens

    tower = {"image_size": 224, "patch_size": 14}
    assert (
        num_image_tokens({"vision_config": tower, "text_config": {"num_image_tokens": 256}}) == 256
    )
    assert num_image_tokens({"vision_config": {**tower, "num_image_tokens": 256}}) == 256
    with pytest.raises(ValueError, match=r"text_config\.num_image_tokens is 255.*make 256"):
        num_image_tokens({"vision_config": tower, "text_config": {"num_image_tokens": 255}})
    with pytest.raises(ValueError, match="vision_config has no patch_size"):
        num_image_tokens({"vision_config": {"image_size": 224}})


def test_gemma3_merges_the_newlines_an_image_insertion_touches_as_the_tokenizer_does() -> None:
    """vLLM inserts an image's ``"\\n\\n<start_of_image>…<end_of_image>\\n\\n"`` as token ids;
    transformers tokenizes the text with it inside, where Gemma's multi-newline tokens swallow
    the newlines on either side (issue 47): runs an insertion touches merge, others stay, and
    each old position maps to the token holding its first character."""
    from rbln_ray.families.gemma3_vl import merge_newlines, newline_tokens

    n = {k: 100 + k for k in range(1, 5)}  # "\n" * k -> 100 + k; at most 4 per token
    newlines = newline_tokens({"\n" * k: i for k, i in n.items()} | {"a": 1, "x\n": 2})
    assert newlines == {i: k for k, i in n.items()}

    def encode(text: str) -> list[int]:  # leftmost-longest, as added tokens split text
        return [n[min(4, len(text) - i)] for i in range(0, len(text), 4)]

    # <|user|>"\n" + ["\n\n", boi, img, eoi, "\n\n"] + "\n": both sides merge into "\n\n\n"
    ids = [7, n[1], n[2], 50, 60, 51, n[2], n[1], 9]
    merged, where = merge_newlines(ids, set(range(2, 7)), newlines, encode)
    assert merged == [7, n[3], 50, 60, 51, n[3], 9]
    assert where == [0, 1, 1, 2, 3, 4, 5, 5, 6]
    # a run no insertion touches stays as it is
    assert merge_newlines(ids, {3}, newlines, encode) == (ids, list(range(len(ids))))
    # five newlines take two tokens: the inserted "\n\n" starts inside the first
    merged, where = merge_newlines([n[3], n[2], 50], {1, 2}, newlines, encode)
    assert merged == [n[4], n[1], 50] and where == [0, 0, 2]


@pytest.mark.parametrize(
    ("context", "language"), [(None, None), (None, "en"), ("Words: <|im_end|>fox.", "de")]
)
def test_qwen3_asr_transcription_prompts_are_transformers_requests(
    context: str | None, language: str | None
) -> None:
    """The prompt rbln-ray's declaration gives vLLM's transcription server equals, through
    transformers' processor, transformers' own ``apply_transcription_request`` (chat template,
    forced language by name, the request's context as the system turn); ChatML markers in
    the context are dropped first, as vLLM's own does."""
    import numpy as np
    from transformers import Qwen3ASRProcessor

    from rbln_ray.families.qwen3_asr import LANGUAGES, sanitize, transcription_prompt
    from rbln_ray.models import build_tiny_vlm

    processor = Qwen3ASRProcessor.from_pretrained(build_tiny_vlm(family="qwen3_asr"))
    clip = np.random.default_rng(0).standard_normal(16000 * 3).astype(np.float32) / 10
    name = LANGUAGES[language] if language else None
    ours = processor(text=[transcription_prompt(context, name)], audio=[clip], return_tensors="pt")
    theirs = processor.apply_transcription_request(
        clip, language=language, prompt=sanitize(context) or None
    )
    assert ours["input_ids"].tolist() == theirs["input_ids"].tolist()
    assert sanitize("<|im<|x|>_end|>a<asr_te<asr_text>xt>b") == "ab"


def test_qwen3_asr_checkpoints_in_the_original_layout_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    config = {"architectures": ["Qwen3ASRForConditionalGeneration"], "thinker_config": {}}
    (hf / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_asr"}))
    assert cli_main(["compile", str(hf), str(tmp_path / "out"), "--max-seq-len", "512"]) == 2
    err = capsys.readouterr().err
    assert "original layout (thinker_config)" in err and "Qwen3-ASR-*-hf" in err, err
    assert "Traceback" not in err and not (tmp_path / "out").exists()
