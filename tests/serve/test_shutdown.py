"""SIGTERM with requests in flight, and tensor parallelism behind the server.

A TP=2 server (two ranks on gloo) gives the TP=1 engine's tokens; SIGTERM to it with
streams in flight ends each with finish reason ``abort`` (SGLang's and OpenAI's
streams alike, each closed by ``data: [DONE]``), and the process exits 0 with both
rank processes gone. A server started with ``--shutdown-mode drain`` lets the
requests in flight finish, refuses new ones meanwhile (503), and exits 0 as cleanly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from serve_kit import API_KEY, ServeProcess, descendants, start_server, stream_events

from kvrunner import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
#: more tokens than the streams can make before the signal lands
LONG = 400


def _server(tmp_path_factory, serve_home, name: str, flags: list[str]) -> ServeProcess:
    return start_server(tmp_path_factory.mktemp(f"{name}_logs"), serve_home, name, flags,
                        api_key=API_KEY).wait_ready()


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory, serve_home) -> Iterator[ServeProcess]:
    server = _server(tmp_path_factory, serve_home, "tp2",
                     ["--tensor-parallel-size", "2", "--distributed-backend", "gloo",
                      "--shutdown-mode", "abort"])
    yield server
    if server.proc is not None and server.proc.poll() is None:  # the SIGTERM test failed
        server.stop()


def _sglang(prompt: list[int], k: int, n: int) -> dict:
    return {"input_ids": prompt, "rid": f"in-flight-{k}",
            "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}}


def _openai(prompt: list[int], n: int) -> dict:
    return {"model": "tiny-qwen3", "prompt": prompt, "max_tokens": n, "temperature": 0.0,
            "ignore_eos": True}


async def _in_flight(client: httpx.AsyncClient, n: int) -> tuple[list[asyncio.Task],
                                                                 list[asyncio.Task]]:
    """One SGLang-shaped and one OpenAI stream per prompt, returned once every one of
    them has sent its first event."""
    firsts: list[asyncio.Event] = []
    sglang, openai = [], []
    for k, prompt in enumerate(PROMPTS):
        firsts += [asyncio.Event(), asyncio.Event()]
        sglang.append(asyncio.create_task(
            stream_events(client, "/generate", _sglang(prompt, k, n), firsts[-2])))
        openai.append(asyncio.create_task(
            stream_events(client, "/v1/completions", _openai(prompt, n), firsts[-1])))
    await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 120)
    return sglang, openai


def test_tp2_behind_the_server_gives_the_tp1_engines_tokens(tp_server, reference_llm) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    want = reference_llm.generate(PROMPTS, params)
    with tp_server.client() as client:
        assert client.get("/server_info").json()["tp_size"] == 2
        for prompt, ref in zip(PROMPTS, want, strict=True):
            out = client.post("/generate", json={
                "input_ids": prompt, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 8, "temperature": 0.0,
                                    "ignore_eos": True}}).json()
            assert out["output_ids"] == ref.token_ids
            assert [t[0] for t in out["meta_info"]["output_token_logprobs"]] == \
                pytest.approx(ref.logprobs, abs=1e-4)


def test_sigterm_aborts_the_streams_in_flight_and_stops_every_rank(tp_server) -> None:
    ranks = descendants(tp_server.pid)
    assert len(ranks) >= 1, "a TP=2 server runs its second rank in a process of its own"

    async def run():
        async with tp_server.async_client() as client:
            sglang, openai = await _in_flight(client, LONG)
            code = await asyncio.to_thread(tp_server.stop)  # SIGTERM; fails if any is left
            return code, await asyncio.gather(*sglang), await asyncio.gather(*openai)

    code, sglang, openai = asyncio.run(run())
    assert code == 0
    for events in sglang:
        last = events[-1]
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(last["output_ids"]) < LONG
    for events in openai:
        reasons = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
        assert reasons[-1] == "abort" and all(r is None for r in reasons[:-1])


def test_sigterm_under_drain_finishes_the_requests_in_flight(tmp_path_factory,
                                                            serve_home) -> None:
    server = _server(tmp_path_factory, serve_home, "drain", ["--shutdown-mode", "drain"])
    n = 150

    async def run():
        async with server.async_client() as client:
            sglang, openai = await _in_flight(client, n)
            stopping = asyncio.create_task(asyncio.to_thread(server.stop))
            refused = None
            while not stopping.done() and refused is None:  # admission closes first
                await asyncio.sleep(0.02)
                try:
                    response = await client.post("/generate", json=_sglang([1, 2], 99, 2))
                except httpx.TransportError:  # the drain ended and the listener closed
                    break
                if response.status_code == 503:
                    refused = response.json()["error"]["message"]
            return await stopping, refused, await asyncio.gather(*sglang), \
                await asyncio.gather(*openai)

    code, refused, sglang, openai = asyncio.run(run())
    assert code == 0
    assert refused is not None and "shutting down" in refused
    for events in sglang:
        last = events[-1]
        assert last["meta_info"]["finish_reason"] == {"type": "length", "length": n}
        assert len(last["output_ids"]) == n
    for events in openai:
        reasons = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
        assert reasons[-1] == "length"
