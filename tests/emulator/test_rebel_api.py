"""The rebel API surface vllm-rbln 0.12.0 uses beyond optimum's: ``rebel.core.torch_compile
.rbln_backend``, ``rebel.capture_reports``, ``rebel.CompileContext``, and the runtime's KV
host transfers ``_fetch_kv_cache`` / ``_update_kv_cache`` / ``_get_kv_cache_size``.

References are plain torch / plain Python, never the emulator itself.
"""

from __future__ import annotations

import gc
import time

import pytest
import rebel
import torch

from rbln_ray.emulator import DeviceError
from rbln_ray.emulator.rebel.core.torch_compile import GraphRuntime

# vllm-rbln's own option set for its sampler graphs (compile_sampler, non device-tensor path).
SAMPLER_OPTIONS = {"compile_context": None, "use_global_ctx": True, "global_device_id": 0}


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """vllm-rbln's rbln_greedy_sample."""
    return torch.ops.rbln.argmax(logits)


def top_k_top_p_sample(logits, temperature, k, p):
    """vllm-rbln's rbln_top_k_top_p_sample (temperature in place, softmax, the op)."""
    logits = logits.div_(temperature.to(logits.dtype).unsqueeze(dim=1))
    probs = torch.nn.functional.softmax(logits, dim=-1)
    return torch.ops.rbln.top_k_top_p(probs, k, p)


def compile_with(fn, **options):
    from rebel.core.torch_compile import rbln_backend

    return torch.compile(fn, backend=rbln_backend, dynamic=False, fullgraph=True, options=options)


# ---------------------------------------------------------------------------- package layout
def test_submodules_are_the_package_attributes_and_compile_context_is_top_level():
    import rebel.compile_context
    import rebel.core.torch_compile as imported

    assert imported is rebel.core.torch_compile  # one module object, not a second copy
    assert rebel.CompileContext is rebel.compile_context.CompileContext
    ctx = rebel.CompileContext(use_weight_sharing=False, use_global_ctx=True)  # vllm-rbln's call
    assert ctx.use_weight_sharing is False


# ---------------------------------------------------------------------------- torch.compile backend
def test_compiled_greedy_sampler_matches_plain_argmax():
    holder: list = []
    options = {**SAMPLER_OPTIONS, "compile_context": rebel.CompileContext(), "mode": []}
    sampler = compile_with(greedy, _runtime_holder=holder, **options)
    logits = torch.randn(8, 50)
    logits[3] = -float("inf")
    logits[5, [7, 9]] = 100.0  # a tie: first index
    expected = [max(range(50), key=lambda i, r=row: (r[i], -i)) for row in logits.tolist()]
    assert sampler(logits).tolist() == expected
    assert len(holder) == 1 and "GraphRuntime" in repr(holder[0])


def test_compiled_top_k_top_p_sampler_is_seeded_and_respects_top_k():
    sampler = compile_with(top_k_top_p_sample, **SAMPLER_OPTIONS)
    logits = torch.randn(1, 30).repeat(2000, 1)
    k = torch.full((2000,), 2, dtype=torch.int32)
    p = torch.full((2000,), 0.995)
    allowed = set(logits[0].topk(2).indices.tolist())
    rebel.manual_seed(5)
    first = sampler(logits.clone(), torch.full((2000,), 0.7), k, p)
    rebel.manual_seed(5)
    again = sampler(logits.clone(), torch.full((2000,), 0.7), k, p)
    assert set(first.tolist()) == allowed  # both top-2 tokens drawn, nothing else
    assert torch.equal(first, again)


def test_backend_refuses_options_it_does_not_know_or_emulate():
    logits = torch.randn(2, 5)
    with pytest.raises(Exception, match="unknown option.*'not_an_option'"):
        compile_with(greedy, not_an_option=1)(logits)
    with pytest.raises(Exception, match="dtype='float16' is not emulated"):
        compile_with(greedy, dtype="float16")(logits)
    with pytest.raises(Exception, match="unknown mode"):
        compile_with(greedy, mode=["fast"])(logits)


def test_compile_only_graphs_refuse_to_run():
    with pytest.raises(Exception, match="compile_only"):
        compile_with(greedy, mode=["compile_only"])(torch.randn(2, 5))


def test_backend_places_graphs_on_visible_devices_only(monkeypatch):
    monkeypatch.setenv("RBLN_DEVICES", "1")
    with pytest.raises(Exception, match="RBLN device 1 is not visible") as info:
        compile_with(greedy, global_device_id=1)(torch.randn(2, 5))
    # dynamo wraps backend errors in BackendCompilerFailed, keeping the original
    assert isinstance(getattr(info.value, "inner_exception", info.value), DeviceError)


# ---------------------------------------------------------------------------- capture_reports
class Sleepy(torch.nn.Module):
    """A graph whose device time is known: it sleeps 20 ms (no synchronisation involved)."""

    def forward(self, x, kv):
        time.sleep(0.02)
        return (x + kv.sum()).reshape(-1)


def _sleepy_runtime() -> rebel.Runtime:
    ctx = rebel.CompileContext()
    kv = torch.zeros(2, 1, 1, 4, 2, device="meta")
    ctx.mark_static_address(kv, "past_key_values_0")
    info = [("x", [3], "float32"), ("past_key_values_0", list(kv.shape), "float32")]
    return rebel.Runtime(rebel.compile_from_torch(Sleepy(), info, compile_context=ctx), device=0)


def test_capture_reports_one_report_per_call_with_the_fields_vllm_rbln_reads():
    rt = _sleepy_runtime()
    rt(torch.ones(3))  # outside any capture: not reported
    with rebel.capture_reports() as outer:
        rt(torch.ones(3), out=torch.zeros(3))
        with rebel.capture_reports() as inner:
            rt(torch.ones(3))
    assert len(outer) == 2 and len(inner) == 1
    for report in outer:
        fields = ("total_host", "total_device", "total_ccl", "prepare_input_us")
        assert all(isinstance(report[f], int) and report[f] >= 0 for f in fields)
        assert isinstance(report["prepare_output_us"], int)
        assert report["total_device"] >= 20_000  # the graph's 20 ms, in microseconds
        assert report["total_ccl"] == 0
    del rt
    gc.collect()


# ---------------------------------------------------------------------------- KV host transfers
BLOCKS, HEADS, SLOTS, DIM = 4, 2, 8, 3
NAMES = ("past_key_values_0", "past_key_values_1")


class KVSum(torch.nn.Module):
    def forward(self, x, k0, v0):
        return (x.sum() + k0.sum() + v0.sum()).reshape(1)


@pytest.fixture
def loaded_pair():
    """Two runtimes of one load (prefill- and decode-like) sharing filled KV buffers."""
    ctx = rebel.CompileContext()
    shape = [BLOCKS, HEADS, 1, SLOTS, DIM]
    info = [("x", [1], "float32")]
    for name in NAMES:
        ctx.mark_static_address(torch.zeros(shape, device="meta"), name)
        info.append((name, shape, "float32"))
    cms = [rebel.compile_from_torch(KVSum(), info, compile_context=ctx) for _ in range(2)]
    first, second = (rebel.Runtime(cm, device=0) for cm in cms)
    torch.manual_seed(0)
    for buf in first.kv_buffers.values():
        buf.copy_(torch.randn(buf.shape))
    yield first, second
    del first, second
    gc.collect()


def test_kv_cache_size_is_the_buffers_bytes(loaded_pair):
    rt, _ = loaded_pair
    one = BLOCKS * HEADS * SLOTS * DIM * 4
    assert rt._get_kv_cache_size("past_key_values_1") == one
    assert rt._get_kv_cache_size(None) == rt._get_kv_cache_size() == 2 * one


def test_fetch_one_layer_copies_only_the_requested_slots(loaded_pair):
    rt, _ = loaded_pair
    device = rt.kv_buffers["past_key_values_1"]
    host = torch.full(device.shape, -7.0)
    rt._fetch_kv_cache(host, 2, 3, 4, "past_key_values_1")
    expected = torch.full(device.shape, -7.0)
    expected[2, :, :, 3:7, :] = device[2, :, :, 3:7, :]
    assert torch.equal(host, expected)


def test_fetch_all_layers_into_a_flat_half_buffer_like_the_rebellions_hook(loaded_pair):
    """The hook allocates float16 elements covering the byte size and views them back."""
    rt, _ = loaded_pair
    nbytes = rt._get_kv_cache_size(None)
    host = torch.zeros((nbytes + 1) // 2, dtype=torch.float16)
    for block in range(BLOCKS):
        rt._fetch_kv_cache(host, block, 0, SLOTS, None)
    raw = host.view(torch.uint8)
    one = nbytes // 2
    for i, name in enumerate(NAMES):
        mirror = raw[i * one : (i + 1) * one].view(torch.float32).view(BLOCKS, HEADS, 1, SLOTS, DIM)
        assert torch.equal(mirror, rt.kv_buffers[name])


def test_update_writes_the_device_cache_seen_by_every_graph_of_the_load(loaded_pair):
    writer, reader = loaded_pair
    before = {n: b.clone() for n, b in reader.kv_buffers.items()}
    host = torch.arange(BLOCKS * HEADS * SLOTS * DIM, dtype=torch.float32).view(
        BLOCKS, HEADS, 1, SLOTS, DIM
    )
    writer._update_kv_cache(host, 1, 5, 3, "past_key_values_0")
    after = reader.kv_buffers
    expected = before["past_key_values_0"].clone()
    expected[1, :, :, 5:8, :] = host[1, :, :, 5:8, :]
    assert torch.equal(after["past_key_values_0"], expected)
    assert torch.equal(after["past_key_values_1"], before["past_key_values_1"])


def test_fetch_zero_update_round_trip_clears_just_that_range(loaded_pair):
    rt, _ = loaded_pair
    before = rt.kv_buffers["past_key_values_0"].clone()
    host = torch.empty(rt._get_kv_cache_size(None) // 4)
    rt._fetch_kv_cache(host, 0, 0, SLOTS, None)
    host.zero_()
    rt._update_kv_cache(host, 0, 2, 2, None)
    expected = before.clone()
    expected[0, :, :, 2:4, :] = 0
    assert torch.equal(rt.kv_buffers["past_key_values_0"], expected)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 0, 1, "past_key_values_9"), "no KV cache named 'past_key_values_9'"),
        ((BLOCKS, 0, 1, None), r"block ids must be in \[0, 4\)"),
        ((0, 6, 3, None), r"slots \[6, 9\) must lie in \[0, 8\]"),
        ((0, 0, SLOTS + 1, None), r"length must be in \[0, 8\]"),
    ],
)
def test_transfers_reject_bad_arguments(loaded_pair, args, match):
    rt, _ = loaded_pair
    host = torch.zeros(rt._get_kv_cache_size(None) // 4)
    with pytest.raises((KeyError, ValueError), match=match):
        rt._fetch_kv_cache(host, *args)


def test_transfers_reject_a_host_buffer_that_cannot_hold_the_cache(loaded_pair):
    rt, _ = loaded_pair
    with pytest.raises(ValueError, match="host holds 4 bytes"):
        rt._update_kv_cache(torch.zeros(1), 0, 0, 1, "past_key_values_0")
    strided = torch.zeros(2 * rt._get_kv_cache_size(None) // 4)[::2]
    with pytest.raises(ValueError, match="contiguous"):
        rt._fetch_kv_cache(strided, 0, 0, 1, None)


# ---------------------------------------------------------------------------- device threads
class ThreadProbe(torch.nn.Module):
    def forward(self, x, kv):
        return torch.tensor([float(torch.get_num_threads())])


def test_device_calls_use_the_emulated_device_threads(monkeypatch):
    ctx = rebel.CompileContext()
    kv = torch.zeros(1, 1, 1, 2, 2, device="meta")
    ctx.mark_static_address(kv, "past_key_values_0")
    info = [("x", [1], "float32"), ("past_key_values_0", list(kv.shape), "float32")]
    rt = rebel.Runtime(rebel.compile_from_torch(ThreadProbe(), info, compile_context=ctx), device=0)
    host = torch.get_num_threads()
    monkeypatch.setenv("RBLN_RAY_EMULATOR_THREADS", str(host + 2))
    assert rt(torch.zeros(1)).item() == host + 2
    graph = GraphRuntime(ThreadProbe(), device=0, compile_only=False)  # rbln_backend's runner
    assert graph(torch.zeros(1), None).item() == host + 2
    assert torch.get_num_threads() == host  # restored after each call
    monkeypatch.delenv("RBLN_RAY_EMULATOR_THREADS")
    assert rt(torch.zeros(1)).item() == host
    del rt
    gc.collect()


# ---------------------------------------------------------------------------- inputs by name
def _local_module_class() -> type[torch.nn.Module]:
    """A module class defined inside a function, as optimum-rbln's generic encoder wrapper is
    (``RBLNTransformerEncoder._wrap_model_if_needed``): not picklable by reference."""

    class Wrapper(torch.nn.Module):
        def forward(self, a, b):
            return a * 10 + b

    return Wrapper


def test_inputs_by_name_and_a_function_local_module_survive_save_and_load(tmp_path):
    info = [("a", [2], "float32"), ("b", [2], "float32")]
    path = tmp_path / "graph.rbln"
    rebel.compile_from_torch(_local_module_class()(), info).save(str(path))
    rt = rebel.Runtime(rebel.RBLNCompiledModel(str(path)), device=0)
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    want = [13.0, 24.0]
    assert rt(b=b, a=a).tolist() == want  # by name, in any order
    assert rt(a, b=b).tolist() == want  # by position, then by name
    with pytest.raises(ValueError, match=r"unknown inputs \['c'\].*\['a', 'b'\]"):
        rt(a=a, c=b)
    with pytest.raises(ValueError, match=r"inputs \['a'\] given twice"):
        rt(a, a=a)
    with pytest.raises(ValueError, match=r"missing inputs \['b'\]"):
        rt(a=a)
    del rt
    gc.collect()


# ---------------------------------------------------------------------------- nested outputs
def test_nested_outputs_fill_the_output_buffers_in_order_and_a_missing_one_is_an_error():
    class Nested(torch.nn.Module):
        def forward(self, x):
            return x + 1, None, (x * 2, x * 3)  # e.g. last state, no pooling, hidden states

    rt = rebel.Runtime(rebel.compile_from_torch(Nested(), [("x", [2], "float32")]), device=0)
    x = torch.tensor([1.0, 2.0])
    assert [t.tolist() for t in rt(x)] == [[2.0, 3.0], [2.0, 4.0], [3.0, 6.0]]
    out = [torch.empty(2) for _ in range(3)]
    rt(x, out=out)
    assert [t.tolist() for t in out] == [[2.0, 3.0], [2.0, 4.0], [3.0, 6.0]]
    with pytest.raises(ValueError, match="4 output buffers for a graph with 3 outputs"):
        rt(x, out=[torch.empty(2) for _ in range(4)])
    del rt
    gc.collect()


def test_a_loaded_vision_tower_still_returns_its_hidden_states(tmp_path):
    """transformers 5 returns hidden states only for model classes constructed in the
    process; a graph loaded in another process returns them as traced (optimum's LLaVA
    pre-allocates a buffer for each)."""
    from transformers import CLIPVisionConfig, CLIPVisionModel
    from transformers.utils import output_capturing

    config = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=28, patch_size=14,
    )  # fmt: skip

    class Tower(torch.nn.Module):  # optimum's _VisionEncoder, in short
        def __init__(self):
            super().__init__()
            self.enc = CLIPVisionModel(config).eval()

        def forward(self, pixels):
            return self.enc(pixels, output_hidden_states=True, return_dict=False)

    path = tmp_path / "tower.rbln"
    rebel.compile_from_torch(Tower(), [("pixels", [1, 3, 28, 28], "float32")]).save(str(path))
    for key in [k for k in output_capturing._CAN_RECORD_REGISTRY if "clip" in k.lower()]:
        del output_capturing._CAN_RECORD_REGISTRY[key]  # as in a fresh process
    rt = rebel.Runtime(rebel.RBLNCompiledModel(str(path)), device=0)
    outputs = rt(torch.rand(1, 3, 28, 28))
    assert len(outputs) == 2 + config.num_hidden_layers + 1  # last, pooled, every layer
    del rt
    gc.collect()


# ---------------------------------------------------------------------------- several input shapes
def test_a_graph_compiled_for_several_input_shapes_runs_each_and_refuses_others(tmp_path):
    """rebel compiles one graph per ``input_info`` list when given several and runs the one
    a call's shapes match (optimum-rbln's Qwen2-VL vision tower: one per max_seq_len). The
    reference is the same attention in plain torch, per length."""

    class MaskedAttention(torch.nn.Module):  # the shape of optimum's Qwen2-VL vision block
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(8, 24)

        def forward(self, x, mask):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            scores = q @ k.T + (1.0 - mask) * torch.finfo(x.dtype).min
            return torch.softmax(scores, dim=-1) @ v

    torch.manual_seed(0)
    module = MaskedAttention().eval()
    info = [[("x", [n, 8], "float32"), ("mask", [n, n], "float32")] for n in (16, 64)]
    path = tmp_path / "multi.rbln"
    cm = rebel.compile_from_torch(module, info)
    shapes = [[shape for _, shape, _ in variant] for variant in cm.input_variants]
    assert shapes == [[[16, 8], [16, 16]], [[64, 8], [64, 64]]]
    cm.save(str(path))
    rt = rebel.Runtime(rebel.RBLNCompiledModel(str(path)), device=0)
    for n, valid in ((16, 10), (64, 40)):
        x = torch.zeros(n, 8)
        x[:valid] = torch.randn(valid, 8)
        mask = torch.zeros(n, n)
        mask[:valid, :valid] = 1
        with torch.no_grad():
            q, k, v = module.qkv(x[:valid]).chunk(3, dim=-1)
            want = torch.softmax(q @ k.T, dim=-1) @ v
        out = torch.empty(n, 8)
        rt(x, mask, out=out)
        torch.testing.assert_close(out[:valid], want)
    with pytest.raises(ValueError, match=r"none of the 2 compiled input shapes.*'x': \[16, 8\]"):
        rt(torch.zeros(32, 8), torch.zeros(32, 32))
    swapped = [("mask", [4, 4], "float32"), ("x", [4, 8], "float32")]
    with pytest.raises(ValueError, match="same inputs in the same order"):
        rebel.compile_from_torch(module, [info[0], swapped])
    del rt
    gc.collect()
