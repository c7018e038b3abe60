"""``return_kept_mass`` on SGLang's ``/generate``: ``meta_info.output_token_kept_mass``
holds one kept mass per output token, the engine's own (``RequestOutput.kept_mass``),
streamed or not, one prompt or a batch; without the field the answer has none. The
engine behind the app reports processed logprobs (``logprobs_mode``, which
``/server_info`` names as vLLM's ``model_config.logprobs_mode``), and the output
logprobs are those too."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from serve_kit import ENGINE_KWARGS

from kvrunner import AsyncLLM, SamplingParams
from kvrunner.serve import ServeSettings, build_app

PROMPT = [5, 17, 29, 101, 55]
SAMPLING = {"max_new_tokens": 5, "temperature": 0.7, "top_k": 4, "top_p": 0.8,
            "sampling_seed": 11, "ignore_eos": True}  # fmt: skip


def in_process(engine: AsyncLLM):
    return engine.generate(PROMPT, SamplingParams(
        max_tokens=5, temperature=0.7, top_k=4, top_p=0.8, seed=11, ignore_eos=True,
        logprobs=0, return_kept_mass=True))  # fmt: skip


def test_generate_returns_the_engines_kept_mass_per_output_token(serve_home) -> None:
    async def run() -> None:
        engine = AsyncLLM(**ENGINE_KWARGS, logprobs_mode="processed_logprobs")
        try:
            app = build_app(engine, ServeSettings())
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                info = (await client.get("/server_info", params={"config_format": "json"})).json()
                assert info["vllm_config"]["model_config"]["logprobs_mode"] == "processed_logprobs"
                want = await in_process(engine)
                body = {"input_ids": PROMPT, "sampling_params": SAMPLING,
                        "return_logprob": True, "return_kept_mass": True}  # fmt: skip
                meta = (await client.post("/generate", json=body)).json()["meta_info"]
                assert meta["output_token_kept_mass"] == want.kept_mass
                assert [lp for lp, _, _ in meta["output_token_logprobs"]] == want.logprobs
                assert len(want.kept_mass) == 5 and all(0 < m <= 1 for m in want.kept_mass)
                assert min(want.kept_mass) < 1  # top-k / top-p truncated something

                streamed = await client.post("/generate", json=body | {"stream": True})
                events = [json.loads(line[len("data: "):]) for line in streamed.text.split("\n")
                          if line.startswith("data: {")]  # fmt: skip
                assert events[-1]["meta_info"]["output_token_kept_mass"] == want.kept_mass

                # side by side in one step: the same tokens, the logits to float rounding
                batch = body | {"input_ids": [PROMPT, PROMPT]}
                answers = (await client.post("/generate", json=batch)).json()
                for answer in answers:
                    assert answer["output_ids"] == want.token_ids
                    got = answer["meta_info"]["output_token_kept_mass"]
                    assert got == pytest.approx(want.kept_mass, abs=1e-5)

                plain = (await client.post("/generate", json=body | {
                    "return_kept_mass": False})).json()["meta_info"]  # fmt: skip
                assert "output_token_kept_mass" not in plain
                bad = await client.post("/generate", json=body | {"return_kept_mass": "yes"})
                assert bad.status_code == 400 and "return_kept_mass" in bad.text
        finally:
            await engine.shutdown()

    asyncio.run(run())


@pytest.mark.parametrize("stream", [False, True])
def test_a_score_only_request_has_no_output_kept_mass(serve_home, stream) -> None:
    async def run() -> None:
        engine = AsyncLLM(**ENGINE_KWARGS)
        try:
            transport = httpx.ASGITransport(app=build_app(engine, ServeSettings()))
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0},
                        "return_kept_mass": True, "stream": stream}  # fmt: skip
                text = (await client.post("/generate", json=body)).text
                last = text if not stream else [
                    line[len("data: "):] for line in text.split("\n")
                    if line.startswith("data: {")][-1]  # fmt: skip
                assert json.loads(last)["meta_info"]["output_token_kept_mass"] == []
        finally:
            await engine.shutdown()

    asyncio.run(run())


def _events(text: str) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in text.split("\n")
            if line.startswith("data: {")]  # fmt: skip


def test_completions_and_chat_return_each_choices_kept_mass(serve_home) -> None:
    """OpenAI's routes: ``return_kept_mass`` gives every choice ``kept_mass``, one per
    output token; streamed, each chunk carries its own tokens' (joined: the whole)."""

    async def run() -> None:
        engine = AsyncLLM(**ENGINE_KWARGS, logprobs_mode="processed_logprobs")
        try:
            transport = httpx.ASGITransport(app=build_app(engine, ServeSettings()))
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                want = await in_process(engine)
                sampling = {"model": "tiny-qwen3", "max_tokens": 5, "temperature": 0.7,
                            "top_k": 4, "top_p": 0.8, "seed": 11, "ignore_eos": True,
                            "logprobs": 0, "return_kept_mass": True}  # fmt: skip
                completion = (await client.post("/v1/completions", json=sampling | {
                    "prompt": PROMPT})).json()["choices"][0]  # fmt: skip
                assert completion["kept_mass"] == want.kept_mass
                assert completion["logprobs"]["token_logprobs"] == want.logprobs
                streamed = await client.post("/v1/completions", json=sampling | {
                    "prompt": PROMPT, "stream": True})  # fmt: skip
                joined = [m for e in _events(streamed.text) for c in e["choices"]
                          for m in c["kept_mass"]]  # fmt: skip
                assert joined == want.kept_mass
                plain = (await client.post("/v1/completions", json=sampling | {
                    "prompt": PROMPT, "return_kept_mass": False})).json()  # fmt: skip
                assert "kept_mass" not in plain["choices"][0]

                chat = sampling | {"messages": [{"role": "user", "content": "hi"}],
                                   "logprobs": True}  # fmt: skip
                answer = (await client.post("/v1/chat/completions", json=chat)).json()
                choice = answer["choices"][0]
                assert len(choice["kept_mass"]) == answer["usage"]["completion_tokens"] == 5
                assert all(0 < m <= 1 for m in choice["kept_mass"])
                streamed = await client.post("/v1/chat/completions", json=chat | {"stream": True})
                joined = [m for e in _events(streamed.text) for c in e["choices"]
                          for m in c["kept_mass"]]  # fmt: skip
                assert joined == choice["kept_mass"]
        finally:
            await engine.shutdown()

    asyncio.run(run())
