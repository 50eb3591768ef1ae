"""The Serve app through the real `openai` client and raw HTTP (issue: Serve app)."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest

from tests.helpers import hf_greedy, hf_greedy_merged, run_python
from tests.serve.conftest import API_KEY, LORA_ADAPTERS, MANY_MODEL_APP_TIMEOUT_S, RunningApp
from tests.vision import image_chat

pytestmark = [pytest.mark.slow, pytest.mark.timeout(MANY_MODEL_APP_TIMEOUT_S)]

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def reference_text(app: RunningApp, prompt_ids: list[int], n: int) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(app.model_dir)
    # vLLM holds back a trailing incomplete UTF-8 sequence.
    return tok.decode(hf_greedy(app.model_dir, [prompt_ids], n)[0]).rstrip("\ufffd")


def test_openai_client_greedy_matches_transformers(demo_app: RunningApp) -> None:
    import openai
    from transformers import AutoTokenizer

    client = openai.OpenAI(base_url=f"{demo_app.url}/v1", api_key=API_KEY, max_retries=0)
    tok = AutoTokenizer.from_pretrained(demo_app.model_dir)
    prompt = "def main(argv):\n"
    expected = reference_text(demo_app, tok(prompt)["input_ids"], 24)
    kw = {"model": "demo", "max_tokens": 24, "temperature": 0}

    assert client.completions.create(prompt=prompt, **kw).choices[0].text == expected
    chunks = client.completions.create(prompt=prompt, stream=True, **kw)
    assert "".join(c.choices[0].text for c in chunks) == expected

    messages = [{"role": "user", "content": "write a loop"}]
    chat_prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    chat_expected = reference_text(
        demo_app, tok(chat_prompt, add_special_tokens=False)["input_ids"], 24
    )
    chat = client.chat.completions.create(messages=messages, **kw)
    assert chat.choices[0].message.content == chat_expected
    streamed = client.chat.completions.create(messages=messages, stream=True, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat_expected

    models = sorted(m.id for m in client.models.list().data)
    assert models == ["demo", "embed", "qwen", "qwen-a", "qwen-b", "qwen-vl", "spec", "vision"]


def test_requests_are_routed_by_model_field(demo_app: RunningApp) -> None:
    from rbln_ray.models import build_tiny_model

    qwen_dir = build_tiny_model(family="qwen2")
    prompt = [100, 200, 300, 400]
    body = {"model": "qwen", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{demo_app.url}/v1/completions", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen_dir)
    expected = tok.decode(hf_greedy(qwen_dir, [prompt], 8)[0]).rstrip("\ufffd")
    assert r.json()["model"] == "qwen"
    assert r.json()["choices"][0]["text"] == expected


def test_lora_adapters_are_models_chosen_per_request_by_name(demo_app: RunningApp) -> None:
    """Issue 33, acceptance 1 through Serve: the Qwen2's two compiled-in adapters are models
    of /v1/models (parent: the base); concurrent requests for the base and both adapters (one
    engine, batched together) each equal transformers with that adapter merged into the
    weights; an adapter that is not served is a 404 naming it."""
    import openai
    from transformers import AutoTokenizer

    from rbln_ray.models import build_tiny_model
    from rbln_ray.models.adapters import build_tiny_adapter

    client = openai.OpenAI(base_url=f"{demo_app.url}/v1", api_key=API_KEY, max_retries=0)
    cards = {m.id: m for m in client.models.list().data}
    assert all(cards[name].parent == "qwen" for name in LORA_ADAPTERS)
    qwen_dir = build_tiny_model(family="qwen2")
    tok = AutoTokenizer.from_pretrained(qwen_dir)
    adapters = {"qwen": None} | {
        name: build_tiny_adapter(qwen_dir, **kw) for name, kw in LORA_ADAPTERS.items()
    }
    prompts = [[100, 200, 300, 400], [7, 8, 9, 10, 11, 12, 13]]
    cases = [(model, prompt) for prompt in prompts for model in adapters]

    def complete(case):
        model, prompt = case
        return client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)

    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(complete, cases))
    texts = {}
    for (model, prompt), answer in zip(cases, answers, strict=True):
        expected = hf_greedy_merged(qwen_dir, adapters[model], [prompt], 8)[0]
        assert answer.model == model
        assert answer.choices[0].text == tok.decode(expected).rstrip("\ufffd"), model
        texts.setdefault(tuple(prompt), set()).add(answer.choices[0].text)
    assert all(len(seen) == len(adapters) for seen in texts.values())  # adapters matter
    with pytest.raises(openai.NotFoundError, match="qwen-zzz"):
        client.completions.create(model="qwen-zzz", prompt="x", max_tokens=2)


def test_32_concurrent_requests_use_both_replicas_on_distinct_devices(
    demo_app: RunningApp,
) -> None:
    from ray import serve

    def one(i: int) -> int:
        body = {"model": "demo", "prompt": f"class C{i}:\n", "max_tokens": 16, "temperature": 0}
        r = httpx.post(f"{demo_app.url}/v1/completions", json=body, headers=AUTH, timeout=300)
        return r.status_code

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        codes = list(pool.map(one, range(32)))
    assert codes == [200] * 32

    # Ask the server deployment for per-replica engine stats until both replicas answered
    # (Serve routes each call to one replica; 60 calls miss one with probability 2^-60).
    handle = serve.get_deployment_handle("LLMServer:demo", "rbln-ray")
    replicas: dict[int, dict] = {}
    for _ in range(60):
        stats = handle.engine_stats.remote().result()
        replicas[stats["pid"]] = stats
        if len(replicas) == 2:
            break
    assert len(replicas) == 2
    served = [sum(s["prefill_requests"] for s in r["steps"]) for r in replicas.values()]
    assert all(n > 0 for n in served) and sum(served) >= 32, served
    devices = [(w["node"], w["rbln_devices"]) for r in replicas.values() for w in r["workers"]]
    assert len(devices) == 2 and len(set(devices)) == 2, devices


def test_ingress_admits_more_streams_than_serves_default_cap(demo_app: RunningApp) -> None:
    """6 streams on 2 replicas x 4 slots all start before any ends.

    Serve's default ``max_ongoing_requests`` (5) on the ingress would hold the 6th request
    until one of the first five finished; the app must not cap itself below its slots.
    """
    events: list[tuple[str, int]] = []

    def stream(i: int) -> None:
        body = {
            "model": "demo",
            "prompt": f"def f{i}():\n",
            "max_tokens": 96,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        url = f"{demo_app.url}/v1/completions"
        with httpx.stream("POST", url, json=body, headers=AUTH, timeout=300) as r:
            assert r.status_code == 200
            first = True
            for line in r.iter_lines():
                if first and line.startswith("data: {"):
                    events.append(("first", i))
                    first = False
            events.append(("done", i))

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        list(pool.map(stream, range(6)))
    kinds = [kind for kind, _ in events]
    assert len(kinds) == 12 and kinds.index("done") == 6, events


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{not json", 400, "JSON"),
        (b"[1, 2]", 400, "object"),
        (json.dumps({"prompt": "x"}).encode(), 400, "model"),
        (json.dumps({"model": "demo"}).encode(), 400, "prompt"),
        (
            json.dumps({"model": "demo", "prompt": "x", "max_tokens": -5}).encode(),
            400,
            "max_tokens",
        ),
        (json.dumps({"model": "demo", "prompt": "x", "max_tokens": 10**9}).encode(), 400, ""),
        (
            json.dumps({"model": "demo", "prompt": "x", "temperature": "hot"}).encode(),
            400,
            "temperature",
        ),
        (json.dumps({"model": "demo", "prompt": "x " * 3000}).encode(), 400, "context"),
        (json.dumps({"model": "gpt-9", "prompt": "x"}).encode(), 404, "gpt-9"),
    ],
)
def test_bad_input_gets_openai_style_4xx(
    demo_app: RunningApp, body: bytes, status: int, needle: str
) -> None:
    r = httpx.post(
        f"{demo_app.url}/v1/completions",
        content=body,
        headers={**AUTH, "Content-Type": "application/json"},
        timeout=60,
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["message"] and error["type"]
    assert needle.lower() in error["message"].lower(), error["message"]
    ok = httpx.post(
        f"{demo_app.url}/v1/completions",
        json={"model": "demo", "prompt": "x", "max_tokens": 2},
        headers=AUTH,
        timeout=120,
    )
    assert ok.status_code == 200


def test_api_key_is_required(demo_app: RunningApp) -> None:
    body = {"model": "demo", "prompt": "x", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(f"{demo_app.url}/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
    assert httpx.get(f"{demo_app.url}/v1/models", timeout=60).status_code == 401
    assert httpx.get(f"{demo_app.url}/health", timeout=60).status_code == 200


def test_client_handles_stream_from_another_process(demo_app: RunningApp) -> None:
    from transformers import AutoTokenizer

    script = (
        "import json, sys\n"
        "from rbln_ray.client import RBLNClient\n"
        "c = RBLNClient('demo', address=sys.argv[1])\n"
        "deltas = list(c.stream('import os\\n', max_tokens=16, temperature=0))\n"
        "full = c.complete('import os\\n', max_tokens=16, temperature=0)\n"
        "chat = c.chat([{'role': 'user', 'content': 'hi'}], max_tokens=8, temperature=0)\n"
        "ids = c.tokenize('import os\\n')\n"
        "made = c.responses('import os', max_output_tokens=4, temperature=0, store=True)\n"
        "kept = c.request('GET', '/v1/responses/' + made['id'])\n"
        "print('RESULT ' + json.dumps({'deltas': deltas, 'text': full.text,"
        " 'finish': full.finish_reason, 'chat': chat.text, 'ids': ids,"
        " 'made': made['output'], 'kept': kept['output']}))\n"
    )
    result, _ = run_python(["-c", script, demo_app.gcs_address], timeout=300)
    assert result is not None
    tok = AutoTokenizer.from_pretrained(demo_app.model_dir)
    expected = reference_text(demo_app, tok("import os\n")["input_ids"], 16)
    assert len(result["deltas"]) > 1, "tokens were not streamed"
    assert "".join(result["deltas"]) == expected == result["text"]
    assert result["finish"] == "length" and result["chat"]
    assert result["ids"] == tok("import os\n")["input_ids"]  # any route: /tokenize
    assert result["kept"] == result["made"]  # a stored response, from its replica


def test_stored_responses_are_served_by_the_replica_that_made_them(
    demo_app: RunningApp,
) -> None:
    """The Responses API's store lives in each replica's vLLM: 12 stored responses made on
    the demo model's 2 replicas are each retrieved, and continued by
    ``previous_response_id``, from the replica holding it (their ids say which; without
    that routing about half would be 404s)."""
    import openai

    from rbln_ray.serve.http_call import parse_response_id

    client = openai.OpenAI(base_url=f"{demo_app.url}/v1", api_key=API_KEY, max_retries=0)

    def create(i: int):
        return client.responses.create(
            model="demo", input=f"def f{i}(x):", max_output_tokens=8, temperature=0, store=True
        )

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        created = list(pool.map(create, range(12)))
    replicas = {parse_response_id(r.id)[1] for r in created}
    assert len(replicas) == 2, [r.id for r in created]
    for response in created:
        kept = client.responses.retrieve(response.id)
        assert kept.status == response.status and kept.output_text == response.output_text
    follow = client.responses.create(
        model="demo", input="and", previous_response_id=created[0].id, max_output_tokens=4
    )
    assert follow.output and follow.previous_response_id == created[0].id


def test_vllms_other_routes_are_served_or_refused_with_a_reason(demo_app: RunningApp) -> None:
    """Beyond completions and chat, the app answers vLLM's tokenizer, pooling, rerank and
    meta routes for the model a request names, and refuses engine control, metrics and
    runtime LoRA with a 404 that says why."""
    from transformers import AutoTokenizer
    from vllm import __version__ as vllm_version

    from rbln_ray.models import build_tiny_model
    from tests.embeddings import QUERY, TEXTS

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{demo_app.url}{path}", json=body, headers=AUTH, timeout=120)

    def get(path: str) -> httpx.Response:
        return httpx.get(f"{demo_app.url}{path}", headers=AUTH, timeout=60)

    tok = AutoTokenizer.from_pretrained(build_tiny_model(family="qwen2"))
    ids = post("/tokenize", {"model": "qwen", "prompt": "def f():"}).json()["tokens"]
    assert ids == tok("def f():")["input_ids"]
    back = post("/detokenize", {"model": "qwen", "tokens": ids}).json()["prompt"]
    assert back == "def f():"
    info = get("/tokenizer_info?model=embed")
    assert info.status_code == 200 and info.json()["tokenizer_class"], info.text
    several = get("/tokenizer_info")  # five models: which one?
    assert several.status_code == 400 and "served models" in several.json()["error"]["message"]
    assert get("/version").json() == {"version": vllm_version}
    assert get("/v1/models/embed").json()["id"] == "embed"
    assert get("/v1/models/gpt-9").status_code == 404

    pooled = post("/pooling", {"model": "embed", "input": TEXTS[:2]})
    assert pooled.status_code == 200 and len(pooled.json()["data"]) == 2, pooled.text
    reranked = post("/v2/rerank", {"model": "embed", "query": QUERY, "documents": TEXTS})
    scores = post("/v1/score", {"model": "embed", "text_1": QUERY, "text_2": TEXTS}).json()
    want = {d["index"]: d["score"] for d in scores["data"]}
    got = {d["index"]: d["relevance_score"] for d in reranked.json()["results"]}
    assert got.keys() == want.keys() and all(abs(got[i] - want[i]) < 1e-5 for i in got)
    raw = post("/v1/embeddings", {"model": "embed", "input": "x", "encoding_format": "bytes"})
    assert raw.status_code == 200 and raw.headers["content-type"] == "application/octet-stream"
    assert len(raw.content) == 128 * 4, len(raw.content)  # one float32 vector

    refusals = {
        "/sleep": "engine control",
        "/collective_rpc": "engine control",
        "/v1/load_lora_adapter": "LoRA",
        "/reset_prefix_cache": "engine control",
    }
    for path, needle in refusals.items():
        refused = post(path, {})
        assert refused.status_code == 404, refused.text
        assert needle in refused.json()["error"]["message"], refused.text
    assert get("/metrics").status_code == 404

    # Anthropic's SDK authenticates with x-api-key
    message = httpx.post(
        f"{demo_app.url}/v1/messages",
        json={"model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]},
        headers={"x-api-key": API_KEY},
        timeout=120,
    )
    assert message.status_code == 200 and message.json()["type"] == "message", message.text


def test_ray_metrics_carry_engine_and_device_series_per_replica(demo_app: RunningApp) -> None:
    """vLLM's engine metrics (RayPrometheusStatLogger) and rbln-ray's device counters reach
    Ray's metrics export, tagged per replica and per device group (issue 21). Read while 8
    streams keep both replicas stepping: Ray drops a gauge not set within two exports."""
    import concurrent.futures

    from tests.ray_metrics import samples

    body = {"model": "demo", "prompt": "x = ", "max_tokens": 400, "ignore_eos": True}

    def one(_: int) -> int:
        url = f"{demo_app.url}/v1/completions"
        return httpx.post(url, json=body, headers=AUTH, timeout=300).status_code

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        statuses = pool.map(one, range(8))
        deadline = time.monotonic() + 120
        while True:
            sizes = [s for s in samples("ray_rbln_batch_size") if s.labels["model"] == "demo"]
            replicas = {s.labels["replica"] for s in sizes}
            running = samples("ray_vllm_num_requests_running")
            engines = {s.labels["ReplicaId"] for s in running if s.labels["model_name"] == "demo"}
            if len(replicas) == 2 and engines == replicas:
                break
            assert time.monotonic() < deadline, f"replicas {replicas}, engines {engines}"
            time.sleep(0.5)  # polling Ray's export (every second in tests)
        assert list(statuses) == [200] * 8
    for sample in sizes:
        assert sample.value == 4 and sample.labels["devices"] and sample.labels["node"]
    decoded = sum(
        s.value for s in samples("ray_rbln_decode_steps_total") if s.labels["model"] == "demo"
    )
    assert decoded >= 399, decoded  # 8 x 400 tokens on 2 replicas of batch 4
    assert samples("ray_vllm_generation_tokens_total")


def test_embeddings_and_scores_beside_chat_match_vllm_cpu(demo_app: RunningApp) -> None:
    """``/v1/embeddings`` (the openai client) and ``/v1/score`` of the tiny BERT equal plain
    vLLM-CPU's on the same weights, while chat completions run on the demo model."""
    import openai

    from tests.embeddings import QUERY, TEXTS, assert_embeddings_match
    from tests.helpers import vllm_embeddings

    client = openai.OpenAI(base_url=f"{demo_app.url}/v1", api_key=API_KEY, max_retries=0)
    chat = {"model": "demo", "max_tokens": 32, "temperature": 0}
    messages = [{"role": "user", "content": "write a loop"}]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        chats = [
            pool.submit(client.chat.completions.create, messages=messages, **chat) for _ in range(4)
        ]
        embedded = pool.submit(client.embeddings.create, model="embed", input=TEXTS)
        scored = pool.submit(
            httpx.post,
            f"{demo_app.url}/v1/score",
            json={"model": "embed", "text_1": QUERY, "text_2": TEXTS},
            headers=AUTH,
            timeout=120,
        )
        replies = {c.result().choices[0].message.content for c in chats}
        response, score = embedded.result(), scored.result()
    assert len(replies) == 1 and replies.pop(), "greedy chat replies differ or are empty"
    plain = vllm_embeddings([demo_app.embed_model_dir], TEXTS, QUERY)[demo_app.embed_model_dir]
    assert response.model == "embed" and response.usage.prompt_tokens == sum(plain["prompt_lens"])
    assert_embeddings_match([d.embedding for d in response.data], plain["embeddings"])
    assert score.status_code == 200, score.text
    got = [d["score"] for d in sorted(score.json()["data"], key=lambda d: d["index"])]
    assert all(abs(a - b) < 1e-4 for a, b in zip(got, plain["scores"], strict=True)), got


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/v1/embeddings", {"model": "embed", "input": "x " * 400}, 400, "128"),
        ("/v1/embeddings", {"model": "embed", "input": []}, 400, "prompt"),
        # a route the model's vLLM app does not have: 404 as from `vllm serve` of it
        ("/v1/embeddings", {"model": "demo", "input": "x"}, 404, "does not serve"),
        ("/v1/completions", {"model": "embed", "prompt": "x", "max_tokens": 2}, 404,
         "does not serve"),
        ("/classify", {"model": "embed", "input": "x"}, 404, "its tasks: embed"),
        ("/v1/score", {"model": "embed", "text_1": "x"}, 400, "text_2"),
    ],
)  # fmt: skip
def test_bad_pooling_input_gets_openai_style_4xx(
    demo_app: RunningApp, path: str, body: dict, status: int, needle: str
) -> None:
    r = httpx.post(f"{demo_app.url}{path}", json=body, headers=AUTH, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["type"]
    assert needle.lower() in error["message"].lower(), error["message"]
    ok = httpx.post(
        f"{demo_app.url}/v1/embeddings",
        json={"model": "embed", "input": "still serving"},
        headers=AUTH,
        timeout=120,
    )
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 128


def test_chat_embeddings_and_vision_served_together(demo_app: RunningApp) -> None:
    """The mixed app: a vision-language chat with a data-URL image (and a text-only one) on
    the tiny LLaVA and on the tiny Qwen2-VL equals transformers' greedy output, while chat
    completions run on the demo model and embeddings on the BERT, all at once."""
    import openai
    from transformers import AutoTokenizer

    from tests.embeddings import TEXTS
    from tests.vision import hf_chat_prompt, hf_vlm_greedy, make_image

    client = openai.OpenAI(base_url=f"{demo_app.url}/v1", api_key=API_KEY, max_retries=0)
    greedy = {"max_tokens": 16, "temperature": 0, "extra_body": {"ignore_eos": True}}
    image = make_image(7, 90, 60)
    with_image = image_chat(image, "what is in the picture?")
    text_only = [{"role": "user", "content": "no picture this time"}]
    # Qwen2-VL: an image of its own size (resized to 84 x 140 pixels: 15 tokens)
    qwen_image = make_image(11, 150, 90)
    qwen_with_image = image_chat(qwen_image, "and here?")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        vision = [
            pool.submit(client.chat.completions.create, model="vision", messages=m, **greedy)
            for m in (with_image, text_only)
        ]
        qwen = [
            pool.submit(client.chat.completions.create, model="qwen-vl", messages=m, **greedy)
            for m in (qwen_with_image, text_only)
        ]
        chat = pool.submit(
            client.chat.completions.create,
            model="demo",
            messages=[{"role": "user", "content": "write a loop"}],
            max_tokens=16,
        )
        embedded = pool.submit(client.embeddings.create, model="embed", input=TEXTS)
        replies = [f.result().choices[0].message.content for f in vision]
        qwen_replies = [f.result().choices[0].message.content for f in qwen]
        assert chat.result().choices[0].message.content
        assert len(embedded.result().data) == len(TEXTS)
    for model_dir, got, asked in (
        (demo_app.vlm_model_dir, replies, ((with_image, [image]), (text_only, []))),
        (
            demo_app.qwen_vl_model_dir,
            qwen_replies,
            ((qwen_with_image, [qwen_image]), (text_only, [])),
        ),
    ):
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        for reply, (messages, images) in zip(got, asked, strict=True):
            prompt = hf_chat_prompt(model_dir, messages)
            _, want = hf_vlm_greedy(model_dir, prompt, images, 16)
            assert reply == tokenizer.decode(want, skip_special_tokens=True), (reply, want)
        assert got[0] != got[1]


def _png_data_url(width: int, height: int) -> str:
    from PIL import Image

    from tests.vision import data_url

    return data_url(Image.new("RGB", (width, height)))


@pytest.mark.parametrize(
    ("model", "url", "status", "needle"),
    [
        ("demo", "tiny", 400, "does not accept image inputs"),
        ("vision", "https://example.com/cat.png", 400, "data: urls"),
        ("vision", "data:image/png;base64,@@not-base64@@", 400, "base64"),
        ("vision", "data:image/png;base64,aGVsbG8gd29ybGQ=", 400, "cannot be decoded"),
        ("vision", "huge", 413, "pixels"),
    ],
)
def test_bad_image_input_gets_openai_style_4xx(
    demo_app: RunningApp, model: str, url: str, status: int, needle: str
) -> None:
    url = {"tiny": _png_data_url(8, 8), "huge": _png_data_url(5000, 4000)}.get(url, url)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "?"},
            ],
        }
    ]
    body = {"model": model, "messages": messages, "max_tokens": 2}
    r = httpx.post(f"{demo_app.url}/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["type"]
    assert needle in error["message"].lower(), error["message"]
    from tests.vision import make_image

    ok = httpx.post(
        f"{demo_app.url}/v1/chat/completions",
        json={
            "model": "vision",
            "messages": image_chat(make_image(1), "ok?"),
            "max_tokens": 2,
        },
        headers=AUTH,
        timeout=120,
    )
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 2


def test_an_image_beyond_the_compiled_vision_tower_is_a_400_naming_both_sizes(
    demo_app: RunningApp,
) -> None:
    """Qwen2-VL's processor sizes an image within its pixel budget, which a request may raise
    (``mm_processor_kwargs``): an image of more patches than the compiled vision tower takes
    (256 here) is refused with both numbers, and the replica keeps serving."""
    from tests.vision import LARGE, LARGE_BUDGET, make_image

    url = f"{demo_app.url}/v1/chat/completions"
    body = {
        "model": "qwen-vl",
        "messages": image_chat(make_image(12, *LARGE), "?"),
        "max_tokens": 2,
        "mm_processor_kwargs": LARGE_BUDGET,
    }
    r = httpx.post(url, json=body, headers=AUTH, timeout=120)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "1024 patches" in message and "256 patches" in message, message
    body.pop("mm_processor_kwargs")  # the same image at the model's own budget is served
    ok = httpx.post(url, json=body, headers=AUTH, timeout=120)
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 2


@pytest.fixture
def recording_server():
    """A local HTTP server that records every request it gets (and answers 404)."""
    import http.server
    import threading

    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            hits.append(self.path)
            self.send_error(404)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", hits
    finally:
        server.shutdown()
        server.server_close()


def test_no_content_part_makes_a_replica_fetch_a_url(demo_app: RunningApp, recording_server):
    """Typed, typeless (``{"image_url": ...}``, which vLLM's parser takes) and video parts
    naming a local URL are 400s at the ingress; and a replica reached without the ingress
    (its deployment handle) still fetches nothing: its vLLM only allows a domain that does
    not exist. The URL's server records no hit."""
    from ray import serve
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    from rbln_ray.serve.http_call import HTTPCall

    base, hits = recording_server
    parts = [
        {"type": "image_url", "image_url": {"url": f"{base}/typed.png"}},
        {"image_url": f"{base}/typeless.png"},
        {"image_url": {"url": f"{base}/typeless-dict.png"}},
        {"video_url": {"url": f"{base}/clip.mp4"}},
    ]
    for part in parts:
        body = {
            "model": "qwen-vl",
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": "?"}]}],
            "max_tokens": 2,
        }
        r = httpx.post(f"{demo_app.url}/v1/chat/completions", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 400, (part, r.text)
        assert r.json()["error"]["code"] == 400
    direct = ChatCompletionRequest.model_validate(
        {
            "model": "qwen-vl",
            "messages": [{"role": "user", "content": [parts[1], {"type": "text", "text": "?"}]}],
            "max_tokens": 2,
        }
    )
    handle = serve.get_deployment_handle("LLMServer:qwen-vl", "rbln-ray").options(stream=True)
    call = HTTPCall(
        "POST",
        "/v1/chat/completions",
        headers=((b"content-type", b"application/json"),),
        body=direct.model_dump_json(exclude_unset=True).encode(),
    )
    start, *rest = list(handle.http.remote(call))
    error = json.loads(start.body + b"".join(rest))["error"]
    assert start.status == 400 and "allowed domains" in error["message"], error
    assert hits == []


def test_completions_and_streams_equal_transformers_with_ngram(demo_app: RunningApp) -> None:
    """Speculative decoding behind the Serve app: a model's ``engine_kwargs`` carry vLLM's
    ``speculative_config`` (issue #34). Completions and chat, plain and streamed, through
    the ``openai`` client equal transformers' greedy text, and the replica's vLLM metrics
    (Ray's export) count accepted drafts."""
    import openai
    from transformers import AutoTokenizer

    from tests.ray_metrics import metric_sum

    tok = AutoTokenizer.from_pretrained(demo_app.model_dir)
    client = openai.OpenAI(base_url=f"{demo_app.url}/v1", api_key=API_KEY, max_retries=0)

    def expected(ids: list[int]) -> str:
        return tok.decode(hf_greedy(demo_app.model_dir, [ids], 40)[0]).rstrip("\ufffd")

    kw = {"model": "spec", "max_tokens": 40, "temperature": 0, "extra_body": {"ignore_eos": True}}
    prompt = "class Parser:\n    def parse(self, text):\n"
    want = expected(tok(prompt)["input_ids"])
    assert client.completions.create(prompt=prompt, **kw).choices[0].text == want
    chunks = client.completions.create(prompt=prompt, stream=True, **kw)
    assert "".join(c.choices[0].text for c in chunks) == want

    messages = [{"role": "user", "content": "read a file line by line"}]
    chat_prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    chat_want = expected(tok(chat_prompt, add_special_tokens=False)["input_ids"])
    streamed = client.chat.completions.create(messages=messages, stream=True, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat_want

    # The replica's engine verified drafts (its vLLM metrics, exported by Ray every second).
    name = "ray_vllm_spec_decode_num_accepted_tokens_total"
    deadline = time.monotonic() + 60
    while metric_sum(name) <= 0 and time.monotonic() < deadline:
        time.sleep(1)  # a bounded poll of Ray's metrics export, not a synchronisation
    assert metric_sum(name) > 0
    assert metric_sum("ray_vllm_spec_decode_num_draft_tokens_total") > metric_sum(name)


def test_audio_to_text_models_is_refused_at_the_ingress(demo_app: RunningApp) -> None:
    """A transcription asked of a chat model (a 404 naming its tasks: its vLLM app has no
    such route, as `vllm serve` of it), and audio in a chat message to a text model (a
    400): OpenAI-style bodies naming the problem (no speech model in this app)."""
    import base64

    from rbln_ray.models.speech import tone_clip, wav_bytes

    wav = wav_bytes(tone_clip(1.0, 440))
    r = httpx.post(
        f"{demo_app.url}/v1/audio/transcriptions",
        data={"model": "demo"},
        files={"file": ("a.wav", wav, "audio/wav")},
        headers=AUTH,
        timeout=60,
    )
    assert r.status_code == 404, r.text
    assert "does not serve POST /v1/audio/transcriptions" in r.json()["error"]["message"]
    audio = {"data": base64.b64encode(wav).decode(), "format": "wav"}
    content = [{"type": "input_audio", "input_audio": audio}, {"type": "text", "text": "?"}]
    body = {"model": "demo", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    r = httpx.post(f"{demo_app.url}/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == 400 and "does not accept audio inputs" in error["message"]


def test_health_reflects_a_dead_replica(demo_app: RunningApp) -> None:
    """Runs last in this module: it kills one of the two ``demo`` replicas.

    /health turns 503 naming that deployment (and only it), and ``demo`` keeps answering
    through the replica left. Waiting for Serve's replacement to come back up is Serve's
    behaviour, not ours, and on a loaded host took over 300 s: not waited for."""
    import ray
    from ray import serve

    handle = serve.get_deployment_handle("LLMServer:demo", "rbln-ray")
    victim = handle.engine_stats.remote().result()["actor_name"]
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)

    def health() -> httpx.Response:
        return httpx.get(f"{demo_app.url}/health", timeout=30)

    deadline = time.monotonic() + 60
    while (answer := health()).status_code == 200:
        assert time.monotonic() < deadline, "/health never reported the dead replica"
        time.sleep(0.2)  # polling interval
    assert answer.status_code == 503, answer.text
    body = answer.json()
    assert body["status"] == "degraded", body
    unhealthy = {name for name, state in body["deployments"].items() if state != "HEALTHY"}
    assert unhealthy == {"LLMServer:demo"}, body

    completion = httpx.post(
        f"{demo_app.url}/v1/completions",
        json={"model": "demo", "prompt": "def main(", "max_tokens": 4},
        headers=AUTH,
        timeout=120,
    )
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["completion_tokens"] == 4
