"""vLLM's weight-transfer routes on a live ``kvrunner serve`` (``--weight-transfer-config
'{"backend": "nccl"}'``, gloo on the CPU), this test process as the trainer's rank 0:
a bad body is a 400 naming its field; an update refused before it loads anything
leaves the old weights serving; while an update is open nothing generates; a part
refused after an earlier part loaded leaves the weights partial until a full push."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import pytest
from test_update_group import free_port
from test_weight_routes import greedy
from trainer_process import checkpoint_tensors

from kvrunner.weight_sync.broadcaster import WeightBroadcaster


@pytest.mark.parametrize(("route", "body", "field"), [
    ("/init_weight_transfer_engine", {}, "init_info"),
    ("/init_weight_transfer_engine", {"init_info": {
        "master_address": "127.0.0.1", "rank_offset": 1, "world_size": 2}},
     "init_info.master_port"),
    ("/init_weight_transfer_engine", {"init_info": {
        "master_address": "127.0.0.1", "master_port": "x", "rank_offset": 1,
        "world_size": 2}}, "init_info.master_port"),
    ("/init_weight_transfer_engine", {"init_info": {
        "master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 1,
        "world_size": 2, "packed_buffer_size_bytes": 0}},
     "init_info.packed_buffer_size_bytes"),
    ("/init_weight_transfer_engine", {"init_info": {
        "master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 1,
        "world_size": 2, "bucket": 3}}, "init_info.bucket"),
    ("/update_weights", {"names": ["lm_head.weight"]}, "update_info"),
    ("/update_weights", {"update_info": {"names": ["a", "b"], "dtype_names": ["float32"],
                                         "shapes": [[1], [1]]}}, "update_info.dtype_names"),
    ("/update_weights", {"update_info": {"names": ["a"], "dtype_names": ["float32"],
                                         "shapes": [[1], [2]]}}, "update_info.shapes"),
    ("/update_weights", {"update_info": {"names": ["a"], "dtype_names": ["float32"],
                                         "shapes": [[-1]]}}, "update_info.shapes.0.0"),
    ("/update_weights", {"update_info": {"names": ["a"], "dtype_names": ["float32"],
                                         "shapes": [[1]], "update_kind": "sparse_flat"}},
     "update_info.update_kind"),
    ("/update_weights", {"update_info": {"names": ["a"], "dtype_names": ["float32"],
                                         "shapes": [[1]], "is_checkpoint_format": False}},
     "update_info.is_checkpoint_format"),
    ("/start_weight_update", {"is_checkpoint_format": False}, "is_checkpoint_format"),
    ("/finish_weight_update", {"weight_version": 3}, "weight_version"),
])
def test_a_bad_body_is_a_400_naming_its_field(server, route, body, field) -> None:
    with server.client() as client:
        r = client.post(route, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field, r.text


def test_an_update_before_any_init_is_a_400_naming_the_route_to_call(server) -> None:
    with server.client() as client:
        r = client.post("/update_weights", json={"update_info": {
            "names": ["lm_head.weight"], "dtype_names": ["float32"], "shapes": [[8, 8]]}})
        assert r.status_code == 400 and "/init_weight_transfer_engine" in r.text, r.text


class Trainer:
    """This process as rank 0 of the weight-update group, posting as TRL does."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.pool = concurrent.futures.ThreadPoolExecutor(1)
        port = free_port()
        self.sender = WeightBroadcaster("127.0.0.1", port, world_size=2, timeout_s=30)
        joined = self.pool.submit(client.post, "/init_weight_transfer_engine", json={
            "init_info": {"master_address": "127.0.0.1", "master_port": port,
                          "rank_offset": 1, "world_size": 2, "timeout_s": 30}})
        self.sender.connect()
        assert joined.result().status_code == 200, joined.result().text

    def update(self, pairs: list[tuple[str, Any]], *, broadcast: bool = True,
               **fields: Any) -> Any:
        names, dtypes, shapes = WeightBroadcaster.spec(pairs)
        answer = self.pool.submit(self.client.post, "/update_weights", json={
            "update_info": {"names": names, "dtype_names": dtypes, "shapes": shapes,
                            **fields}})
        if broadcast:
            self.sender.broadcast(pairs)
        return answer.result()

    def close(self) -> None:
        self.sender.close()
        self.pool.shutdown()


@pytest.fixture
def trainer_rank0(server):
    with server.client() as client:
        trainer = Trainer(client)
        yield trainer
        trainer.close()


def test_a_refused_update_loads_nothing_and_the_old_weights_serve_on(
    server, trainer_rank0, checkpoints
) -> None:
    client = trainer_rank0.client
    before = greedy(client)
    assert client.post("/start_weight_update", json={}).status_code == 200
    pairs = checkpoint_tensors(str(checkpoints.path(2)), 0)
    refused = trainer_rank0.update([("model.not_a_layer.weight", pairs[0][1]), *pairs[1:]],
                                   broadcast=False)
    assert refused.status_code == 400 and "not_a_layer" in refused.text, refused.text
    # the refused part closed the update: nothing loaded, the old weights serve
    assert greedy(client) == before
    finish = client.post("/finish_weight_update", json={})
    assert finish.status_code == 409 and "no weight update is open" in finish.text
    bad_dtype = client.post("/update_weights", json={"update_info": {
        "names": [pairs[0][0]], "dtype_names": ["int8"], "shapes": [list(pairs[0][1].shape)]}})
    assert bad_dtype.status_code == 400 and "int8" in bad_dtype.text, bad_dtype.text
    assert greedy(client) == before


def test_while_an_update_is_open_nothing_generates_and_its_end_serves_the_new_weights(
    server, trainer_rank0, checkpoints
) -> None:
    client = trainer_rank0.client
    pairs = checkpoint_tensors(str(checkpoints.path(2)), 0)
    assert client.post("/start_weight_update", json={}).status_code == 200
    again = client.post("/start_weight_update", json={})
    assert again.status_code == 409 and "a weight update is open" in again.text
    half = len(pairs) // 2
    part = trainer_rank0.update(pairs[:half])
    assert part.status_code == 200 and part.json()["loaded"] == half, part.text
    refused = client.post("/generate", json={"input_ids": [1, 2, 3],
                                             "sampling_params": {"max_new_tokens": 2}})
    assert refused.status_code == 409 and "a weight update is open" in refused.text
    assert client.post("/sleep").status_code == 409
    # the base fields vLLM's trainers add with asdict(update_info)
    part = trainer_rank0.update(pairs[half:], update_kind="dense", num_updates_list=None,
                                is_checkpoint_format=True)
    assert part.status_code == 200, part.text
    finish = client.post("/finish_weight_update", json={"weight_version": "v2"})
    assert finish.status_code == 200, finish.text
    assert client.get("/get_weight_version").json()["weight_version"] == "v2"
    assert greedy(client) == checkpoints.expected(2, "float32")


def test_a_part_refused_after_a_part_loaded_leaves_the_weights_partial_until_a_full_push(
    server, trainer_rank0, checkpoints
) -> None:
    client = trainer_rank0.client
    pairs = checkpoint_tensors(str(checkpoints.path(3)), 0)
    assert client.post("/start_weight_update", json={}).status_code == 200
    assert trainer_rank0.update(pairs[:4]).status_code == 200
    refused = trainer_rank0.update([("model.not_a_layer.weight", pairs[4][1])],
                                   broadcast=False)
    assert refused.status_code == 400 and "partial" in refused.text, refused.text
    generate = client.post("/generate", json={"input_ids": [1, 2, 3],
                                              "sampling_params": {"max_new_tokens": 2}})
    assert generate.status_code == 409 and "failed part way" in generate.text
    assert client.post("/finish_weight_update", json={}).status_code == 409
    # an update outside start/finish is one update by itself: a whole push repairs
    whole = trainer_rank0.update(pairs)
    assert whole.status_code == 200 and whole.json()["loaded"] == len(pairs), whole.text
    assert greedy(client) == checkpoints.expected(3, "float32")
