"""vLLM's ``/collective_rpc`` as SkyRL's ``RemoteInferenceClient`` posts it for its
worker extension, on a live (CPU) ``kvrunner serve``: SkyRL's non-colocated push
(its keep pause, the group join, ``skyrl_start_weight_update``, one packed
``update_weights_nccl`` while the trainer broadcasts, ``skyrl_finish_weight_update``,
the prefix-cache reset, resume; and the fully async trainer's sleep and wakes around
it) replayed from SkyRL's source over a real gloo group (peer_trainers.py, the
commit cited there) lands as one update: the server's greedy tokens then equal a
fresh engine's on the pushed tensors. A method kvrunner does not serve, an argument
the worker's method would not take, and a chunk the engine refuses are 400s naming
them, and the old weights serve on at the same version. The CUDA IPC data path:
test_skyrl_ipc_gpu.py."""

from __future__ import annotations

from typing import Any

import pytest
from test_ipc_handles import RunsACommand, model_specs
from test_peer_trainers import fresh_engine_tokens, run_trainer, weight_version
from test_update_group import free_port
from test_weight_routes import greedy
from vllm_ipc_payloads import TRAINER_GPU, b64, skyrl_packed

#: what vLLM answers for a worker method that returns nothing, one entry per rank
DONE = {"results": [None]}


def rpc(client: Any, method: str, **body: Any) -> Any:
    return client.post("/collective_rpc", json={"method": method, **body})


@pytest.mark.parametrize(("dtype", "offload_kv"), [
    ("float32", False),    # the synchronous trainer: pause, push, reset, resume
    ("bfloat16", True),    # the fully async one: sleep, wake weights, push, wake KV
])
def test_skyrls_broadcast_push_lands_as_one_update(
    dtype, offload_kv, server, checkpoints, tmp_path
) -> None:
    seed = 6 if offload_kv else 7
    with server.client() as client:
        before, version = greedy(client), weight_version(client)
        steps = run_trainer(server, tmp_path, peer="skyrl_broadcast",
                            path=str(checkpoints.path(seed)), port=free_port(),
                            dtype=dtype, offload_kv=offload_kv)
        answers = {s["step"]: s["answer"] for s in steps}
        assert answers["init"] == {"message": "Weight transfer initialized"}
        for step in ("start", "update", "finish") + (
                ("sleep", "wake_weights", "wake_kv") if offload_kv else ()):
            assert answers[step] == DONE, (step, answers[step])
        after = greedy(client)
        assert weight_version(client) != version
        restored = client.post("/update_weights_from_disk",
                               json={"model_path": str(checkpoints.path(1))})
        assert restored.status_code == 200, restored.text
    assert after != before
    rounded = checkpoints.rounded(seed, dtype)
    assert after == fresh_engine_tokens(rounded, tmp_path, mixed=False)


GOOD_CHUNK = {"names": ["lm_head.weight"], "dtype_names": ["float32"], "shapes": [[8, 8]],
              "sizes": [64], "ipc_handles_pickled": b64({})}


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"method": "load_model"}, "method", "'load_model' is not served"),
    ({"method": "fetch_weights", "kwargs": {"target_version": 1}}, "method",
     "runs no worker code"),
    ({"kwargs": {}}, "method", "method"),
    ({"method": ""}, "method", "at least 1"),
    ({"method": "skyrl_finish_weight_update", "timeout": 0}, "timeout", "greater than 0"),
    ({"method": "skyrl_finish_weight_update", "target": 1}, "target", "target"),
    ({"method": "skyrl_finish_weight_update", "args": [1]}, "args",
     "takes 0 argument(s) (none), got 1"),
    ({"method": "skyrl_start_weight_update", "args": [True],
      "kwargs": {"is_checkpoint_format": True}}, "kwargs.is_checkpoint_format",
     "given both in args and in kwargs"),
    ({"method": "skyrl_start_weight_update", "kwargs": {"is_checkpoint_format": False}},
     "kwargs.is_checkpoint_format", "kernel layout"),
    ({"method": "skyrl_start_weight_update", "args": ["yes"]}, "args.0", "bool"),
    ({"method": "skyrl_start_weight_update", "kwargs": {"load_format": "x"}},
     "kwargs.load_format", "load_format"),
    ({"method": "update_weights_ipc"}, "kwargs.update_info", "update_info"),
    ({"method": "update_weights_ipc", "kwargs": {"update_info": {
        k: v for k, v in GOOD_CHUNK.items() if k != "sizes"}}},
     "kwargs.update_info.sizes", "sizes"),
    ({"method": "update_weights_ipc", "kwargs": {"update_info": {**GOOD_CHUNK,
                                                                 "sizes": [64, 1]}}},
     "kwargs.update_info.sizes", "2 entries for 1 names"),
    ({"method": "update_weights_ipc", "args": [{**GOOD_CHUNK, "tensor_sizes": [256]}]},
     "args.0.tensor_sizes", "tensor_sizes"),
    ({"method": "update_weights_nccl", "kwargs": {"update_info": {
        "names": ["lm_head.weight"], "dtype_names": ["float32"], "shapes": [[8, 8]],
        "packed": True}}}, "method", "needs the nccl weight-transfer backend"),
    ({"method": "skyrl_wake_for_weight_sync"}, "kwargs.tags", "tags"),
])
def test_a_call_the_worker_extension_would_not_take_is_a_400_naming_it(
    ipc_server, body, param, says
) -> None:
    with ipc_server.client() as client:
        version = weight_version(client)
        r = client.post("/collective_rpc", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text
        assert says in r.json()["error"]["message"], r.text
        assert weight_version(client) == version


@pytest.mark.parametrize("fault", ["hostile", "no_gpu", "unknown_name"])
def test_a_refused_chunk_closes_the_update_and_the_old_weights_serve_on(
    ipc_server, checkpoints, fault, tmp_path
) -> None:
    info = skyrl_packed(model_specs(checkpoints))
    if fault == "hostile":
        info["ipc_handles_pickled"] = b64({TRAINER_GPU: RunsACommand(tmp_path / "ran")})
        says = "posix.system"
    elif fault == "no_gpu":
        says = "has no GPU UUID"
    else:
        info["names"][0] = "model.layers.99.mlp.up_proj.weight"
        says = "model.layers.99.mlp.up_proj.weight"
    with ipc_server.client() as client:
        before, version = greedy(client), weight_version(client)
        assert rpc(client, "skyrl_start_weight_update",
                   kwargs={"is_checkpoint_format": True}).json() == DONE
        r = rpc(client, "update_weights_ipc", kwargs={"update_info": info})
        assert r.status_code == 400, r.text
        assert says in r.json()["error"]["message"], r.text
        # the refused part closed the update: finishing it is a 409 (none is open)
        assert rpc(client, "skyrl_finish_weight_update").status_code == 409
        assert (greedy(client), weight_version(client)) == (before, version)
    assert not (tmp_path / "ran").exists()


def test_the_sleep_for_a_weight_sync_discards_the_weights_until_a_push(
    ipc_server, checkpoints
) -> None:
    with ipc_server.client() as client:
        before = greedy(client)
        assert rpc(client, "skyrl_sleep_for_weight_sync",
                   kwargs={"offload_kv": True}).json() == DONE
        assert client.get("/is_sleeping").json() == {"is_sleeping": True}
        for tags in (["weights"], ["kv_cache"]):
            assert rpc(client, "skyrl_wake_for_weight_sync",
                       kwargs={"tags": tags}).json() == DONE
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}
        # the weights were discarded, not kept: nothing generates until they are pushed
        r = client.post("/generate", json={"input_ids": [1, 2, 3],
                                           "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 409, r.text
        restored = client.post("/update_weights_from_disk",
                               json={"model_path": str(checkpoints.path(1))})
        assert restored.status_code == 200, restored.text
        assert greedy(client) == before


def test_the_sleep_for_a_weight_sync_is_a_409_while_a_request_is_parked(ipc_server) -> None:
    with ipc_server.client() as client, client.stream("POST", "/v1/completions", json={
            "model": client.get("/v1/models").json()["data"][0]["id"], "prompt": [1, 2, 3],
            "max_tokens": 60, "temperature": 0.0, "ignore_eos": True,
            "stream": True}) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        with ipc_server.client() as control:
            assert control.post("/pause", params={"mode": "keep"}).status_code == 200
            r = rpc(control, "skyrl_sleep_for_weight_sync", kwargs={"offload_kv": True})
            assert r.status_code == 409, r.text
            assert "keeps no KV cache on the host" in r.json()["error"]["message"]
            assert control.get("/is_sleeping").json() == {"is_sleeping": False}
            assert control.post("/resume").status_code == 200
        assert [line for line in lines if line.startswith("data: ")][-1] == "data: [DONE]"
