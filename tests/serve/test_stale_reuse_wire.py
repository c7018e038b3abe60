"""Stale prefix-cache reuse over the wire, and the salt that prevents it.

SGLang's ``/update_weights_from_disk`` with ``flush_cache: false`` keeps the prefix
cache across an update (prime-rl's setting). On a server started with
``--no-salt-prefix-cache-by-weight-version`` a request after the update takes the old
weights' KV of its prompt from the cache and its logprobs are not the new weights';
on a default server (salted by weight version) it computes its prompt afresh. A
completion parked across an update names both versions in its ``weight_versions``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_kit import API_KEY, ServeProcess, running, start_server, stream_events

from kvrunner.models.tiny import write_tiny_checkpoint

PROMPT = list(range(20, 60))  # 40 tokens: two full blocks of 16 can be cached
SAMPLING = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("stale_wire")
    return write_tiny_checkpoint(root / "a", seed=0), write_tiny_checkpoint(root / "b", seed=1)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, serve_home, checkpoints) -> Iterator[dict[str, ServeProcess]]:
    logs = tmp_path_factory.mktemp("stale_wire_logs")
    started = {
        "salted": start_server(
            logs,
            serve_home,
            "salted",
            ["--enable-rl-endpoints"],
            api_key=API_KEY,
            model=str(checkpoints[0]),
        ),
        "unsalted": start_server(
            logs,
            serve_home,
            "unsalted",
            ["--enable-rl-endpoints", "--no-salt-prefix-cache-by-weight-version"],
            api_key=API_KEY,
            model=str(checkpoints[0]),
        ),
    }
    with running(started):
        yield started


def _meta(http, prompt: list[int]) -> dict:
    response = http.post(
        "/generate", json={"input_ids": prompt, "return_logprob": True, "sampling_params": SAMPLING}
    )
    assert response.status_code == 200, response.text
    return response.json()["meta_info"]


def _after_unflushed_update(server: ServeProcess, checkpoint: Path) -> tuple[dict, dict]:
    """The prompt's answer after an update that kept the cache, and its answer from
    an empty cache under the same new weights."""
    with server.client() as http:
        _meta(http, PROMPT)  # its blocks, under the old weights, are cached
        response = http.post(
            "/update_weights_from_disk",
            json={"model_path": str(checkpoint), "weight_version": "b", "flush_cache": False},
        )
        assert response.status_code == 200 and response.json()["success"], response.text
        after = _meta(http, PROMPT)
        assert http.post("/flush_cache").status_code == 200
        fresh = _meta(http, PROMPT)
    return after, fresh


def _logprobs(meta: dict) -> list[float]:
    return [lp for lp, _, _ in meta["output_token_logprobs"]]


def test_unsalted_an_unflushed_update_serves_the_old_weights_kv(servers, checkpoints):
    after, fresh = _after_unflushed_update(servers["unsalted"], checkpoints[1])
    assert after["weight_version"] == "b"
    assert after["cached_tokens"] == 32 and fresh["cached_tokens"] == 0
    assert _logprobs(after) != pytest.approx(_logprobs(fresh), abs=1e-4)


def test_salted_by_version_an_unflushed_update_serves_none_of_it(servers, checkpoints):
    after, fresh = _after_unflushed_update(servers["salted"], checkpoints[1])
    assert after["weight_version"] == "b"
    assert after["cached_tokens"] == 0
    assert _logprobs(after) == pytest.approx(_logprobs(fresh), abs=1e-5)


def test_a_completion_parked_across_an_update_names_both_versions(servers, checkpoints):
    server = servers["salted"]

    async def run() -> tuple[object, list[dict]]:
        async with server.async_client() as http:
            version = (await http.get("/get_weight_version")).json()["weight_version"]
            model = (await http.get("/v1/models")).json()["data"][0]["id"]
            first = asyncio.Event()
            stream = asyncio.create_task(
                stream_events(
                    http,
                    "/v1/completions",
                    {
                        "model": model,
                        "prompt": PROMPT[:8],
                        "max_tokens": 200,
                        "temperature": 0.0,
                        "ignore_eos": True,
                    },
                    first,
                )
            )
            await asyncio.wait_for(first.wait(), 60)
            for path, body in (
                ("/pause_generation", {"mode": "in_place"}),
                (
                    "/update_weights_from_disk",
                    {"model_path": str(checkpoints[0]), "weight_version": "c"},
                ),
                ("/continue_generation", {}),
            ):
                response = await http.post(path, json=body)
                assert response.status_code == 200, (path, response.text)
            return version, await stream

    version, chunks = asyncio.run(run())
    last = chunks[-1]
    (old, start), (new, switch) = last["choices"][0]["weight_versions"]
    assert (old, start, new) == (version, 0, "c") and 0 < switch < 200
    versions = [c["weight_version"] for c in chunks]
    before = versions.index("c")  # the chunks' versions: the old ones, then the new
    assert before > 0 and set(versions[:before]) == {version} and set(versions[before:]) == {"c"}
