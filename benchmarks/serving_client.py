"""The HTTP load of bench_serving.py, run in a process of its own (so that the client's
JSON work does not share the server's interpreter): a rollout batch sent all at once,
streams under Poisson arrivals, and the slime-shaped wake / update / continue cycle.

Imports only aiohttp and the standard library; every function returns plain data.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from typing import Any

import aiohttp


def _session(url: str) -> aiohttp.ClientSession:
    """A client as an RL framework keeps one: every request of a batch in flight at
    once (no cap on connections), no timeout."""
    return aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=None))


def _body(route: str, prompt: list[int], new: int, seed: int, *, stream: bool = False,
          penalties: dict[str, float] | None = None) -> dict[str, Any]:
    """One request of the rollout as each protocol's client writes it. ``penalties``
    (vLLM's names: ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``,
    ``min_p``) go where each protocol takes them."""
    extra = penalties or {}
    if route == "/generate":
        return {"input_ids": prompt, "stream": stream, "sampling_params": {
            "max_new_tokens": new, "temperature": 1.0, "sampling_seed": seed,
            "ignore_eos": True, **extra}}
    if route == "/inference/v1/generate":
        # the body TRL's and verifiers' vLLM clients send (n, top_k, min_p,
        # repetition_penalty and output_kind spelled out at their neutral values unless
        # penalised), less ``logprobs``: no other row asks for them
        return {"model": "served", "token_ids": prompt, "request_id": uuid.uuid4().hex,
                "stream": stream, "sampling_params": {
                    "n": 1, "temperature": 1.0, "seed": seed, "max_tokens": new,
                    "ignore_eos": True, "repetition_penalty": 1.0, "top_k": 0,
                    "min_p": 0.0, "output_kind": 2, **extra}}
    return {"model": "served", "prompt": prompt, "max_tokens": new, "temperature": 1.0,
            "seed": seed, "ignore_eos": True, "stream": stream, **extra,
            **({"stream_options": {"include_usage": True}} if stream else {})}


def _completion_tokens(route: str, answer: dict[str, Any]) -> int:
    if route == "/generate":
        return len(answer["output_ids"])
    if route == "/inference/v1/generate":
        return sum(len(choice["token_ids"]) for choice in answer["choices"])
    return int(answer["usage"]["completion_tokens"])


def rollout(url: str, route: str, prompts: list[list[int]], new: int,
            penalties: dict[str, float] | None = None) -> tuple[float, int]:
    """Send every prompt at once (seed ``i`` for prompt ``i``, ``penalties`` as
    :func:`_body` places them) and wait for all answers;
    (seconds from the first send to the last answer, completion tokens). The pool's
    connections are opened first, by as many one-token requests at once.

    aiohttp, as SGLang's and vLLM's own serving benchmarks use: httpx's pool spends
    more time choosing among hundreds of connections than the server spends on them.
    """

    async def run() -> tuple[float, int]:
        async with _session(url) as client:
            async def one(i: int, prompt: list[int], tokens: int = new) -> int:
                body = _body(route, prompt, tokens, i, penalties=penalties)
                async with client.post(route, json=body) as r:
                    r.raise_for_status()
                    return _completion_tokens(route, await r.json())

            # The route's first calls (imports), and one connection per request of the
            # batch: an RL framework's client keeps its pool open from step to step.
            await asyncio.gather(*(one(i, prompts[0][:8], 1) for i in range(len(prompts))))
            start = time.perf_counter()
            tokens = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            return time.perf_counter() - start, sum(tokens)

    return asyncio.run(run())


async def _timed_stream(client: aiohttp.ClientSession, prompt: list[int], new: int,
                        seed: int) -> tuple[float, list[float], int]:
    """One streamed ``/v1/completions``: (time to first token, the gaps between later
    events, completion tokens). Each event is one engine step's tokens."""
    start = time.perf_counter()
    events: list[float] = []
    tokens = 0
    async with client.post("/v1/completions",
                           json=_body("/v1/completions", prompt, new, seed, stream=True)) as r:
        r.raise_for_status()
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            elif chunk["choices"]:
                events.append(time.perf_counter())
    gaps = [b - a for a, b in zip(events, events[1:], strict=False)]
    return events[0] - start, gaps, tokens


def poisson(url: str, prompts: list[list[int]], new: int, rate: float, seed: int
            ) -> dict[str, Any]:
    """Stream one request per prompt, arriving as a Poisson process of ``rate``
    requests/s; every TTFT and ITL, the seconds the whole load took and its tokens."""

    async def run() -> dict[str, Any]:
        draw = random.Random(seed)
        async with _session(url) as client:
            await _timed_stream(client, prompts[0][:8], 2, 0)  # warm the route
            tasks = []
            start = time.perf_counter()
            for i, prompt in enumerate(prompts):
                tasks.append(asyncio.create_task(_timed_stream(client, prompt, new, i)))
                await asyncio.sleep(draw.expovariate(rate))
            results = await asyncio.gather(*tasks)
            seconds = time.perf_counter() - start
        return {"ttft": [r[0] for r in results], "itl": [g for r in results for g in r[1]],
                "tokens": sum(r[2] for r in results), "seconds": seconds}

    return asyncio.run(run())


def wake_cycle(url: str, model_path: str, prompt: list[int]) -> dict[str, float]:
    """The colocated RL cycle over HTTP, as slime drives it: pause, release the memory,
    (the trainer's turn), resume the weights, update them from disk, resume the KV
    cache, continue, then one streamed request. Seconds of each call, and
    ``wake_to_first_token``: from the first resume call to that request's first token.
    """

    async def run() -> dict[str, float]:
        async with _session(url) as client:
            async def call(path: str, body: dict[str, Any] | None = None) -> float:
                t0 = time.perf_counter()
                async with client.post(path, json=body or {}) as r:
                    r.raise_for_status()
                    await r.read()
                return time.perf_counter() - t0

            out = {"pause": await call("/pause_generation", {"mode": "abort"}),
                   "release": await call("/release_memory_occupation")}
            t0 = time.perf_counter()
            out["resume weights"] = await call("/resume_memory_occupation",
                                               {"tags": ["weights"]})
            out["update from disk"] = await call("/update_weights_from_disk",
                                                 {"model_path": model_path,
                                                  "weight_version": "1"})
            out["resume kv_cache"] = await call("/resume_memory_occupation",
                                                {"tags": ["kv_cache"]})
            out["continue"] = await call("/continue_generation")
            asked = time.perf_counter()
            ttft, _, _ = await _timed_stream(client, prompt, 2, 0)
            out["first token"] = ttft
            out["wake_to_first_token"] = asked + ttft - t0
            return out

    return asyncio.run(run())
