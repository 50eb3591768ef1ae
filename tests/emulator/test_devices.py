"""Device visibility, one-process-per-device, DRAM budget and static-KV sharing."""

from __future__ import annotations

import gc
import os
import subprocess
import textwrap

import pytest
import rebel
import torch

from rbln_ray.emulator import DeviceError, list_devices
from tests.helpers import ROOT, run_python


class Accumulate(torch.nn.Module):
    """Adds its input into a static buffer and returns the buffer's sum."""

    def forward(self, x: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        kv.add_(x)
        return kv.sum().reshape(1)


def _compile(kv_shape=(4,), ctx=None):
    ctx = ctx or rebel.compile_context.CompileContext(use_weight_sharing=True)
    kv = torch.zeros(kv_shape, device="meta")
    ctx.mark_static_address(kv, "past_key_values_0")
    info = [("x", [4], "float32"), ("past_key_values_0", list(kv_shape), "float32")]
    return rebel.compile_from_torch(
        Accumulate(), info, example_inputs=[None, kv], compile_context=ctx
    ), ctx


def _child(code: str, **env: str) -> subprocess.CompletedProcess:
    _, proc = run_python(
        ["-c", textwrap.dedent(code)],
        full_env=dict(os.environ, PYTHONPATH=str(ROOT), **env),
        timeout=120,
        check=False,
    )
    return proc


def test_visible_devices_are_logical(monkeypatch):
    cm, _ = _compile()
    monkeypatch.setenv("RBLN_DEVICES", "3")
    assert rebel.device_count() == 1
    assert rebel.get_npu_name(0) == "RBLN-CA25" and rebel.get_npu_name(1) is None
    with pytest.raises(DeviceError, match=r"RBLN_DEVICES='3'.*\[3\]"):
        rebel.Runtime(cm, tensor_type="pt", device=1)
    rt = rebel.Runtime(cm, tensor_type="pt", device=0)
    assert rt.physical_devices == [3]
    del rt
    gc.collect()


def test_kv_shared_within_a_load_not_across_loads(tmp_path):
    ctx = rebel.compile_context.CompileContext(use_weight_sharing=True)
    a, _ = _compile(ctx=ctx)
    b, _ = _compile(ctx=ctx)
    ra, rb = rebel.Runtime(a, device=0), rebel.Runtime(b, device=0)
    ra(torch.ones(4))
    assert rb(torch.ones(4)).item() == 8.0  # b saw a's write: same buffer
    a.save(tmp_path / "a.rbln")
    b.save(tmp_path / "b.rbln")
    la, lb = (
        rebel.RBLNCompiledModel(tmp_path / "a.rbln"),
        rebel.RBLNCompiledModel(tmp_path / "b.rbln"),
    )
    ra2, rb2 = rebel.Runtime(la, device=0), rebel.Runtime(lb, device=0)
    out = torch.zeros(1)
    ra2(torch.ones(4), out=[out])
    assert out.item() == 4.0  # a fresh load starts from zeroed buffers
    assert rb2(torch.ones(4)).item() == 8.0
    assert rb(torch.zeros(4)).item() == 8.0  # the first load is untouched
    del ra, rb, ra2, rb2
    gc.collect()


def test_model_that_does_not_fit_fails_at_load():
    cm, _ = _compile(kv_shape=(2**32,))  # 16 GiB of float32 KV > 16 GiB - 288 MiB
    with pytest.raises(RuntimeError, match="Lack of device memory"):
        rebel.Runtime(cm, device=0)
    gc.collect()
    rt = rebel.Runtime(_compile()[0], device=0)  # the failed load left nothing charged
    del rt
    gc.collect()


def test_one_process_per_device(tmp_path):
    cm, _ = _compile()
    cm.save(tmp_path / "m.rbln")
    rt = rebel.Runtime(cm, device=2)
    rt2 = rebel.Runtime(cm, device=2)  # the same process may open several runtimes
    row = next(d for d in list_devices() if d.id == 2)
    assert row.pid == os.getpid() and row.memory_used > 0
    code = f"""
        from rbln_ray.emulator import ensure_runtime
        ensure_runtime()
        import rebel, sys
        cm = rebel.RBLNCompiledModel({str(tmp_path / "m.rbln")!r})
        rebel.Runtime(cm, device=int(sys.argv[1]) if len(sys.argv) > 1 else 2)
        print("ok")
    """
    busy = _child(code)
    assert busy.returncode != 0
    assert f"held by process {os.getpid()}" in busy.stderr
    assert "RBLN device 2" in busy.stderr and "one process per device" in busy.stderr
    other_node = _child(code, RBLN_RAY_NODE_ID="another-node")
    assert other_node.returncode == 0, other_node.stderr
    del rt, rt2
    gc.collect()
    freed = _child(code)
    assert freed.returncode == 0, freed.stderr
    assert next(d for d in list_devices() if d.id == 2).pid is None
