"""The RL trainers' own weight pushes against a live ``kvrunner serve``: AReaL's and
slime's process-group rendezvous and broadcasts (gloo), slime's flattened tensor
buckets and SGLang's (name, tensor) lists in shared memory, TRL's calls of vLLM's
weight-transfer routes with vLLM's packed broadcasts (gloo), each replayed from the
peer's source in a process of its own (tests/weight_sync/peer_trainers.py, the
commits cited there). After each push the server's greedy tokens equal a fresh
engine's on the pushed weights, and the weight version is the one pushed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from push_kit import ENGINE, GREEDY, SERVER_KEY
from test_generate_hf_parity import PROMPTS
from test_update_group import free_port
from test_weight_routes import greedy
from trainer_process import checkpoint_tensors

TRAINER = Path(__file__).with_name("peer_trainers.py")


def run_trainer(server, tmp: Path, **job: Any) -> list[dict[str, Any]]:
    """Run one peer's push to completion; its steps, as it printed them. Its output
    goes to files, not pipes: torch's shared-memory manager, which the trainer
    starts, outlives it while the server holds a mapping and would hold a pipe open."""
    job = {"url": server.url, "api_key": SERVER_KEY, **job}
    out, err = tmp / f"{job['peer']}.out", tmp / f"{job['peer']}.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        code = subprocess.run([sys.executable, str(TRAINER), json.dumps(job)],
                              stdout=stdout, stderr=stderr, timeout=180).returncode
    assert code == 0, err.read_text()[-3000:]
    steps = [json.loads(line) for line in out.read_text().splitlines()
             if line.startswith("{")]
    assert steps[-1] == {"step": "done"}
    return steps[:-1]


def fresh_engine_tokens(source: Path, tmp: Path, mixed: bool) -> list[list[int]]:
    """A fresh engine's greedy tokens on exactly the tensors the trainer pushed."""
    from peer_trainers import pushed_tensors
    from safetensors.torch import save_file

    from kvrunner import LLM

    target = tmp / f"pushed-{source.name}-{mixed}"
    if not target.exists():
        shutil.copytree(source, target)
        save_file({n: t.float().contiguous() for n, t in pushed_tensors(str(source), mixed)},
                  target / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(model=str(target), **ENGINE)
    try:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.shutdown()


def weight_version(client) -> str:
    return client.get("/get_weight_version").json()["weight_version"]


@pytest.mark.parametrize("peer", ["areal", "slime_group"])
def test_a_trainers_own_group_is_joined_and_its_broadcasts_land(
    peer, server, checkpoints, tmp_path
) -> None:
    path = checkpoints.path(2 if peer == "areal" else 3)
    with server.client() as client:
        before = greedy(client)
        steps = run_trainer(server, tmp_path, peer=peer, path=str(path), port=free_port(),
                            world_size=2, chunks=3)
        assert steps[0]["answer"]["success"] is True
        assert [s["step"] for s in steps] == ["init", "chunk", "chunk", "chunk"]
        assert sum(s["answer"]["loaded"] for s in steps[1:]) == \
            len(checkpoint_tensors(str(path), 0))
        after = greedy(client)
        if peer == "slime_group":
            assert weight_version(client) == "1"
    assert after != before
    assert after == fresh_engine_tokens(path, tmp_path, mixed=False)


@pytest.mark.parametrize(("packing", "calls", "buffer_bytes"), [
    ("init", "weight_update", 1024 ** 3),   # TRL on vLLM >= 0.28, one param per update
    ("init", "model", 4096),                # update_model_params, many packed chunks
    ("legacy", "model", 4096),              # TRL on vLLM < 0.28: packed per update
    ("unpacked", "model", 0),               # vLLM's default: one broadcast per tensor
])
def test_trls_weight_transfer_calls_land_as_one_update_each(
    packing, calls, buffer_bytes, server, checkpoints, tmp_path
) -> None:
    path = checkpoints.path(5)
    with server.client() as client:
        before = greedy(client)
        steps = run_trainer(server, tmp_path, peer="trl_vllm", path=str(path), mixed=True,
                            port=free_port(), packing=packing, calls=calls,
                            buffer_bytes=buffer_bytes, version="trl-1")
        assert steps[0]["answer"] == {"message": "Weight transfer initialized"}
        parts = [s["answer"] for s in steps[1:-1]]
        assert sum(p["loaded"] for p in parts) == len(checkpoint_tensors(str(path), 0))
        assert steps[-1]["answer"] == {"message": "Weight update finished"}
        after = greedy(client)
        if calls == "weight_update":
            assert weight_version(client) == "trl-1"
        restored = client.post("/update_weights_from_disk",
                               json={"model_path": str(checkpoints.path(1))})
        assert restored.status_code == 200, restored.text
    assert after != before
    assert after == fresh_engine_tokens(path, tmp_path, mixed=True)


@pytest.mark.parametrize(("peer", "mixed", "as_bytes"), [
    ("slime_tensor", True, True),     # SGLang's multi-dtype bucket (bytes)
    ("slime_tensor", True, False),    # the older writer: one bucket per dtype
    ("sglang_pairs", True, True),     # SGLang's plain (name, tensor) list
])
def test_serialized_named_tensors_in_shared_memory_land_as_sglang_loads_them(
    peer, mixed, as_bytes, server, checkpoints, tmp_path
) -> None:
    path = checkpoints.path(4)
    with server.client() as client:
        steps = run_trainer(server, tmp_path, peer=peer, path=str(path), mixed=mixed,
                            as_bytes=as_bytes, chunks=3)
        assert all(s["answer"]["success"] for s in steps)
        assert greedy(client) == fresh_engine_tokens(path, tmp_path, mixed)
        assert weight_version(client) == ("1" if peer == "slime_tensor" else "pairs")
        # the next push starts from other weights, so each case proves its own
        restored = client.post("/update_weights_from_disk",
                               json={"model_path": str(checkpoints.path(1))})
        assert restored.status_code == 200, restored.text


def test_a_payload_that_would_run_a_command_is_a_400_and_changes_nothing(
    server, tmp_path
) -> None:
    import base64
    import pickle

    from test_tensor_unpickler import RunsACommand

    marker = tmp_path / "ran"
    hostile = base64.b64encode(pickle.dumps([("model.norm.weight", RunsACommand(marker))]))
    with server.client() as client:
        before, version = greedy(client), weight_version(client)
        answer = client.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": [hostile.decode()], "weight_version": "evil"})
        assert answer.status_code == 400
        assert answer.json()["success"] is False
        assert "posix.system" in answer.json()["message"]
        assert answer.json()["error"]["param"] == "serialized_named_tensors"
        assert (greedy(client), weight_version(client)) == (before, version)
    assert not marker.exists()


def test_a_body_of_neither_form_or_both_or_an_unknown_load_format_is_a_400_naming_it(
    server
) -> None:
    with server.client() as client:
        version = weight_version(client)
        for body, param in [
            ({"serialized_named_tensors": ["eA=="], "load_format": "safetensors"},
             "load_format"),
            ({"serialized_named_tensors": ["eA=="], "ipc_address": "127.0.0.1:1",
              "ipc_authkey": "00"}, "ipc_address"),
            ({"weight_version": "3"}, "ipc_address"),
            ({"serialized_named_tensors": []}, "serialized_named_tensors"),
            ({"serialized_named_tensors": ["eA=="], "disable_draft_model": True},
             "disable_draft_model"),
        ]:
            answer = client.post("/update_weights_from_tensor", json=body)
            assert answer.status_code == 400, (body, answer.text)
            assert answer.json()["error"]["param"] == param, (body, answer.text)
        assert weight_version(client) == version
