"""AsyncLLM on RBLN: aborts free compiled batch slots, bad prompts fail cleanly."""

from __future__ import annotations

import pytest

from tests.helpers import compiled_model, run_script

pytestmark = pytest.mark.slow


def test_abort_frees_slot_and_long_prompt_is_rejected() -> None:
    result = run_script("rbln_async_abort.py", str(compiled_model("llama")))
    # All 4 slots were busy; the short request could only run in the aborted one's slot,
    # and it finished while the other three were still generating.
    assert result["short_tokens"] == 10
    assert result["short_done_while_longs_running"]
    assert all(3 <= n < 400 for n in result["long_tokens"])
    error = result["too_long_error"]
    assert error is not None and "600" in error and "512" in error, error
    assert result["after_tokens"] == 10
