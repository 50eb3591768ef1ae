"""Serve config validation and the prefix-affinity ranking (no cluster needed)."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from rbln_ray.serve.config import load_config
from rbln_ray.serve.routing import prompt_prefix, rank


def test_config_rejects_bad_documents(tmp_path) -> None:
    good = {"models": [{"name": "m", "model": str(tmp_path)}]}
    assert load_config(good).models[0].num_replicas == 1
    bad = [
        {"models": []},
        {"models": [{"name": "m", "model": str(tmp_path / "missing")}]},
        {"models": [{"name": "m", "model": str(tmp_path), "compile": {"batchsize": 4}}]},
        {
            "models": [
                {
                    "name": "m",
                    "model": str(tmp_path),
                    "num_replicas": 2,
                    "autoscaling_config": {"max_replicas": 2},
                }
            ]
        },
        {"models": [{"name": "m", "model": str(tmp_path)}] * 2},
        {"models": [{"name": "m", "model": str(tmp_path)}], "port": 70000},
        {"models": [{"name": "m", "model": str(tmp_path)}], "unknown": 1},
    ]
    for doc in bad:
        with pytest.raises((ValidationError, ValueError)):
            load_config(doc)


def test_prefix_affinity_ranking_is_stable_and_spreads() -> None:
    replicas = ["r1", "r2", "r3", "r4"]
    assert rank("system: you are helpful", replicas) == rank("system: you are helpful", replicas)
    firsts = {rank(f"prompt {i}", replicas)[0] for i in range(64)}
    assert firsts == set(replicas), "distinct prefixes should spread over all replicas"
    # Removing a replica moves only the prefixes it owned.
    for i in range(64):
        ranked = rank(f"prompt {i}", replicas)
        if ranked[0] != "r4":
            assert rank(f"prompt {i}", replicas[:3])[0] == ranked[0]


def test_prompt_prefix_reads_completion_and_chat_requests() -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    long = "x" * 1000
    assert prompt_prefix(CompletionRequest(model="m", prompt=long)) == long[:256]
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    assert prompt_prefix(chat) == "hi"


def test_ingress_outlasts_a_generation_when_replaced(tmp_path) -> None:
    """A redeploy replaces the ingress; Serve kills it after ``graceful_shutdown_timeout_s``
    and every request it still relays gets a 500, so the default must exceed Serve's 20 s."""
    from ray import serve

    from rbln_ray.serve.builder import ingress_options

    model = [{"name": "m", "model": str(tmp_path)}]
    options = ingress_options(load_config({"models": model}).ingress)
    default = serve.deployment(lambda: None).options(**options)  # Serve accepts every option
    assert default._deployment_config.graceful_shutdown_timeout_s == 600
    custom = load_config({"models": model, "ingress": {"graceful_shutdown_timeout_s": 90}})
    assert ingress_options(custom.ingress)["graceful_shutdown_timeout_s"] == 90
    with pytest.raises(ValidationError):
        load_config({"models": model, "ingress": {"graceful_shutdown_timeout_s": 0}})


def test_ingress_and_models_take_a_count_or_serves_autoscaling() -> None:
    """The ingress autoscales as a model does (Serve's own ``autoscaling_config``); a count
    and a config together, a key Serve does not know (Serve would ignore it) or values Serve
    refuses fail at load, naming the deployment."""
    from rbln_ray.serve.builder import ingress_options

    model = [{"name": "demo", "model": "demo"}]
    auto = {"min_replicas": 1, "max_replicas": 8, "target_ongoing_requests": 512}
    options = ingress_options(
        load_config({"models": model, "ingress": {"autoscaling_config": auto}}).ingress
    )
    assert options["autoscaling_config"] == auto and "num_replicas" not in options
    assert ingress_options(load_config({"models": model}).ingress)["num_replicas"] == 1
    wrong = {
        "ingress: set either": {"ingress": {"num_replicas": 2, "autoscaling_config": auto}},
        "ingress: autoscaling_config has no max_replica ": {
            "ingress": {"autoscaling_config": {"max_replica": 2}}
        },
        "ingress: autoscaling_config: ": {
            "ingress": {"autoscaling_config": {"min_replicas": 3, "max_replicas": 2}}
        },
        "model demo: autoscaling_config has no max_replica ": {
            "models": [{**model[0], "autoscaling_config": {"max_replica": 2}}]
        },
    }
    for message, doc in wrong.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            load_config({"models": model, **doc})


def test_calls_about_a_stored_response_are_pinned_to_its_replica() -> None:
    """Both routers send a call naming a replica there (and anywhere when it is gone, where
    vLLM answers 404); the prefix router otherwise ranks by the call's prefix."""
    import asyncio
    from types import SimpleNamespace

    from rbln_ray.serve.http_call import HTTPCall
    from rbln_ray.serve.routing import PrefixAffinityRouter, ResponseAffinityRouter

    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=u)) for u in "abc"]

    def pending(call: HTTPCall):
        return SimpleNamespace(args=[call])

    for cls in (PrefixAffinityRouter, ResponseAffinityRouter):
        router = object.__new__(cls)  # choose_replicas reads no router state when pinned
        chosen = asyncio.run(
            router.choose_replicas(replicas, pending(HTTPCall("GET", "/", replica="b")))
        )
        assert chosen == [[replicas[1]]]
        gone = asyncio.run(
            router.choose_replicas(replicas, pending(HTTPCall("GET", "/", replica="z")))
        )
        assert gone == [replicas]
    ranked = asyncio.run(object.__new__(PrefixAffinityRouter).choose_replicas(
        replicas, pending(HTTPCall("POST", "/", prefix="system prompt"))))  # fmt: skip
    assert [r[0].replica_id.unique_id for r in ranked] == rank("system prompt", ["a", "b", "c"])


def test_lora_adapters_become_served_models_of_their_base(tmp_path, monkeypatch) -> None:
    """A deployment serves the adapters compiled into its artifact (their copies inside it) or
    given in compile.lora_modules: its replicas start vLLM as --enable-lora --lora-modules
    would, the ingress routes each adapter's name to the base's deployment, and a name served
    twice is refused."""
    from rbln_ray.serve.config import ModelDeploymentConfig
    from rbln_ray.serve.lora_models import adapter_bases, lora_engine_args, served_adapters
    from rbln_ray.serve.vllm_args import serve_namespace
    from rbln_ray.vllm_plugin import lora
    from tests.unit.engine_harness import write_artifact

    adapters = [
        {"lora_int_id": i, "lora_name": n, "lora_path": f"/x/{n}", "r": 4}
        for i, n in ((1, "a"), (2, "b"))
    ]
    art = write_artifact(tmp_path, lora_config={"adapters": adapters, "max_lora_rank": 4})
    base = ModelDeploymentConfig(name="base", model=str(art))
    own = {n: str(art.resolve() / "lora_adapters" / n) for n in ("a", "b")}
    assert served_adapters(base, str(art)) == own
    args = lora_engine_args(base, str(art))
    assert args["enable_lora"] is True
    assert args["lora_modules"] == [
        {"name": n, "path": own[n], "base_model_name": "base"} for n in ("a", "b")
    ]
    # as vllm serve parses --lora-modules (the RBLN platform records them for the engine's
    # compile: this process's later engines must not inherit them)
    monkeypatch.setattr(lora, "_CLI_MODULES", {})
    parsed = serve_namespace(str(art), "base", args)
    assert parsed.enable_lora
    assert [(m.name, m.path, m.base_model_name) for m in parsed.lora_modules] == [
        ("a", own["a"], "base"),
        ("b", own["b"], "base"),
    ]
    off = base.model_copy(update={"engine_kwargs": {"enable_lora": False}})
    assert lora_engine_args(off, str(art)) == {}
    plain = write_artifact(tmp_path / "plain")
    other = ModelDeploymentConfig(name="other", model=str(plain))
    assert lora_engine_args(other, str(plain)) == {}
    assert adapter_bases([base, other]) == {"a": "base", "b": "base"}
    clash = ModelDeploymentConfig(name="a", model=str(plain))
    with pytest.raises(ValueError, match="'a' of model 'base' has the name of another"):
        adapter_bases([base, clash])


def test_replicas_fill_the_compiled_batch(tmp_path) -> None:
    """vLLM's server default is 128 sequences on a CPU-derived platform (RBLN's), which would
    leave half of a 256-row artifact idle and queue the requests that should fill it: a
    replica's engine gets the compiled sequences unless the model's config says otherwise."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    from rbln_ray.serve.builder import engine_config
    from rbln_ray.serve.config import ModelDeploymentConfig
    from rbln_ray.serve.server import engine_namespace
    from tests.unit.engine_harness import write_artifact

    art = write_artifact(
        tmp_path, batch_size=256, kvcache_num_blocks=256, decoder_batch_sizes=[256, 1]
    )

    def engine_rows(cfg: ModelDeploymentConfig) -> int:
        args = engine_namespace(cfg, str(art))
        args.skip_tokenizer_init = True  # the artifact has shapes only
        engine = AsyncEngineArgs.from_cli_args(args)
        config = engine.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        return config.scheduler_config.max_num_seqs

    cfg = ModelDeploymentConfig(name="m", model=str(art))
    assert engine_rows(cfg) == 128  # vLLM's own default, what replicas ran with before
    assert engine_rows(engine_config(cfg)) == 256
    own = cfg.model_copy(update={"engine_kwargs": {"max_num_seqs": 64}})
    assert engine_rows(engine_config(own)) == 64


def test_replica_health_and_shutdown_timeouts_are_the_models_config(tmp_path) -> None:
    """A model's replicas get the health-check period and timeout and the graceful shutdown
    its config sets (defaults 5 s, 30 s, 30 s), as Serve options; a zero is refused."""
    from rbln_ray.serve.builder import build_server

    def deployment_config(**fields):
        cfg = load_config({"models": [{"name": "m", "model": str(tmp_path), **fields}]})
        return build_server(cfg.models[0])._bound_deployment._deployment_config

    default = deployment_config()
    assert (
        default.health_check_period_s,
        default.health_check_timeout_s,
        default.graceful_shutdown_timeout_s,
    ) == (5, 30, 30)
    custom = deployment_config(
        health_check_period_s=2, health_check_timeout_s=120, graceful_shutdown_timeout_s=300
    )
    assert (
        custom.health_check_period_s,
        custom.health_check_timeout_s,
        custom.graceful_shutdown_timeout_s,
    ) == (2, 120, 300)
    zero = {"name": "m", "model": str(tmp_path), "health_check_timeout_s": 0}
    with pytest.raises(ValidationError):
        load_config({"models": [zero]})


def test_the_demo_model_resolves_in_one_place_with_one_recipe(monkeypatch, tmp_path) -> None:
    """``"demo"`` is the trained demo model compiled with its recipe under what the config
    sets; every other model is its own directory and settings. The Serve builder sizes a
    replica that compiles the demo at start by the same recipe."""
    from rbln_ray.compile.settings import CompileSettings
    from rbln_ray.models import demo
    from rbln_ray.serve.builder import compiled_batch_size, compiled_max_seq_len

    monkeypatch.setattr(demo, "demo_model_dir", lambda: tmp_path / "trained")
    path, settings = demo.resolve_model("demo", CompileSettings(max_seq_len=512))
    assert path == str(tmp_path / "trained")
    assert settings == CompileSettings(**{**demo.DEMO_COMPILE, "max_seq_len": 512})
    assert demo.resolve_model("demo")[1] == CompileSettings(**demo.DEMO_COMPILE)
    own = CompileSettings(batch_size=8)
    assert demo.resolve_model(str(tmp_path), own) == (str(tmp_path), own)
    cfg = load_config({"models": [{"name": "d", "model": "demo", "compile": {"batch_size": 2}}]})
    assert compiled_batch_size(cfg.models[0]) == 2
    assert compiled_max_seq_len(cfg.models[0]) == demo.DEMO_COMPILE["max_seq_len"]


def test_a_disaggregated_model_is_two_pools_of_the_host_tier(tmp_path) -> None:
    """``pd`` gives a model a prefill pool (``kv_producer``) and a decode pool
    (``kv_consumer``), both on the host tier's connector with the model's own tier settings;
    settings that cannot work fail at load, saying why."""
    from rbln_ray.serve.disaggregation import pools, prefill_body

    tier = {"kv_connector": "RBLNHostKVConnector", "kv_connector_extra_config": {"host_gib": 2}}
    model = {"name": "demo", "model": "demo", "pd": {"prefill_replicas": 2, "decode_replicas": 3}}
    (cfg,) = load_config({"models": [model]}).models
    prefill, decode = pools(cfg)
    assert (prefill.num_replicas, decode.num_replicas) == (2, 3)
    assert prefill.pd is None and decode.pd is None
    roles = [p.vllm_kwargs()["kv_transfer_config"] for p in (prefill, decode)]
    assert roles == [{"kv_connector": "RBLNHostKVConnector", "kv_role": role}
                     for role in ("kv_producer", "kv_consumer")]  # fmt: skip
    (sized,) = load_config(
        {"models": [{**model, "engine_kwargs": {"kv_transfer_config": tier}}]}
    ).models
    assert pools(sized)[1].vllm_kwargs()["kv_transfer_config"] == {**tier, "kv_role": "kv_consumer"}
    wrong = {
        "pd sets its replica counts": {"num_replicas": 2},
        "single-stage engines": {"pipeline_stages": 2},
        "not 'OffloadingConnector'": {
            "engine_kwargs": {"kv_transfer_config": {"kv_connector": "OffloadingConnector"}}
        },
    }
    for message, extra in wrong.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            load_config({"models": [{**model, **extra}]})
    with pytest.raises(ValueError, match="decode_replicas"):
        load_config({"models": [{**model, "pd": {"prefill_replicas": 1}}]})
    # the prefill pool's request: the prompt as sent (a chat's tools too), one token
    chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "tools": [],
            "stream": True, "n": 2, "max_completion_tokens": 50, "logprobs": True}  # fmt: skip
    assert prefill_body(chat) == {
        "model": "demo", "messages": [{"role": "user", "content": "hi"}], "tools": [],
        "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True},
    }  # fmt: skip


def test_the_decode_call_carries_the_prefills_transfer_params_never_the_clients() -> None:
    """What the ingress sends the decode pool after the prefill hop: the prefill's answer's
    ``kv_transfer_params`` (where the KV is, for a decode replica on another node) when it
    answered, the body as the client sent it otherwise, and never the client's own."""
    import asyncio
    import json as json_

    from rbln_ray.serve.disaggregation import PrefillPool, prefill_first
    from rbln_ray.serve.http_call import HTTPCall, HTTPStart

    class Stream:  # what a Serve handle's streaming call yields: HTTPStart, then chunks
        def __init__(self, items: list) -> None:
            self.items = items

        def __aiter__(self):
            return self

        async def __anext__(self):
            if not self.items:
                raise StopAsyncIteration
            item = self.items.pop(0)
            if isinstance(item, Exception):
                raise item
            return item

        def cancel(self) -> None:
            self.items = []

    class Handle:
        def __init__(self, items: list) -> None:
            self.items, self.http = items, self

        def options(self, stream: bool):
            return self

        def remote(self, call: HTTPCall) -> Stream:
            assert json_.loads(call.body)["max_tokens"] == 1  # the prefill's own call
            return Stream(list(self.items))

    params = {"do_remote_prefill": True, "node_id": "ab" * 28, "block_hashes": ["00" * 32]}
    answer = json_.dumps({"choices": [{"text": "x"}], "kv_transfer_params": params}).encode()
    client = {"model": "m", "prompt": "p", "max_tokens": 8}

    def decode_body(items: list, body: dict) -> dict:
        call = HTTPCall("POST", "/v1/completions", b"", (), json_.dumps(body).encode())
        out = asyncio.run(prefill_first(PrefillPool(Handle(items), 5.0), call, body, "m"))
        return json_.loads(out.body)

    ok = [HTTPStart(200, (), answer[:20], True), answer[20:]]
    assert decode_body(ok, client) == {**client, "kv_transfer_params": params}
    forged = {**client, "kv_transfer_params": {"do_remote_prefill": True, "node_id": "cd" * 28}}
    assert decode_body(ok, forged) == {**client, "kv_transfer_params": params}
    for failed in ([HTTPStart(503, (), b"{}", False)], [RuntimeError("replica died")]):
        assert decode_body(failed, client) == client
        assert decode_body(failed, forged) == client


def test_a_handover_is_fetched_only_for_another_nodes_well_formed_export() -> None:
    from rbln_ray.serve.disaggregation import transfer_params
    from rbln_ray.serve.kv_handover import MAX_BLOCKS, remote_source

    here, there = "a1" * 28, "b2" * 28
    good = {"do_remote_prefill": True, "node_id": there, "block_hashes": ["0f" * 32] * 3}
    assert remote_source(good, here) == (there, ["0f" * 32] * 3)
    assert remote_source({**good, "node_id": here}, here) is None  # the tier is shared
    for bad in ({**good, "do_remote_prefill": "yes"}, {**good, "node_id": "../../etc"},
                {**good, "block_hashes": []}, {**good, "block_hashes": ["zz"]},
                {**good, "block_hashes": ["00"] * (MAX_BLOCKS + 1)}, None, ["x"]):  # fmt: skip
        assert remote_source(bad, here) is None, bad
    assert transfer_params(b'{"kv_transfer_params": {"a": 1}}') == {"a": 1}
    assert transfer_params(b"not json") is None and transfer_params(b"[1]") is None


def test_a_replica_may_drive_its_devices_itself(tmp_path, monkeypatch) -> None:
    """``distributed_executor_backend: uni`` (``vllm serve``'s option, in ``engine_kwargs``):
    the replica's placement group is one bundle with its devices, the replica actor holds them
    (so Ray sets ``RBLN_DEVICES`` for it), and its engine runs vLLM's in-process worker; the
    default stays the RBLN Ray executor. What cannot run so is refused by name."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    from rbln_ray.serve import builder
    from rbln_ray.serve.server import engine_namespace
    from tests.unit.engine_harness import write_artifact

    art = str(write_artifact(tmp_path))

    def model(**fields):
        return load_config({"models": [{"name": "m", "model": art, **fields}]}).models[0]

    def backend(cfg) -> object:
        args = engine_namespace(cfg, art)
        args.skip_tokenizer_init = True  # the artifact has shapes only
        engine = AsyncEngineArgs.from_cli_args(args)
        config = engine.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        return config.parallel_config.distributed_executor_backend

    def actor_options(cfg) -> dict:
        return builder.build_server(cfg)._bound_deployment._replica_config.ray_actor_options

    default = model()
    assert builder.server_bundles(default) == [{"CPU": 1}, {"RBLN": 1, "CPU": 1}]
    assert not actor_options(default).get("resources")
    assert "RBLNRayExecutor" in str(backend(default))

    for name in ("uni", "mp"):
        own = model(engine_kwargs={"distributed_executor_backend": name})
        assert own.in_process_worker
        assert builder.server_bundles(own) == [{"CPU": 1, "RBLN": 1}]
        assert actor_options(own)["resources"] == {"RBLN": 1}
        assert backend(own) == "uni"
    assert not model(engine_kwargs={"distributed_executor_backend": "ray"}).in_process_worker

    with pytest.raises(ValidationError, match="'external_launcher' is not served"):
        model(engine_kwargs={"distributed_executor_backend": "external_launcher"})
    with pytest.raises(ValidationError, match="pipeline stages and prefill/decode pools"):
        model(engine_kwargs={"distributed_executor_backend": "uni"}, pipeline_stages=2)
    monkeypatch.setattr(builder, "worker_layout", lambda cfg: (2, 1))  # a staged artifact
    with pytest.raises(ValueError, match="has 2 pipeline stages"):
        builder.server_bundles(model(engine_kwargs={"distributed_executor_backend": "uni"}))


def test_direct_routing_makes_the_model_replicas_the_ingress(tmp_path) -> None:
    """``routing: direct``: one deployment, the model's, as the app's ingress, with the
    model's replica options and the ingress's settings; what needs a separate ingress is
    refused at load, saying why."""
    from rbln_ray.serve import builder
    from rbln_ray.serve.direct import DirectServer
    from tests.unit.engine_harness import write_artifact

    art = str(write_artifact(tmp_path))
    model = {"name": "m", "model": art, "num_replicas": 2, "max_queued_requests": 7}
    config = load_config({"routing": "direct", "api_key": "k", "models": [model]})
    app = builder.build_app(config)
    deployment = app._bound_deployment
    assert deployment.name == "LLMServer:m"
    assert issubclass(deployment.func_or_class, DirectServer)
    assert deployment.num_replicas == 2
    assert deployment._deployment_config.max_queued_requests == 7
    assert deployment._deployment_config.backpressure_config.status_code == 429
    assert deployment._replica_config.placement_group_bundles == [
        {"CPU": 1},
        {"RBLN": 1, "CPU": 1},
    ]
    (cfg,) = deployment.init_args
    assert cfg["name"] == "m"
    assert deployment.init_kwargs == {
        "api_key": "k",
        "limits": config.limits.model_dump(),
        "max_model_lens": {"m": builder.compiled_max_seq_len(config.models[0])},
        "media_models": {},
        "cors_allowed_origins": [],
        "lora_bases": {},
    }

    wrong = {
        "serves one model per app": {"models": [model, {**model, "name": "n"}]},
        "whose prefill hop is the ingress's": {
            "models": [
                {"name": "m", "model": art, "pd": {"prefill_replicas": 1, "decode_replicas": 1}}
            ]
        },
        "use num_replicas: 1 or another routing": {"models": [{**model, "responses_store": True}]},
        "drop ingress:": {"models": [model], "ingress": {"num_replicas": 2}},
    }
    for message, doc in wrong.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            load_config({"routing": "direct", **doc})
    one = {**model, "num_replicas": 1, "responses_store": True}
    assert load_config({"routing": "direct", "models": [one]}).models[0].responses_store


def test_the_local_server_answers_as_a_serve_handle_does() -> None:
    """The ingress calls this replica's own server through the handle API it uses for a
    remote one: the answer item by item, ``cancel`` closing it (the server then tells vLLM's
    app the client went away), and the model list."""
    import asyncio

    from rbln_ray.serve.direct import LocalServer
    from rbln_ray.serve.http_call import HTTPCall, HTTPStart

    async def scenario() -> None:
        closed = asyncio.Event()

        class Server:  # the two LLMServer methods the ingress reaches through a handle
            async def http(self, call: HTTPCall):
                try:
                    yield HTTPStart(200, (), b"first " + call.body, True)
                    yield b"second"
                    await asyncio.Event().wait()  # a stream the client leaves
                finally:
                    closed.set()

            async def models(self) -> dict:
                return {"data": [{"id": "m"}]}

        local = LocalServer(Server())  # type: ignore[arg-type]
        assert local.options(stream=True) is local
        assert await local.models.remote() == {"data": [{"id": "m"}]}
        call = HTTPCall("POST", "/v1/completions", body=b"x")
        stream = local.options(stream=True).http.remote(call)
        first = await stream.__anext__()
        assert (first.status, first.body) == (200, b"first x")
        assert await stream.__anext__() == b"second"
        assert not closed.is_set()
        stream.cancel()
        await asyncio.wait_for(closed.wait(), 5)

    asyncio.run(scenario())
