"""``/metrics`` follows the engine: requests running and waiting, KV blocks used, tokens
per second, step time, the sleep level, the weight version, and the sampled rows whose
logits were not finite (``cache_info().nonfinite_rows``). The server here serves a
checkpoint with NaN in one embedding row, so exactly the requests that feed that token
fail; each reaches an SGLang client as an ``abort`` carrying the cause and status 500,
an OpenAI client as finish reason ``"error"``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import safetensors.torch
from serve_kit import API_KEY, ServeProcess, scrape, start_server, stream_events

from kvrunner.models.tiny import write_tiny_checkpoint

#: the token whose embedding row is NaN
BAD = 9
GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory) -> Path:
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("poisoned") / "m", seed=0)
    tensors = safetensors.torch.load_file(str(path / "model.safetensors"))
    tensors["model.embed_tokens.weight"][BAD] = float("nan")
    safetensors.torch.save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def metrics_server(tmp_path_factory, serve_home, poisoned) -> Iterator[ServeProcess]:
    server = start_server(tmp_path_factory.mktemp("metrics_logs"), serve_home, "metrics",
                          ["--enable-rl-endpoints", "--no-check-finite"], api_key=API_KEY,
                          model=str(poisoned)).wait_ready()
    yield server
    assert server.stop() == 0


def test_a_nonfinite_row_is_counted_and_reaches_each_client_as_its_error(
    metrics_server, poisoned
) -> None:
    with metrics_server.client() as client:
        assert scrape(client)["kvrunner_nonfinite_rows_total"] == 0
        bad = client.post("/generate", json={"input_ids": [5, BAD, 7],
                                             "sampling_params": GREEDY}).json()
        assert bad["output_ids"] == []
        reason = bad["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and reason["status_code"] == 500
        assert reason["err_type"] == "InternalServerError"
        assert reason["message"].endswith("(output token 0): logits hold NaN")
        openai = client.post("/v1/completions", json={
            "model": str(poisoned), "prompt": [BAD, 3], "max_tokens": 4,
            "temperature": 0.0}).json()
        assert openai["choices"][0]["finish_reason"] == "error"
        # the engine serves on: a prompt without the token is untouched
        good = client.post("/generate", json={"input_ids": [5, 6, 7],
                                              "sampling_params": GREEDY}).json()
        assert good["meta_info"]["finish_reason"]["type"] == "length"
        assert len(good["output_ids"]) == 4
        assert scrape(client)["kvrunner_nonfinite_rows_total"] == 2


def test_the_gauges_follow_requests_sleep_and_weight_updates(metrics_server, poisoned,
                                                             tmp_path) -> None:
    n = 60

    async def in_flight():
        async with metrics_server.async_client() as client:
            first = asyncio.Event()
            task = asyncio.create_task(stream_events(client, "/generate", {
                "input_ids": [5, 6, 7, 8],
                "sampling_params": GREEDY | {"max_new_tokens": n}}, first))
            await first.wait()
            await client.post("/pause_generation", json={"mode": "in_place"})
            during = scrape(metrics_server.client())
            await client.post("/continue_generation", json={})
            await task
            return during

    with metrics_server.client() as client:
        before = scrape(client)
        during = asyncio.run(in_flight())
        assert (during["kvrunner_num_requests_running"], during["kvrunner_paused"]) == (1, 1)
        assert during["kvrunner_kv_blocks_used"] >= 1
        after = scrape(client)
        assert after["kvrunner_generation_tokens_total"] - \
            before["kvrunner_generation_tokens_total"] == n
        assert after["kvrunner_generation_tokens_per_second"] > 0
        assert after["kvrunner_step_seconds"] > 0
        assert (after["kvrunner_num_requests_running"], after["kvrunner_num_requests_waiting"],
                after["kvrunner_kv_blocks_used"], after["kvrunner_paused"]) == (0, 0, 0, 0)
        idle = scrape(client)  # nothing generated since the scrape before
        assert idle["kvrunner_generation_tokens_per_second"] == 0
        # SGLang's tags: the KV pool alone is level 1, the weights make it level 2
        for tags, level in ((["kv_cache"], 1), (["weights", "kv_cache"], 2),
                            (["weights"], 2), (None, 2)):
            response = client.post("/release_memory_occupation", json={"tags": tags})
            assert response.status_code == 200, response.text
            assert scrape(client)["kvrunner_sleep_level"] == level, tags
            assert client.get("/is_sleeping").json() == {"is_sleeping": True}
            client.post("/resume_memory_occupation", json={})
            assert scrape(client)["kvrunner_sleep_level"] == 0
        assert 'kvrunner_weight_info{version="0"}' in scrape(client)
        refused = client.post("/update_weights_from_disk", json={
            "model_path": str(poisoned), "weight_version": "w-3"})
        assert refused.status_code == 400 and "NaN" in refused.json()["message"]
        assert 'kvrunner_weight_info{version="0"}' in scrape(client)  # nothing changed
        # (the last test here: the server's weights are clean from now on)
        clean = write_tiny_checkpoint(tmp_path / "clean", seed=0)
        assert client.post("/update_weights_from_disk", json={
            "model_path": str(clean), "weight_version": "w-3"}).json()["success"] is True
        assert 'kvrunner_weight_info{version="w-3"}' in scrape(client)
