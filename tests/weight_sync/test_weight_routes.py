"""``POST /update_weights_from_tensor`` on a live ``kvrunner serve``: the server
receives a whole push from a trainer's BucketSender in another process, then
generates what transformers does on the pushed weights; a malformed push answers 400
and leaves the server refusing to generate until a full push."""

from __future__ import annotations

import concurrent.futures

from test_checksum import digests
from test_generate_hf_parity import NEW_TOKENS, PROMPTS
from test_update_group import free_port
from trainer_process import checkpoint_tensors

from kvrunner.weight_sync.broadcaster import WeightBroadcaster


def greedy(client) -> list[list[int]]:
    outs = []
    for prompt in PROMPTS:
        r = client.post("/generate", json={"input_ids": prompt, "sampling_params": {
            "max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        outs.append(r.json()["output_ids"])
    return outs


def post_push(client, trainer, **job):
    address, authkey = trainer.start(**job)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(client.post, "/update_weights_from_tensor", json={
            "ipc_address": f"{address[0]}:{address[1]}", "ipc_authkey": authkey.hex(),
            "weight_version": "7", "timeout_s": 30}).result()
    return answer, trainer.result()


def test_a_push_over_http_lands_whole_and_a_malformed_one_leaves_the_server_refusing(
    server, trainer, checkpoints
) -> None:
    with server.client() as client:
        answer, said = post_push(client, trainer, path=checkpoints.path(2),
                                 bucket_bytes=512 * 64 * 4, dtype="bfloat16")
        assert answer.status_code == 200 and answer.json()["success"], answer.text
        assert said[0] == "pushed" and answer.json()["loaded"] == said[1]
        assert greedy(client) == checkpoints.expected(2, "bfloat16")
        checksum = client.get("/weights_checksum").json()["checksums"]
        assert checksum == digests(checkpoints.path(2), "bfloat16")

        answer, said = post_push(client, trainer, path=checkpoints.path(3), fault="past_the_end")
        assert answer.status_code == 400 and "run past the end" in answer.json()["message"]
        refused = client.post("/generate", json={"input_ids": PROMPTS[0]})
        assert refused.status_code == 409 and "failed part way" in refused.text

        answer, _ = post_push(client, trainer, path=checkpoints.path(3),
                              bucket_bytes=4 * 512 * 64 * 4)
        assert answer.status_code == 200, answer.text
        assert greedy(client) == checkpoints.expected(3, "float32")


def test_the_group_routes_join_receive_a_broadcast_push_and_leave(
    server, trainer, checkpoints
) -> None:
    port = free_port()
    path = str(checkpoints.path(2))
    with server.client() as client:
        trainer.conn.send({"path": path, "port": port, "world_size": 2})
        joined = client.post("/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 2, "backend": "gloo", "timeout_s": 30})
        assert joined.status_code == 200, joined.text
        assert trainer.result()[0] == "joined"
        names, dtypes, shapes = WeightBroadcaster.spec(checkpoint_tensors(path, 0))
        pushed = client.post("/update_weights_from_distributed", json={
            "names": names, "dtypes": dtypes, "shapes": shapes, "weight_version": "8"})
        assert pushed.status_code == 200 and pushed.json()["loaded"] == len(names), pushed.text
        assert trainer.result()[0] == "broadcast"
        assert client.post("/destroy_weights_update_group").status_code == 200
        assert greedy(client) == checkpoints.expected(2, "float32")
