"""An SGLang-shaped client (httpx, SGLang's routes and JSON) runs slime's weight-update
cycle against a live ``kvrunner serve``: requests in flight, ``/pause_generation``,
``/flush_cache``, ``/update_weights_from_disk`` with a second checkpoint, then
``/continue_generation``. Afterwards the server's tokens are the in-process ``LLM``'s
on the new weights and every output names the new ``weight_version``; each pause mode
ends (``abort``), parks with their KV (``in_place``) or sends back to the queue with
their KV freed, to be recomputed under the new weights (``retract``) the requests in
flight."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serve_kit import API_KEY, ENGINE_KWARGS, ServeProcess, start_server, stream_events

from kvrunner import LLM, SamplingParams
from kvrunner.models.tiny import write_tiny_checkpoint

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19], [30, 31, 32, 33]]
#: long enough to be still running when the pause lands, short enough to stay cheap
LONG = 200
SHORT = 12


def _greedy(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}


def _seeded(n: int, seed: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0.8, "sampling_seed": seed, "ignore_eos": True}


def _params(sp: dict) -> SamplingParams:
    """The in-process SamplingParams of an SGLang ``sampling_params`` dict."""
    return SamplingParams(max_tokens=sp["max_new_tokens"], temperature=sp["temperature"],
                          seed=sp.get("sampling_seed"), ignore_eos=sp["ignore_eos"],
                          logprobs=0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """The served weights and the trainer's next ones (same architecture, other values)."""
    root = tmp_path_factory.mktemp("slime")
    return (write_tiny_checkpoint(root / "step0", seed=0),
            write_tiny_checkpoint(root / "step1", seed=1))


@pytest.fixture(scope="module")
def rollout_server(tmp_path_factory, serve_home, checkpoints) -> Iterator[ServeProcess]:
    server = start_server(tmp_path_factory.mktemp("slime_logs"), serve_home, "slime",
                          ["--enable-rl-endpoints"], api_key=API_KEY,
                          model=str(checkpoints[0])).wait_ready()
    yield server
    assert server.stop() == 0


@pytest.fixture(autouse=True)
def continued(rollout_server) -> Iterator[None]:
    """Generation continued after each test, so a failure leaves no pause behind to hold
    the next test's requests."""
    yield
    with rollout_server.client() as client:
        client.post("/continue_generation", json={})


@pytest.fixture(scope="module")
def references(checkpoints) -> Iterator[list[LLM]]:
    """In-process engines on each checkpoint, with the server's settings."""
    kwargs = {k: v for k, v in ENGINE_KWARGS.items() if k != "model"}
    llms = [LLM(str(path), **kwargs) for path in checkpoints]
    yield llms
    for llm in llms:
        llm.shutdown()


async def _post(client: httpx.AsyncClient, path: str, body: dict | None = None) -> dict:
    response = await client.post(path, json=body)
    assert response.status_code == 200, (path, response.text)
    return response.json()


async def _start_streams(client: httpx.AsyncClient, bodies: list[dict]
                         ) -> list[asyncio.Task]:
    """Streams of ``bodies``, returned once each has sent its first event (so each is in
    the engine, generating)."""
    firsts = [asyncio.Event() for _ in bodies]
    tasks = [asyncio.create_task(stream_events(client, "/generate", body, first))
             for body, first in zip(bodies, firsts, strict=True)]
    await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 60)
    return tasks


def _in_flight_bodies(tag: str) -> list[dict]:
    return [{"input_ids": p, "rid": f"{tag}-{k}", "return_logprob": True,
             "sampling_params": _seeded(LONG, k) if k % 2 else _greedy(LONG)}
            for k, p in enumerate(PROMPTS)]


def _final(events: list[dict]) -> dict:
    """A stream's last event; every earlier one is unfinished and the ids agree."""
    assert events, "no event"
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    assert len({e["meta_info"]["id"] for e in events}) == 1
    return events[-1]


async def _running(client: httpx.AsyncClient) -> tuple[int, int]:
    info = (await client.get("/server_info")).json()["internal_states"][0]
    return info["num_running"], info["num_waiting"]


def _generated(text: str) -> float:
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("kvrunner_generation_tokens_total "))


def test_the_slime_update_cycle_serves_the_new_weights_from_then_on(
    rollout_server, checkpoints, references
) -> None:
    old, new = references

    async def cycle():
        async with rollout_server.async_client() as client:
            tasks = await _start_streams(client, _in_flight_bodies("cycle"))
            assert (await _post(client, "/pause_generation", {"mode": "in_place"}))["status"] \
                == "ok"
            assert (await _post(client, "/flush_cache"))["success"] is True
            update = await _post(client, "/update_weights_from_disk",
                                 {"model_path": str(checkpoints[1]), "weight_version": "7"})
            assert update["success"] is True
            assert update["num_paused_requests"] == len(PROMPTS)  # kept across the update
            assert (await client.get("/get_weight_version")).json() == {"weight_version": "7"}
            await _post(client, "/continue_generation")
            spanned = [_final(events) for events in await asyncio.gather(*tasks)]
            after = [await _post(client, "/generate", {
                "input_ids": p, "return_logprob": True,
                "sampling_params": _seeded(SHORT, k) if k % 2 else _greedy(SHORT)})
                for k, p in enumerate(PROMPTS)]
            return spanned, after

    spanned, after = asyncio.run(cycle())
    for k, (prompt, out) in enumerate(zip(PROMPTS, spanned, strict=True)):
        meta = out["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": LONG}
        assert len(out["output_ids"]) == LONG
        assert meta["weight_version"] == "7"
        # the spans: the first tokens came from the old weights, the rest from version 7
        (v0, start0), (v1, switch) = meta["weight_versions"]
        assert (v0, start0, v1) == (0, 0, "7") and 0 < switch < LONG
        # made before the pause: the old weights' tokens, exactly (a seeded draw
        # depends on its position only, so the first ``switch`` are a shorter run's)
        sp = _in_flight_bodies("ref")[k]["sampling_params"] | {"max_new_tokens": switch}
        assert out["output_ids"][:switch] == old.generate([prompt], _params(sp))[0].token_ids
    for k, (prompt, out) in enumerate(zip(PROMPTS, after, strict=True)):
        sp = _seeded(SHORT, k) if k % 2 else _greedy(SHORT)
        want = new.generate([prompt], _params(sp))[0]
        assert out["output_ids"] == want.token_ids
        assert [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]] == \
            pytest.approx(want.logprobs, abs=1e-5)
        assert out["meta_info"]["weight_version"] == "7"
        assert out["meta_info"]["weight_versions"] == [["7", 0]]
        assert out["output_ids"] != old.generate([prompt], _params(sp))[0].token_ids


def test_pause_abort_ends_the_requests_in_flight_and_the_client_retries_them(
    rollout_server, checkpoints, references
) -> None:
    """slime's non-partial mode: the aborted samples come back with the tokens they had
    and finish type ``abort``; resubmitted after the update, they are the new weights'."""
    async def cycle():
        async with rollout_server.async_client() as client:
            tasks = await _start_streams(client, _in_flight_bodies("abort"))
            await _post(client, "/pause_generation", {"mode": "abort"})
            ended = [_final(events) for events in await asyncio.gather(*tasks)]
            assert await _running(client) == (0, 0)
            await _post(client, "/flush_cache")
            update = await _post(client, "/update_weights_from_disk",
                                 {"model_path": str(checkpoints[0]), "weight_version": "8"})
            assert update["num_paused_requests"] == 0
            await _post(client, "/continue_generation")
            retried = [await _post(client, "/generate", {
                "input_ids": p, "sampling_params": _greedy(SHORT)}) for p in PROMPTS]
            return ended, retried

    ended, retried = asyncio.run(cycle())
    old = references[0]
    for out in ended:
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and reason["message"]
        assert 0 < len(out["output_ids"]) < LONG
    for prompt, out in zip(PROMPTS, retried, strict=True):
        assert out["output_ids"] == old.generate([prompt], _params(_greedy(SHORT)))[0].token_ids
        assert out["meta_info"]["weight_version"] == "8"


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_retract_and_in_place_keep_the_requests_until_continue(rollout_server, mode) -> None:
    async def cycle():
        async with rollout_server.async_client() as client:
            tasks = await _start_streams(client, _in_flight_bodies(mode))
            await _post(client, "/pause_generation", {"mode": mode})
            assert (await client.get("/is_paused")).json() == {"is_paused": True}
            info = (await client.get("/server_info")).json()["internal_states"][0]
            if mode == "in_place":  # parked with their KV
                assert (info["num_running"], info["num_waiting"]) == (len(PROMPTS), 0)
                assert info["blocks_used"] > 0
            else:  # back in the queue, their KV freed
                assert (info["num_running"], info["num_waiting"]) == (0, len(PROMPTS))
                assert info["blocks_used"] == 0
            made = _generated((await client.get("/metrics")).text)
            await asyncio.sleep(0.3)  # paused: no step runs, no token is made
            assert _generated((await client.get("/metrics")).text) == made
            assert not any(task.done() for task in tasks)
            # the requests are still in the engine: sleeping would lose them
            refused = await client.post("/release_memory_occupation", json={})
            assert refused.status_code == 409, refused.text
            await _post(client, "/continue_generation")
            return [_final(events) for events in await asyncio.gather(*tasks)]

    for out in asyncio.run(cycle()):
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": LONG}
        assert len(out["output_ids"]) == LONG


def test_retract_recomputes_the_requests_whole_context_under_the_new_weights(
    rollout_server, checkpoints, references
) -> None:
    """SGLang's retract: after the update a retracted request's prompt and the tokens
    it had are recomputed with the new weights, so its continuation is what the new
    weights generate from that context (``in_place`` would continue on the old
    weights' KV)."""
    old, new = references
    bodies = [{"input_ids": p, "rid": f"retract-new-{k}",
               "sampling_params": _greedy(LONG)} for k, p in enumerate(PROMPTS)]

    async def cycle():
        async with rollout_server.async_client() as client:
            tasks = await _start_streams(client, bodies)
            await _post(client, "/pause_generation", {"mode": "retract"})
            await _post(client, "/update_weights_from_disk",
                         {"model_path": str(checkpoints[1]), "weight_version": "9"})
            await _post(client, "/continue_generation")
            outs = [_final(events) for events in await asyncio.gather(*tasks)]
            await _post(client, "/update_weights_from_disk",
                         {"model_path": str(checkpoints[0]), "weight_version": "0"})
            return outs

    for prompt, out in zip(PROMPTS, asyncio.run(cycle()), strict=True):
        (_, _), (version, switch) = out["meta_info"]["weight_versions"]
        assert version == "9" and 0 < switch < LONG
        made = out["output_ids"]
        assert made[:switch] == old.generate([prompt], _params(_greedy(switch)))[0].token_ids
        rest = new.generate([prompt + made[:switch]], _params(_greedy(LONG - switch)))[0]
        assert made[switch:] == rest.token_ids
