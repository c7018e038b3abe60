"""vLLM's IPC weight transfer on a GPU: a trainer in a separate process on the same
GPU makes CUDA IPC handles of its tensors with torch's ``reduce_tensor``, in each of
the forms vLLM's senders (and SkyRL's) send: one ``{gpu_uuid: (rebuild_cuda_tensor,
args)}`` per tensor, one ``{gpu_uuid: args}`` per tensor, or one packed ``uint8``
buffer with ``tensor_sizes``. After the engine opens them, its greedy tokens are
those of the same engine loaded from the trainer's checkpoint (and not those it had
before); a handle for another GPU is refused naming both UUIDs and changes nothing.
With TP=2 each rank opens the handle of its own GPU (the trainer's per-GPU handles
merged, as vLLM's trainer engine merges its ranks')."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from push_kit import ENGINE, tokens
from test_weight_routes import greedy

from kvrunner import LLM
from kvrunner.weight_sync import WeightSyncError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

#: the trainer: torch and safetensors only, its handles made as vLLM's senders make them
_TRAINER = r"""
import base64, json, pickle, sys
import torch
from safetensors.torch import load_file
from torch.multiprocessing.reductions import reduce_tensor

path, form, devices = sys.argv[1], sys.argv[2], [int(d) for d in sys.argv[3].split(",")]
tensors = load_file(path + "/model.safetensors")
names = sorted(tensors)
held = []  # a trainer keeps its tensors alive until the engine has copied them


def uuid(index):
    if form == "other_gpu":
        return "00000000-0000-0000-0000-000000000000"
    return str(torch.cuda.get_device_properties(index).uuid)


info = {"names": names,
        "dtype_names": [str(tensors[n].dtype).split(".")[-1] for n in names],
        "shapes": [list(tensors[n].shape) for n in names]}
if form == "packed":  # vLLM's packed_ipc_producer: one reused uint8 buffer, bytes back to back
    handles = {}
    for d in devices:
        flat = [tensors[n].to(f"cuda:{d}").contiguous().view(torch.uint8).view(-1)
                for n in names]
        content = sum(f.numel() for f in flat)
        buffer = torch.empty(content + 4096, dtype=torch.uint8, device=f"cuda:{d}")
        buffer[:content].copy_(torch.cat(flat))
        held.append(buffer)
        handles[uuid(d)] = reduce_tensor(buffer)[1]
    info["tensor_sizes"] = [f.numel() for f in flat]
else:  # one handle per tensor, each dict merged over the trainer's GPUs
    handles = []
    for n in names:
        by_gpu = {}
        for d in devices:
            weight = tensors[n].to(f"cuda:{d}").detach().contiguous()
            held.append(weight)
            func, args = reduce_tensor(weight)
            by_gpu[uuid(d)] = (func, args) if form in ("func_args", "other_gpu") else args
        handles.append(by_gpu)
torch.cuda.synchronize()
info["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(handles)).decode("utf-8")
print(json.dumps(info), flush=True)
sys.stdin.readline()  # the engine has its copy
del handles
held.clear()
torch.cuda.ipc_collect()
"""


class TrainerProcess:
    """The trainer, in its own process; :attr:`info` is its ``update_info``."""

    def __init__(self, path: Any, form: str, devices: str = "0") -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _TRAINER, str(path), form, devices],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.process.stdout.readline()
        assert line, "the trainer died before sending its handles"
        self.info: dict[str, Any] = json.loads(line)

    def done(self) -> None:
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        assert self.process.wait(60) == 0


def push(llm: LLM, info: dict[str, Any]) -> int:
    return llm.update_weights_from_ipc_handles(
        info["names"], info["dtype_names"], info["shapes"],
        ipc_handles_pickled=info["ipc_handles_pickled"], tensor_sizes=info.get("tensor_sizes"))


#: the engines share the GPU with the trainer (and each other; conftest's
#: ``gpu_ipc_server`` takes as much)
MEMORY = 0.3


@pytest.fixture(scope="module")
def gpu_llm(checkpoints) -> Iterator[LLM]:
    engine = LLM(model=str(checkpoints.path(1)),
                 gpu_memory_utilization=MEMORY, **ENGINE)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def pushed_tokens(gpu_llm, checkpoints) -> list[list[int]]:
    """The engine's tokens loaded from the trainer's checkpoint (seed 2)."""
    gpu_llm.load_weights(checkpoints.path(2))
    expected = tokens(gpu_llm)
    gpu_llm.load_weights(checkpoints.path(1))
    assert tokens(gpu_llm) != expected  # the push below must change the tokens
    return expected


@pytest.mark.parametrize("form", ["func_args", "args", "packed"])
def test_the_engine_serves_the_weights_behind_the_trainers_handles(
    gpu_llm, checkpoints, pushed_tokens, form
) -> None:
    gpu_llm.load_weights(checkpoints.path(1))
    trainer = TrainerProcess(checkpoints.path(2), form)
    try:
        assert push(gpu_llm, trainer.info) == len(trainer.info["names"])
    finally:
        trainer.done()
    # the copies are the engine's: the trainer's memory is gone
    assert tokens(gpu_llm) == pushed_tokens


def test_a_handle_for_another_gpu_is_refused_naming_both_uuids(
    gpu_llm, checkpoints, pushed_tokens
) -> None:
    gpu_llm.load_weights(checkpoints.path(1))
    before, version = tokens(gpu_llm), gpu_llm.weight_version
    own = str(torch.cuda.get_device_properties(0).uuid)
    trainer = TrainerProcess(checkpoints.path(2), "other_gpu")
    try:
        with pytest.raises(WeightSyncError, match=rf"GPU {own} .*handle is for GPU "
                                                  rf"00000000-0000-0000-0000-000000000000"):
            push(gpu_llm, trainer.info)
    finally:
        trainer.done()
    assert gpu_llm.cache_info().weights == "resident"
    assert gpu_llm.weight_version == version
    assert tokens(gpu_llm) == before


def test_over_http_as_vllms_client_posts_it(gpu_ipc_server, checkpoints) -> None:
    """init, start, update, finish as vLLM's HTTP client posts them, against the same
    server loaded from the trainer's checkpoint."""
    with gpu_ipc_server.client() as client:
        loaded = client.post("/update_weights_from_disk",
                             json={"model_path": str(checkpoints.path(2))})
        assert loaded.status_code == 200, f"{loaded.text}\n{gpu_ipc_server.log()}"
        expected = greedy(client)
        for form in ("args", "packed"):
            client.post("/update_weights_from_disk",
                        json={"model_path": str(checkpoints.path(1))})
            assert greedy(client) != expected
            trainer = TrainerProcess(checkpoints.path(2), form)
            try:
                assert client.post("/init_weight_transfer_engine",
                                   json={"init_info": {}}).status_code == 200
                assert client.post("/start_weight_update").status_code == 200
                r = client.post("/update_weights", json={"update_info": trainer.info})
                assert r.status_code == 200, f"{r.text}\n{gpu_ipc_server.log()}"
                assert r.json()["loaded"] == len(trainer.info["names"])
                assert client.post("/finish_weight_update",
                                   json={"weight_version": f"ipc-{form}"}).status_code == 200
            finally:
                trainer.done()
            assert greedy(client) == expected, form
            version = client.get("/get_weight_version").json()["weight_version"]
            assert version == f"ipc-{form}"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("form", ["func_args", "packed"])
def test_with_tp2_each_rank_opens_the_handle_of_its_own_gpu(checkpoints, form) -> None:
    with LLM(model=str(checkpoints.path(1)), tensor_parallel_size=2,
             gpu_memory_utilization=MEMORY, **ENGINE) as llm:
        llm.load_weights(checkpoints.path(2))
        expected = tokens(llm)
        llm.load_weights(checkpoints.path(1))
        assert tokens(llm) != expected
        trainer = TrainerProcess(checkpoints.path(2), form, devices="0,1")
        try:
            assert push(llm, trainer.info) == len(trainer.info["names"])
        finally:
            trainer.done()
        assert tokens(llm) == expected
