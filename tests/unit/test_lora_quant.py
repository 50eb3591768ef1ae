"""LoRA adapters and quantized checkpoints, compile side: what is accepted, what is refused
and how the refusal reads, before optimum-rbln loads anything (it would load most refused
inputs silently wrong)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rbln_ray.compile import lora, quantization
from rbln_ray.compile.family_compile import CompileConfigError, compile_directory
from rbln_ray.compile.lora import LoRAError, read_adapter
from rbln_ray.compile.quantization import QuantizationError, QuantSpec, spec_from_hf_config
from rbln_ray.compile.settings import CompileSettings, CompileSettingsError

HF = {
    "hidden_size": 8,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 16,
    "num_hidden_layers": 2,
}
DIMS = {"q_proj": (8, 8), "k_proj": (8, 4), "v_proj": (8, 4), "o_proj": (8, 8)}
DIMS.update({"gate_proj": (8, 16), "up_proj": (8, 16), "down_proj": (16, 8)})


def ct(weights="int", fmt="int-quantized", kv=None, **over) -> dict:
    w = {"num_bits": 8, "type": weights, "symmetric": True, "strategy": "channel"}
    group = {"targets": ["Linear"], "weights": {**w, **over.pop("w", {})}}
    group["input_activations"] = over.pop("input_activations", None)
    qc = {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"g": group}}
    return {"quantization_config": {**qc, "kv_cache_scheme": kv, **over}}


FP8_KV = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"}


# ----------------------------------------------------------------------------- quantization
def test_quantization_config_translation() -> None:
    assert spec_from_hf_config({}) is None
    assert spec_from_hf_config(ct()) == QuantSpec("int8")
    assert spec_from_hf_config(ct("float", "float-quantized", FP8_KV)) == QuantSpec("fp8", "fp8")
    rbln = {"quant_method": "rbln", "weights": "fp8", "kv_caches": "fp8"}
    assert spec_from_hf_config({"quantization_config": rbln}) == QuantSpec("fp8", "fp8")
    assert QuantSpec("int8", "fp8").as_optimum() == {
        "format": "rbln", "weights": "int8", "activations": "fp16", "kv_caches": "fp8"
    }  # fmt: skip
    # gpt-oss's MXFP4 experts go their own way (not claimed here)
    assert spec_from_hf_config({"quantization_config": {"quant_method": "mxfp4"}}) is None


@pytest.mark.parametrize(
    ("hf_config", "names"),
    [
        ({"quantization_config": {"quant_method": "awq"}}, ["'awq'", "compressed-tensors"]),
        (ct(fmt="pack-quantized"), ["pack-quantized", "packed"]),
        (ct(ignore=["lm_head", "model.layers.0.mlp.down_proj"]), ["down_proj"]),
        (ct(input_activations={"num_bits": 8}), ["input_activations", "W8A16"]),
        (ct(w={"symmetric": False}), ["asymmetric"]),
        (ct(w={"num_bits": 4}), ["num_bits=4"]),
        (ct(w={"strategy": "group"}), ["strategy='group'"]),
        (ct(kv={"num_bits": 8, "type": "int"}), ["kv_cache_scheme", "fp8"]),
        ({"quantization_config": {"quant_method": "rbln", "kv_caches": "fp8"}}, ["fp8 KV"]),
        ({"quantization_config": {"quant_method": "rbln", "weights": "int4"}}, ["int4"]),
        (
            {
                "quantization_config": {
                    "quant_method": "rbln",
                    "weights": "int8",
                    "activations": "int8",
                }
            },
            ["activations='int8'"],
        ),
    ],
)
def test_quantization_configs_refused_naming_why(hf_config: dict, names: list[str]) -> None:
    with pytest.raises(QuantizationError) as err:
        spec_from_hf_config(hf_config)
    assert all(n in str(err.value) for n in names), str(err.value)


def test_resolve_spec_against_the_checkpoint() -> None:
    resolve = quantization.resolve_spec
    assert resolve(ct(), None, None, "m") == QuantSpec("int8")
    assert resolve(ct(), "int8", None, "m") == QuantSpec("int8")
    with pytest.raises(QuantizationError, match="not a pre-quantized checkpoint.*quantize it"):
        resolve({}, "int8", None, "m")
    with pytest.raises(QuantizationError, match="conflicts with m, whose checkpoint holds int8"):
        resolve(ct(), "fp8", None, "m")
    with pytest.raises(QuantizationError, match="no fp8 KV scales"):
        resolve(ct(), None, "fp8", "m")
    with pytest.raises(QuantizationError, match="only together with int8 or fp8 weights"):
        resolve({}, None, "fp8", "m")


def _checkpoint(tmp_path: Path, tensors: dict, config: dict | None = None) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config or {**HF, **ct()}))
    return tmp_path


def _int8_tensors(kv: bool = False) -> dict:
    t = {"model.embed_tokens.weight": torch.zeros(10, 8)}
    for layer in range(2):
        for proj, (fan_in, fan_out) in DIMS.items():
            module = "self_attn" if proj in lora.ATTENTION else "mlp"
            base = f"model.layers.{layer}.{module}.{proj}."
            t[base + "weight"] = torch.zeros(fan_out, fan_in, dtype=torch.int8)
            t[base + "weight_scale"] = torch.ones(fan_out, 1)
        if kv:
            t[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(0.1)
            t[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(0.1)
    return t


def test_checkpoint_tensors_are_checked(tmp_path: Path) -> None:
    validate = quantization.validate_checkpoint
    good = _checkpoint(tmp_path / "good", _int8_tensors(kv=True))
    validate(good, QuantSpec("int8", "fp8"), HF)
    cases = {
        "scale": ("model.layers.1.mlp.up_proj.weight_scale", None, "has no"),
        "float": ("model.layers.0.self_attn.q_proj.weight", torch.zeros(8, 8), "F32, not I8"),
        "zp": ("model.layers.0.self_attn.q_proj.weight_zero_point", torch.zeros(8), "cannot use"),
    }
    for name, (key, value, message) in cases.items():
        tensors = _int8_tensors()
        if value is None:
            del tensors[key]
        else:
            tensors[key] = value
        bad = _checkpoint(tmp_path / name, tensors)
        with pytest.raises(QuantizationError, match=message) as err:
            validate(bad, QuantSpec("int8"), HF)
        assert key.rsplit(".", 1)[0] in str(err.value)
    with pytest.raises(QuantizationError, match="not F8_E4M3"):
        validate(good, QuantSpec("fp8"), HF)
    no_kv = _checkpoint(tmp_path / "nokv", _int8_tensors())
    with pytest.raises(QuantizationError, match="fp8 KV: no model.layers.0.self_attn.k_scale"):
        validate(no_kv, QuantSpec("int8", "fp8"), HF)


# ----------------------------------------------------------------------------- LoRA
def _adapter(tmp_path: Path, name: str = "a", r: int = 2, targets=("q_proj", "down_proj"), **cfg):
    d = tmp_path / name
    d.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for layer in range(2):
        for proj in targets if isinstance(targets, (list, tuple)) else lora.PROJECTIONS:
            if proj not in DIMS:
                continue
            module = "self_attn" if proj in lora.ATTENTION else "mlp"
            key = f"base_model.model.model.layers.{layer}.{module}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.ones(r, DIMS[proj][0])
            tensors[f"{key}.lora_B.weight"] = torch.ones(DIMS[proj][1], r)
    tensors.update(cfg.pop("tensors", {}))
    for drop in cfg.pop("drop", ()):
        del tensors[drop]
    save_file(tensors, str(d / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": r, "lora_alpha": 4, "target_modules": targets, **cfg}
    (d / "adapter_config.json").write_text(json.dumps(config))
    return d


def test_adapter_is_read_and_checked(tmp_path: Path) -> None:
    a = read_adapter("a", _adapter(tmp_path), HF)
    assert (a.r, a.alpha, a.target_modules, a.rslora) == (2, 4.0, ("q_proj", "down_proj"), False)
    everything = read_adapter("all", _adapter(tmp_path, "all", targets="all-linear"), HF)
    assert everything.target_modules == lora.PROJECTIONS
    rs = read_adapter("rs", _adapter(tmp_path, "rs", r=4, use_rslora=True), HF)
    # optimum scales rsLoRA by alpha / r**1.5; scaling_factor r makes it PEFT's alpha/sqrt(r)
    assert rs.optimum(1, rs.path)["scaling_factor"] == 4.0


A_KEY = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"
NAMED_KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"  # PEFT < 0.7


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"targets": ["q_proj", "lm_head"]}, ["['lm_head']", "cannot adapt", "q_proj"]),
        ({"targets": "q_proj|v_proj"}, ["target_modules='q_proj|v_proj'"]),
        ({"use_dora": True}, ["use_dora", "DoRA"]),
        ({"bias": "all"}, ["bias='all'"]),
        ({"modules_to_save": ["lm_head"]}, ["modules_to_save"]),
        ({"rank_pattern": {"q_proj": 4}}, ["rank_pattern"]),
        ({"peft_type": "IA3"}, ["IA3"]),
        ({"drop": [A_KEY]}, ["missing", A_KEY]),
        ({"tensors": {A_KEY: torch.ones(3, 16)}}, ["shape", "(3, 16) != (2, 16)"]),
        (
            {"tensors": {NAMED_KEY: torch.ones(2, 8)}},
            ["unexpected", "lora_A.default.weight"],
        ),
    ],
)
def test_adapters_refused_naming_why(tmp_path: Path, kwargs: dict, names: list[str]) -> None:
    with pytest.raises(LoRAError) as err:
        read_adapter("a", _adapter(tmp_path, **kwargs), HF)
    text = str(err.value)
    assert "'a'" in text and all(n in text for n in names), text


def test_adapter_names_and_directories(tmp_path: Path) -> None:
    with pytest.raises(LoRAError, match="name 'a b'"):
        read_adapter("a b", _adapter(tmp_path), HF)
    with pytest.raises(LoRAError, match="no adapter_config.json"):
        read_adapter("a", tmp_path / "missing", HF)


def test_cache_key_follows_adapter_contents_not_paths(tmp_path: Path) -> None:
    one = _adapter(tmp_path / "x", "a")
    same = _adapter(tmp_path / "y", "a")
    other = _adapter(tmp_path / "z", "a", r=3)
    assert lora.modules_key({"a": str(one)}) == lora.modules_key({"a": str(same)})
    assert lora.modules_key({"a": str(one)}) != lora.modules_key({"a": str(other)})


def test_settings_take_lora_modules_and_keep_translated_keys_from_optimum() -> None:
    s = CompileSettings.from_dict({"lora_modules": ["a=/x", "b=/y=z"], "max_seq_len": 64})
    assert s.lora_modules == {"a": "/x", "b": "/y=z"}
    assert "lora_modules" not in s.rbln_config() and "quantization" not in s.rbln_config()
    with pytest.raises(CompileSettingsError, match="NAME=DIR"):
        CompileSettings.from_dict({"lora_modules": ["nodir"]})
    with pytest.raises(CompileSettingsError, match="quantization"):
        CompileSettings.from_dict({"quantization": "int4"})


def test_lora_and_quantization_refused_where_not_compiled(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**HF, "architectures": ["LlamaForCausalLM"]}))
    lora_settings = CompileSettings(lora_modules={"a": str(tmp_path)})
    with pytest.raises(CompileConfigError, match="lora_modules: .*not 2-stage pipelines"):
        compile_directory(model, tmp_path / "out", lora_settings, pipeline_stages=2)
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    with pytest.raises(CompileConfigError, match="quantization: .*not BertModel"):
        compile_directory(bert, tmp_path / "out", CompileSettings(quantization="int8"))


def test_moved_artifact_loads_through_a_view_of_its_own_adapters(tmp_path: Path) -> None:
    art = tmp_path / "art"
    (art / "lora_adapters" / "a").mkdir(parents=True)
    (art / "lora_adapters" / "a" / "adapter_config.json").write_text("{}")
    (art / "prefill.rbln").write_text("graph")
    raw = {"lora_config": {"adapters": [{"lora_name": "a", "lora_path": "/gone/a"}]}}
    (art / "rbln_config.json").write_text(json.dumps(raw))
    view = lora.loadable_dir(art)
    assert view != art and (view / "prefill.rbln").read_text() == "graph"
    recorded = json.loads((view / "rbln_config.json").read_text())["lora_config"]["adapters"]
    assert recorded[0]["lora_path"] == str((art / "lora_adapters" / "a").resolve())
    assert json.loads((art / "rbln_config.json").read_text()) == raw  # the artifact untouched
    lora.relocate(art, tmp_path / "final")
    moved = json.loads((art / "rbln_config.json").read_text())["lora_config"]["adapters"]
    assert moved[0]["lora_path"] == str((tmp_path / "final" / "lora_adapters" / "a").resolve())
    (art / "lora_adapters" / "a" / "adapter_config.json").unlink()
    with pytest.raises(LoRAError, match="neither"):
        lora.loadable_dir(art)


def test_timing_mode_models_the_artifact_as_stored(tmp_path: Path, monkeypatch) -> None:
    """Timing mode reads a quantized / LoRA artifact's rbln_config.json, also when the shape
    is a preset (RBLN_RAY_TIMING_SHAPE): fewer weight bytes per call, fp8 KV."""
    from types import SimpleNamespace

    from rbln_ray.emulator.timing import graph_shape
    from rbln_ray.npu.cost_model import preset

    raw = {"quantization": {"weights": "int8", "kv_caches": "fp8"}}
    (tmp_path / "rbln_config.json").write_text(json.dumps(raw))
    cm = SimpleNamespace(path=str(tmp_path / "decoder_batch_4.rbln"))
    monkeypatch.setenv("RBLN_RAY_TIMING_SHAPE", "llama-3-8b")
    shape = graph_shape(cm)
    assert (shape.linear_weight_bytes, shape.kv_bytes) == (1.0, 1)
    assert shape.weight_bytes_total < 0.6 * preset("llama-3-8b").weight_bytes_total
