"""vLLM's weight-transfer routes with ``--weight-transfer-config '{"backend": "ipc"}'``
on a live (CPU) ``kvrunner serve``, posted as vLLM's HTTP client posts them: the init
takes an empty ``init_info``; a bad body is a 400 naming its field; a hostile pickle,
a name or shape the model refuses, or handles this engine cannot open (a CPU
engine's rank has no GPU UUID) are refused before anything loads, and the old
weights serve on, at the same version. The data path needs a GPU:
test_ipc_handles_gpu.py."""

from __future__ import annotations

from typing import Any

import pytest
from test_ipc_handles import RunsACommand, model_specs
from test_weight_routes import greedy
from vllm_ipc_payloads import TRAINER_GPU, b64, packed, per_tensor

GOOD = {"names": ["lm_head.weight"], "dtype_names": ["float32"], "shapes": [[8, 8]],
        "ipc_handles_pickled": b64([])}


@pytest.mark.parametrize(("route", "body", "field"), [
    ("/init_weight_transfer_engine", {}, "init_info"),
    ("/init_weight_transfer_engine", {"init_info": {"master_address": "127.0.0.1"}},
     "init_info.master_address"),
    ("/init_weight_transfer_engine", {"init_info": {"packed": "yes"}}, "init_info.packed"),
    ("/update_weights", {"names": ["lm_head.weight"]}, "update_info"),
    ("/update_weights", {"update_info": {**GOOD, "dtype_names": []}},
     "update_info.dtype_names"),
    ("/update_weights", {"update_info": {**GOOD, "shapes": [[-1]]}}, "update_info.shapes.0.0"),
    ("/update_weights", {"update_info": {k: v for k, v in GOOD.items()
                                         if k != "ipc_handles_pickled"}},
     "update_info.ipc_handles_pickled"),
    ("/update_weights", {"update_info": {**GOOD, "ipc_handles": [{"x": [1, 2]}]}},
     "update_info.ipc_handles"),
    ("/update_weights", {"update_info": {**GOOD, "tensor_sizes": [1, 2]}},
     "update_info.tensor_sizes"),
    ("/update_weights", {"update_info": {**GOOD, "tensor_sizes": [-1]}},
     "update_info.tensor_sizes.0"),
    ("/update_weights", {"update_info": {**GOOD, "is_checkpoint_format": False}},
     "update_info.is_checkpoint_format"),
    ("/update_weights", {"update_info": {**GOOD, "update_kind": "sparse_flat"}},
     "update_info.update_kind"),
    ("/update_weights", {"update_info": {**GOOD, "num_updates_list": [1]}},
     "update_info.num_updates_list"),
    ("/update_weights", {"update_info": {**GOOD, "master_port": 1}},
     "update_info.master_port"),
])
def test_a_bad_body_is_a_400_naming_its_field(ipc_server, route, body, field) -> None:
    with ipc_server.client() as client:
        r = client.post(route, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field, r.text


def test_the_init_takes_an_empty_init_info_as_vllms_trainer_sends_it(ipc_server) -> None:
    with ipc_server.client() as client:
        for info in ({}, {"packed": True}):
            r = client.post("/init_weight_transfer_engine", json={"init_info": info})
            assert r.status_code == 200, r.text
            assert r.json() == {"message": "Weight transfer initialized"}
        config = client.get("/server_info", params={"config_format": "json"}).json()
        assert config["vllm_config"]["weight_transfer_config"] == {"backend": "ipc"}


def post(client: Any, info: dict[str, Any]) -> Any:
    return client.post("/update_weights", json={"update_info": info})


@pytest.mark.parametrize("fault", ["hostile", "unknown_name", "wrong_shape", "wrong_dtype",
                                   "no_gpu", "no_gpu_packed"])
def test_a_refused_update_is_a_400_and_the_old_weights_serve_on(
    ipc_server, checkpoints, fault, tmp_path
) -> None:
    specs = model_specs(checkpoints)
    if fault == "hostile":
        info = {**per_tensor(specs), "ipc_handles_pickled": b64(
            [{TRAINER_GPU: RunsACommand(tmp_path / "ran")}] * len(specs))}
        says = "posix.system"
    elif fault == "unknown_name":
        specs[2] = ("model.not_a_layer.weight", *specs[2][1:])
        info, says = per_tensor(specs), "not_a_layer"
    elif fault == "wrong_shape":
        name, dtype, shape = specs[2]
        info = per_tensor(specs)
        info["shapes"][2] = [*shape[:-1], shape[-1] + 1]  # the announcement the model refuses
        says = name
    elif fault == "wrong_dtype":
        info = per_tensor(specs)
        info["dtype_names"][2] = "bfloat16"  # the handle holds float32
        says = "but update_info announces bfloat16"
    elif fault == "no_gpu":
        info, says = per_tensor(specs), "runs on cpu, which has no GPU UUID"
    else:
        info, says = packed(specs), f"the handle is for GPU {TRAINER_GPU}"
    with ipc_server.client() as client:
        before = greedy(client)
        version = client.get("/get_weight_version").json()["weight_version"]
        r = post(client, info)
        assert r.status_code == 400 and says in r.text, r.text
        assert not (tmp_path / "ran").exists()
        assert client.get("/get_weight_version").json()["weight_version"] == version
        assert greedy(client) == before


def test_a_part_refused_inside_an_open_update_closes_it_and_the_old_weights_serve_on(
    ipc_server, checkpoints
) -> None:
    with ipc_server.client() as client:
        before = greedy(client)
        assert client.post("/start_weight_update", json={}).status_code == 200
        r = post(client, per_tensor(model_specs(checkpoints)))
        assert r.status_code == 400 and "runs on cpu" in r.text, r.text
        finish = client.post("/finish_weight_update", json={})
        assert finish.status_code == 409 and "no weight update is open" in finish.text
        assert greedy(client) == before
