"""The speech runner's decoder calls (no engine, no device): how a step's requests share the
compiled decoder's rows."""

from __future__ import annotations

from types import SimpleNamespace

import torch

ROWS, VOCAB = 4, 7


class RecordingDecoder:
    """Stands in for optimum's Whisper decoder: records each call, answers logits that name
    the row and the position (so a test can tell whose logits came back)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, list[int]]] = []

    def __call__(self, decoder_input_ids, cache_position, block_tables, **_):
        self.calls.append(
            {
                "ids": decoder_input_ids.view(-1).tolist(),
                "pos": cache_position.view(-1).tolist(),
                "blocks": block_tables.view(-1).tolist(),
            }
        )
        logits = torch.zeros(ROWS, 1, VOCAB)
        for row in range(ROWS):
            logits[row, 0, 0] = 100 * row + cache_position[row, 0]
        return SimpleNamespace(logits=logits)


def runner():
    # imported here, not at collection: the runner module imports vLLM's model runner, which
    # resolves vLLM's platform, and the session's RBLN_RAY_DEVICE is set after collection
    from rbln_ray.vllm_plugin.speech_runner import RBLNSpeechRunner, SpeechStepStats

    r = RBLNSpeechRunner.__new__(RBLNSpeechRunner)
    r.artifact = SimpleNamespace(
        batch_size=ROWS, scratch_block=ROWS, use_attention_mask=False, max_seq_len=448
    )
    r.rbln_model = SimpleNamespace(decoder=RecordingDecoder())
    r.dtype = torch.float32
    r.stats = SpeechStepStats()
    return r


def test_a_step_feeds_prompts_one_token_per_call_beside_decoding_rows() -> None:
    """Two new requests (prompts of 4 and 3 tokens) in rows 2 and 0 and a decoding one in
    row 3: 4 calls; call j carries each prompt's j-th token at position j; the decoding row
    joins call 0 only; every row no request uses writes the scratch block; each request gets
    the logits of its own row after its last token."""
    r = runner()
    rows = {"a": 2, "b": 0, "c": 3}
    feeds = {"a": (0, [10, 11, 12, 13]), "b": (0, [20, 21, 22]), "c": (9, [30])}
    last = r._decode(rows, feeds)
    calls = r.rbln_model.decoder.calls
    assert len(calls) == 4
    assert calls[0] == {"ids": [20, 0, 10, 30], "pos": [0, 0, 0, 9], "blocks": [0, 4, 2, 3]}
    assert calls[2] == {"ids": [22, 0, 12, 0], "pos": [2, 0, 2, 0], "blocks": [0, 4, 2, 4]}
    assert calls[3] == {"ids": [0, 0, 13, 0], "pos": [0, 0, 3, 0], "blocks": [4, 4, 2, 4]}
    assert {k: int(v[0]) for k, v in last.items()} == {"a": 203, "b": 2, "c": 309}
    assert r.stats.decode_steps == 4 and r.stats.shared_calls == 3
    assert r.stats.decode_rows == 8 and r.stats.padded_rows == 8
