"""The routes slime calls around its weight updates, with the semantics its code
relies on (slime 624b824a898ab0ec1fcb4d373004c7f3852bf515): the weight-update check
of ``--check-weight-update-equal`` (``slime/ray/placement_group.py``, ``train.py``:
snapshot, reset_tensors, push, compare), the wait for an idle server after
``abort_all`` (``slime/backends/sglang_utils/server_control.py``, ``/v1/loads``),
``/post_process_weights`` and the ``/get_server_info`` keys its external-engine
check reads (``external.py``, ``sglang_engine.py::_init_external``)."""

from __future__ import annotations

import concurrent.futures
import time

from push_kit import SERVER_KEY
from test_checksum import digests
from test_peer_trainers import run_trainer
from test_weight_routes import greedy


def check(client, action: str):
    return client.post("/weights_checker", json={"action": action})


def test_the_weight_update_check_fails_until_a_push_rewrites_every_tensor(
    server, checkpoints, tmp_path
) -> None:
    path = checkpoints.path(1)  # the served weights: the push restores them
    with server.client() as client:
        before = greedy(client)
        assert check(client, "snapshot").json()["success"] is True
        reset = check(client, "reset_tensors")
        assert reset.status_code == 200, reset.text
        assert greedy(client) != before
        failed = check(client, "compare")
        assert failed.status_code == 400 and failed.json()["success"] is False
        assert "check tensor equality failed" in failed.json()["message"]
        assert "model.embed_tokens.weight" in failed.json()["message"]
        run_trainer(server, tmp_path, peer="slime_tensor", path=str(path), mixed=False,
                    chunks=3, api_key=SERVER_KEY)
        passed = check(client, "compare")
        assert passed.status_code == 200 and passed.json()["success"] is True, passed.text
        assert greedy(client) == before
        checksums = check(client, "checksum").json()["checksums"]
        assert checksums == digests(path, "float32")


def test_a_draft_selector_and_an_unknown_action_are_refused(server) -> None:
    with server.client() as client:
        draft = client.post("/weights_checker", json={"action": "checksum",
                                                      "selector": "draft"})
        assert draft.status_code == 400 and "draft" in draft.json()["message"]
        unknown = client.post("/weights_checker", json={"action": "explode"})
        assert unknown.status_code == 400


def num_requests_from_load(load) -> int:
    """slime's server_control.num_requests_from_load, replayed."""
    if isinstance(load, list):
        return sum(num_requests_from_load(item) for item in load)
    if not isinstance(load, dict):
        return 0
    if "loads" in load:
        return num_requests_from_load(load["loads"])
    for key in ("num_reqs", "num_total_reqs", "total_reqs"):
        if isinstance(load.get(key), int):
            return load[key]
    running = load.get("num_running_reqs", load.get("total_running_reqs"))
    waiting = load.get("num_waiting_reqs", load.get("total_waiting_reqs"))
    return (running if isinstance(running, int) else 0) + \
        (waiting if isinstance(waiting, int) else 0)


def test_loads_count_the_live_requests_until_abort_all_leaves_the_server_idle(server) -> None:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 40,
                                                        "ignore_eos": True}}
    with server.client() as client, concurrent.futures.ThreadPoolExecutor(3) as pool:
        assert num_requests_from_load(client.get("/v1/loads?include=core").json()) == 0
        assert client.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
        pending = [pool.submit(client.post, "/generate", json=body) for _ in range(3)]
        deadline = time.monotonic() + 30
        while num_requests_from_load(client.get("/v1/loads?include=core").json()) < 3:
            assert time.monotonic() < deadline, "the held requests never showed"
            time.sleep(0.05)
        load = client.get("/v1/loads").json()["loads"][0]
        assert load["dp_rank"] == 0 and load["max_running_requests"] == 4
        assert client.post("/abort_request", json={"abort_all": True}).status_code == 200
        for answer in pending:
            assert answer.result().status_code == 200
        assert num_requests_from_load(client.get("/v1/loads?include=core").json()) == 0
        assert client.post("/continue_generation", json={}).status_code == 200
        assert client.get("/v1/loads?include=gpu").status_code == 400


def test_post_process_weights_has_nothing_to_do_without_quantized_weights(server) -> None:
    with server.client() as client:
        for asked in ({"restore_weights_before_load": True, "post_process_quantization": False},
                      {"restore_weights_before_load": False, "post_process_quantization": True}):
            answer = client.post("/post_process_weights", json=asked)
            assert answer.status_code == 200 and answer.json()["success"] is True
        assert client.post("/post_process_weights", json={"quantize": True}).status_code == 400


def test_server_info_has_the_keys_slimes_external_engine_check_reads(server) -> None:
    with server.client() as client:
        info = client.get("/get_server_info").json()
    # external.discover_external_engines and ExternalEngineInfo.parallel_config
    assert (int(info["tp_size"]), int(info["pp_size"]), int(info["ep_size"]),
            int(info["moe_dp_size"]), int(info["num_gpus"])) == (1, 1, 1, 1, 1)
    assert info["disaggregation_mode"] not in ("prefill", "decode")
    assert not info["encoder_only"]
    # sglang_engine._init_external compares these with the arguments slime would pass
    assert info["enable_memory_saver"] is True
    assert info["enable_return_routed_experts"] is False
    assert info["dtype"] == "float32"
