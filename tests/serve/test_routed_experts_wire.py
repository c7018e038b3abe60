"""Routed experts on the wire: ``AsyncLLM`` returns them on its outputs and SGLang's
``/generate`` in ``meta_info["routed_experts"]`` as SGLang encodes them (little-endian
int32 bytes in base64, flat: its clients decode them with ``np.frombuffer`` and reshape
by the model's layers and top-k), for one prompt, a batch and a stream; the values are
the in-process ``LLM``'s; ``/server_info`` says the engine records them. A request for
them on an engine that records none is a 400 naming the field."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import numpy as np
import pytest

from kvrunner import LLM, AsyncLLM, SamplingParams
from kvrunner.serve import ServeSettings, build_app

MOE = dict(model="tiny-qwen3-moe", seed=0, max_num_seqs=4, max_model_len=64,
           enable_return_routed_experts=True, capture_sizes=(1, 2, 4))
PROMPTS = [[5, 17, 29, 101, 55, 66, 77], [9, 10, 11]]
NEW = 4
GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}


def decode(meta: dict, shape: tuple[int, ...]) -> np.ndarray:
    """What SGLang's ``extract_routed_experts_from_meta_info`` does, then the reshape
    its callers (verl) apply."""
    flat = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
    return flat.reshape(-1, *shape[1:])


@pytest.fixture(scope="module")
def reference(serve_home) -> list:
    llm = LLM(**MOE)
    try:
        return llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, temperature=0.0,
                                                    ignore_eos=True, return_routed_experts=True))
    finally:
        llm.shutdown()


def _serve(engine_kwargs: dict, talk) -> None:
    async def run() -> None:
        engine = AsyncLLM(**engine_kwargs)
        try:
            transport = httpx.ASGITransport(app=build_app(engine, ServeSettings()))
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                await talk(engine, client)
        finally:
            await engine.shutdown()

    asyncio.run(run())


def test_async_llm_and_generate_return_the_in_process_routes(reference) -> None:
    want = [r.routed_experts for r in reference]
    assert all(w is not None and w.shape[0] == len(p) + NEW - 1
               for w, p in zip(want, PROMPTS, strict=True))

    async def talk(engine: AsyncLLM, client: httpx.AsyncClient) -> None:
        out = await engine.generate(PROMPTS[0], SamplingParams(
            max_tokens=NEW, temperature=0.0, ignore_eos=True, return_routed_experts=True))
        np.testing.assert_array_equal(out.routed_experts, want[0])
        info = (await client.get("/server_info")).json()
        assert info["enable_return_routed_experts"] is True  # what slime compares
        one = (await client.post("/generate", json={
            "input_ids": PROMPTS[0], "sampling_params": GREEDY,
            "return_routed_experts": True})).json()
        np.testing.assert_array_equal(decode(one["meta_info"], want[0].shape), want[0])
        batch = (await client.post("/generate", json={
            "input_ids": PROMPTS, "sampling_params": GREEDY,
            "return_routed_experts": True})).json()
        for answer, w in zip(batch, want, strict=True):
            np.testing.assert_array_equal(decode(answer["meta_info"], w.shape), w)
        plain = (await client.post("/generate", json={
            "input_ids": PROMPTS[0], "sampling_params": GREEDY})).json()
        assert "routed_experts" not in plain["meta_info"]
        async with client.stream("POST", "/generate", json={
                "input_ids": PROMPTS[1], "sampling_params": GREEDY, "stream": True,
                "return_routed_experts": True}) as stream:
            events = [json.loads(line[len("data: "):]) async for line in stream.aiter_lines()
                      if line.startswith("data: {")]
        assert "routed_experts" not in events[0]["meta_info"] or len(events) == 1
        np.testing.assert_array_equal(decode(events[-1]["meta_info"], want[1].shape), want[1])

    _serve(MOE, talk)


def test_generate_refuses_routes_from_an_engine_that_records_none(serve_home) -> None:
    async def talk(engine: AsyncLLM, client: httpx.AsyncClient) -> None:
        refused = await client.post("/generate", json={
            "input_ids": PROMPTS[0], "sampling_params": GREEDY, "return_routed_experts": True})
        assert refused.status_code == 400, refused.text
        assert "enable_return_routed_experts" in refused.json()["error"]["message"]

    _serve(MOE | {"enable_return_routed_experts": False}, talk)
