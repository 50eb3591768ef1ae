"""What optimum-rbln 0.12's Qwen3.5 (hybrid linear attention) needs of ``rebel``:
``torch.ops.rbln.tri_recur_update``, ``Runtime._index_to_input_name`` (the graph's used
inputs, by which its runtime orders a call's arguments), a call with only those inputs, and
static state buffers declared before other inputs (its state masks come after its states).

References are plain torch, never the emulator itself."""

from __future__ import annotations

import gc

import pytest
import rebel
import torch

ROWS, WIDTH = 3, 4


def test_tri_recur_update_is_the_inverse_the_recurrence_computes() -> None:
    """transformers' chunked gated-delta rule updates each row of a strictly lower-triangular
    ``A`` from the rows above it, as updated: the result is ``(I - A)^-1 - I``."""
    torch.manual_seed(0)
    size = 8
    a = torch.randn(2, 3, size, size, dtype=torch.float64).tril(-1) * 0.5
    eye = torch.eye(size, dtype=torch.float64)
    want = torch.linalg.inv(eye - a) - eye
    got = torch.ops.rbln.tri_recur_update(a)
    assert torch.allclose(got, want, atol=1e-10)
    assert not torch.equal(got, a)  # a new tensor; the input is left as it was
    assert torch.equal(a.tril(-1), a)


class StateStep(torch.nn.Module):
    """Declared as ``(x, state, mask, unread)``: adds ``x * mask`` to its static ``state``
    (written in place, like optimum's ``rbln_cache_update``) and returns the new state;
    ``unread`` is never read (optimum's decode graph declares masks it does not use)."""

    def forward(self, x, state, mask, unread):
        state.copy_(state + x * mask)
        return state.clone()


@pytest.fixture
def runtime():
    ctx = rebel.compile_context.CompileContext(use_weight_sharing=True)
    state = torch.zeros(ROWS, WIDTH, device="meta")
    ctx.mark_static_address(state, "recurrent_state_0")
    info = [
        ("x", [ROWS, WIDTH], "float32"),
        ("recurrent_state_0", [ROWS, WIDTH], "float32"),
        ("mask", [ROWS, WIDTH], "float32"),
        ("unread", [ROWS], "float32"),
    ]
    rt = rebel.Runtime(rebel.compile_from_torch(StateStep(), info, compile_context=ctx), device=0)
    yield rt
    del rt
    gc.collect()


def test_the_used_inputs_name_the_call_and_the_state_sits_where_declared(runtime) -> None:
    assert runtime._index_to_input_name == {0: "x", 1: "mask"}
    x = torch.arange(ROWS * WIDTH, dtype=torch.float32).view(ROWS, WIDTH)
    mask = torch.ones(ROWS, WIDTH)
    mask[1] = 0
    first = runtime(x, mask)  # only the inputs the graph reads, as optimum's runtime calls
    assert torch.equal(first, x * mask)
    second = runtime(x, mask, torch.zeros(ROWS))  # or all of them
    assert torch.equal(second, 2 * x * mask)  # the static state carried over
    assert runtime.kv_buffers == {}  # a state is no paged KV: no block copies, no transfers
    with pytest.raises(ValueError, match="expected 3 inputs"):
        runtime(x)
