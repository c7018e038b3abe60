"""Routed experts on vLLM's OpenAI routes, against a live ``kvrunner serve`` of the
embedded tiny Qwen3-MoE started with ``--enable-return-routed-experts``.

Each choice of ``/v1/completions`` and ``/v1/chat/completions`` carries
``routed_experts`` as vLLM writes it: the ``[prompt + output - 1, layers, top_k]`` int32
array as ``.npy`` bytes in base64, read back with ``np.load``. As in vLLM, such a server
gives every choice its routes unless the request says ``return_routed_experts: false``;
streamed, a choice's last chunk carries them. The routes are the Python API's for the
same seeded request (``n`` > 1 too), and transformers' router top-k on the same weights
over the same tokens; a prefix-cache hit returns the uncached request's routes.
``routed_experts_prompt_start`` leaves out the first prompt rows; vLLM's
``/inference/v1/generate`` carries them the same way. Asked on a dense
model's server, or on a MoE server started without the flag, they are a 400 naming
the field.
"""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
import torch
from serve_kit import (
    API_KEY,
    ENGINE_KWARGS,
    SETTING_FLAGS,
    ServeProcess,
    start_server,
    stream_events,
)

from kvrunner import LLM, AsyncLLM, SamplingParams
from kvrunner.models.tiny import ensure_default_model
from kvrunner.serve import ServeSettings, build_app

transformers = pytest.importorskip("transformers")

MODEL = "tiny-qwen3-moe"
MOE_KWARGS = ENGINE_KWARGS | {"model": MODEL, "enable_return_routed_experts": True}
PROMPT = [5, 17, 29, 101, 55, 66, 77]
NEW = 5
#: a seeded sampled request: the same tokens wherever it runs
SEEDED = {"max_tokens": NEW, "temperature": 0.8, "seed": 7}
BLOCK = 16  # the server's block size (the default)


def decode(encoded: str) -> np.ndarray:
    """What a vLLM client does with a choice's ``routed_experts``."""
    return np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory, serve_home) -> Iterator[ServeProcess]:
    ensure_default_model(MODEL)  # written once, before the server and the reference race
    server = start_server(tmp_path_factory.mktemp("moe_logs"), serve_home, "moe", [],
                          api_key=API_KEY, model=MODEL,
                          engine_flags=[*SETTING_FLAGS, "--enable-return-routed-experts"])
    server.wait_ready()
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def client(moe_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=moe_server.url + "/v1", api_key=API_KEY, max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def reference(moe_server) -> Iterator[LLM]:
    """The Python API over the server's engine settings."""
    llm = LLM(**MOE_KWARGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def router_top_k(moe_server):
    """transformers' router top-k over the same weights: ``[tokens, layers, top_k]``,
    -1 where a layer is dense."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(ensure_default_model(MODEL)), dtype=torch.float32)
    config = model.config
    sparse = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]

    def routes(tokens: list[int]) -> np.ndarray:
        with torch.no_grad():
            out = model(torch.tensor([tokens]), output_router_logits=True, use_cache=False)
        full = np.full((len(tokens), config.num_hidden_layers, config.num_experts_per_tok),
                       -1, np.int32)
        for layer, logits in zip(sparse, out.router_logits, strict=True):
            probs = torch.softmax(logits.reshape(len(tokens), -1).float(), dim=-1)
            full[:, layer] = probs.topk(config.num_experts_per_tok, dim=-1).indices.numpy()
        return full

    return routes


def expect_routes(got: np.ndarray, prompt: list[int], tokens: list[int], want: np.ndarray,
                  router_top_k) -> None:
    """``got`` is the Python API's ``want`` and transformers' choice over every token the
    model computed (the prompt, and the output but its last token)."""
    assert got.dtype == np.int32
    assert got.shape == (len(prompt) + len(tokens) - 1, *want.shape[1:])
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, router_top_k([*prompt, *tokens][:-1]))


def test_completions_choices_carry_the_python_apis_routes(client, reference,
                                                          router_top_k) -> None:
    want = reference.generate([PROMPT], SamplingParams(
        **SEEDED, n=2, ignore_eos=True, return_routed_experts=True))
    answer = client.completions.create(model=MODEL, prompt=PROMPT, n=2, **SEEDED,
                                       extra_body={"ignore_eos": True,
                                                   "return_routed_experts": True,
                                                   "return_token_ids": True})
    assert len(answer.choices) == 2
    for choice, out in zip(answer.choices, want, strict=True):
        assert choice.token_ids == out.token_ids
        expect_routes(decode(choice.routed_experts), PROMPT, choice.token_ids,
                      out.routed_experts, router_top_k)
    assert want[0].token_ids != want[1].token_ids  # precondition: two samples apart

    # the field left out: this server gives them anyway (vLLM's rule); false: none
    default = client.completions.create(model=MODEL, prompt=PROMPT, **SEEDED,
                                        extra_body={"ignore_eos": True})
    np.testing.assert_array_equal(decode(default.choices[0].routed_experts),
                                  want[0].routed_experts)
    off = client.completions.create(model=MODEL, prompt=PROMPT, **SEEDED,
                                    extra_body={"ignore_eos": True,
                                                "return_routed_experts": False})
    assert "routed_experts" not in off.choices[0].model_dump()


def test_chat_choices_carry_the_python_apis_routes(client, reference, router_top_k) -> None:
    messages = [{"role": "user", "content": "which experts route this?"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, n=2, **SEEDED,
                                            extra_body={"ignore_eos": True,
                                                        "return_token_ids": True})
    prompt = answer.prompt_token_ids
    want = reference.generate([prompt], SamplingParams(
        **SEEDED, n=2, ignore_eos=True, return_routed_experts=True))
    for choice, out in zip(answer.choices, want, strict=True):
        assert choice.token_ids == out.token_ids
        expect_routes(decode(choice.routed_experts), prompt, choice.token_ids,
                      out.routed_experts, router_top_k)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stream_gives_each_choice_its_routes_on_its_last_chunk(moe_server, reference,
                                                                 path) -> None:
    if path == "/v1/completions":
        body = {"prompt": PROMPT}
    else:
        body = {"messages": [{"role": "user", "content": "stream the routes"}]}
    body |= {"model": MODEL, "n": 2, "ignore_eos": True, "return_routed_experts": True,
             **SEEDED}

    async def both() -> tuple[dict, list[dict]]:
        async with moe_server.async_client() as http:
            whole = (await http.post(path, json=body | {"return_token_ids": True})).json()
            return whole, await stream_events(http, path, body)

    whole, events = asyncio.run(both())
    prompt = whole.get("prompt_token_ids") or whole["choices"][0]["prompt_token_ids"]
    want = reference.generate([prompt], SamplingParams(
        **SEEDED, n=2, ignore_eos=True, return_routed_experts=True))
    chunks = [c for e in events for c in e["choices"]]
    for index, out in enumerate(want):
        mine = [c for c in chunks if c["index"] == index]
        assert [("routed_experts" in c) for c in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1]["finish_reason"] == "length"
        np.testing.assert_array_equal(decode(mine[-1]["routed_experts"]), out.routed_experts)
        np.testing.assert_array_equal(decode(whole["choices"][index]["routed_experts"]),
                                      out.routed_experts)


def test_a_prefix_cache_hit_returns_the_uncached_routes(client, router_top_k) -> None:
    prompt = [40 + (11 * i) % 300 for i in range(3 * BLOCK + 5)]

    def complete(**extra):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=3,
                                         temperature=0.0,
                                         extra_body={"ignore_eos": True,
                                                     "return_token_ids": True} | extra)

    first, hit = complete(), complete()
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert hit.usage.prompt_tokens_details.cached_tokens == 3 * BLOCK
    assert hit.choices[0].token_ids == first.choices[0].token_ids
    cold = decode(first.choices[0].routed_experts)
    np.testing.assert_array_equal(decode(hit.choices[0].routed_experts), cold)
    np.testing.assert_array_equal(cold, router_top_k([*prompt, *first.choices[0].token_ids][:-1]))
    # vLLM's routed_experts_prompt_start: the rows from that prompt token on
    tail = complete(routed_experts_prompt_start=BLOCK + 3)
    np.testing.assert_array_equal(decode(tail.choices[0].routed_experts), cold[BLOCK + 3:])


def test_the_token_route_carries_them_too(moe_server, reference) -> None:
    """``/inference/v1/generate`` (vLLM's tokens in, tokens out), whole and streamed, with
    ``routed_experts_prompt_start`` in its ``sampling_params``."""
    want = reference.generate([PROMPT], SamplingParams(
        **SEEDED, ignore_eos=True, return_routed_experts=True))[0].routed_experts
    body = {"token_ids": PROMPT, "sampling_params": SEEDED | {
        "ignore_eos": True, "routed_experts_prompt_start": 2}}

    async def both() -> tuple[dict, list[dict]]:
        async with moe_server.async_client() as http:
            whole = (await http.post("/inference/v1/generate", json=body)).json()
            return whole, await stream_events(http, "/inference/v1/generate", body)

    whole, events = asyncio.run(both())
    np.testing.assert_array_equal(decode(whole["choices"][0]["routed_experts"]), want[2:])
    last = events[-1]["choices"][0]
    assert last["finish_reason"] == "length"
    np.testing.assert_array_equal(decode(last["routed_experts"]), want[2:])


def test_bad_prompt_starts_are_400s_naming_the_field(client) -> None:
    for start in (len(PROMPT), -1, "2"):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                      extra_body={"routed_experts_prompt_start": start})
        assert refused.value.body["param"] == "routed_experts_prompt_start"


def test_a_dense_models_server_refuses_routes_by_name(server) -> None:
    """The shared servers serve the dense tiny Qwen3 (so without the flag)."""
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    asks = [
        lambda **kw: sdk.completions.create(model="tiny-qwen3", prompt=PROMPT, max_tokens=2,
                                            **kw),
        lambda **kw: sdk.chat.completions.create(
            model="tiny-qwen3", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            **kw),
    ]
    for ask in asks:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as refused:
                ask(stream=stream, extra_body={"return_routed_experts": True})
            assert refused.value.body["param"] == "return_routed_experts"
            assert "--enable-return-routed-experts" in refused.value.body["message"]
        plain = ask(extra_body={"return_token_ids": True})
        assert "routed_experts" not in plain.choices[0].model_dump()


def test_a_moe_engine_started_without_the_flag_refuses_routes(serve_home) -> None:
    async def run() -> None:
        engine = AsyncLLM(**(MOE_KWARGS | {"enable_return_routed_experts": False}))
        try:
            transport = httpx.ASGITransport(app=build_app(engine, ServeSettings()))
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
                for path, body in (("/v1/completions", {"prompt": PROMPT}),
                                   ("/v1/chat/completions",
                                    {"messages": [{"role": "user", "content": "hi"}]})):
                    asked = body | {"model": MODEL, "max_tokens": 2}
                    refused = await http.post(path, json=asked | {"return_routed_experts": True})
                    assert refused.status_code == 400, refused.text
                    assert refused.json()["error"]["param"] == "return_routed_experts"
                    plain = (await http.post(path, json=asked)).json()
                    assert "routed_experts" not in plain["choices"][0]
        finally:
            await engine.shutdown()

    asyncio.run(run())
