"""A colocated trainer pushing in a peer's own format gets its GPU memory back, and
the engine serves what it pushed.

The trainer, a separate process on the same GPU, pushes twice in each format as the
peer's sender makes it, several chunks per push:

- vLLM's packed IPC transfer (``packed_ipc_producer``): one ``uint8`` buffer per
  transfer, shared once by ``reduce_tensor``, the same handle sent with every chunk
  packed into it, between ``start_weight_update`` and ``finish_weight_update``;
- vLLM's per-tensor IPC transfer: each tensor's own handle, one update;
- SkyRL's packed chunks: a new buffer of the weights' one dtype per chunk, each
  shared once, in one update;
- slime's colocated push: one new flattened bucket per chunk, serialised as SGLang's
  ``MultiprocessingSerializer`` (``peer_trainers.py``'s), one
  ``update_weights_from_tensor`` each.

After each format, once the engine has ended its last update, the trainer drops what
it made for the pushes and collects its IPC blocks (``ipc_collect``): its allocated
memory is back to the byte where it was before, which holds only when the engine
released every share exactly once.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvrunner import LLM, SamplingParams
from kvrunner.models.tiny import write_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

KINDS = ("vllm-packed", "vllm", "skyrl", "slime")
PUSHES = 2

_TRAINER = r"""
import base64, json, pickle, sys
import torch
from safetensors.torch import load_file
from torch.multiprocessing.reductions import reduce_tensor

sys.path.insert(0, sys.argv[4])
from peer_trainers import flattened_bucket, serialize, sglang_metadata_class

def say(*what):
    print(json.dumps(what), flush=True)

def answered():
    assert sys.stdin.readline().strip() == "ok"

def info(pairs):
    return {"names": [n for n, _ in pairs],
            "dtype_names": [str(t.dtype).split(".")[-1] for _, t in pairs],
            "shapes": [list(t.shape) for _, t in pairs]}

def b64pickle(obj):
    return base64.b64encode(pickle.dumps(obj)).decode()

def chunks(pairs, limit):
    out, size = [[]], 0
    for name, t in pairs:
        if out[-1] and size + t.nbytes > limit:
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += t.nbytes
    return out

metadata = sglang_metadata_class()
torch.cuda.init()
weights = sorted((n, t.cuda()) for n, t in load_file(sys.argv[1] + "/model.safetensors").items())
held = torch.cuda.memory_allocated()
total = sum(t.nbytes for _, t in weights)
limit = max(max(t.nbytes for _, t in weights), total // 4)  # several chunks a push
uuid = str(torch.cuda.get_device_properties(0).uuid)
for kind in sys.argv[2].split(","):
    for _ in range(int(sys.argv[3])):
        if kind == "vllm-packed":  # one buffer a transfer, shared once, reused per chunk
            buffer = torch.empty(limit, dtype=torch.uint8, device="cuda")
            handle = {uuid: reduce_tensor(buffer)[1]}
            for chunk in chunks(weights, limit):
                at = 0
                for _, t in chunk:
                    buffer[at:at + t.nbytes].copy_(t.contiguous().view(torch.uint8).view(-1))
                    at += t.nbytes
                torch.cuda.current_stream().synchronize()
                say("update", dict(info(chunk), tensor_sizes=[t.nbytes for _, t in chunk],
                                   ipc_handles_pickled=b64pickle(handle)))
                answered()
            del buffer, handle
        elif kind == "skyrl":  # a new buffer of the one dtype per chunk, sizes in elements
            for chunk in chunks(weights, limit):
                flat = torch.cat([t.flatten() for _, t in chunk])
                handle = {uuid: reduce_tensor(flat)}
                torch.cuda.current_stream().synchronize()
                say("update", dict(info(chunk), element_sizes=[t.numel() for _, t in chunk],
                                   ipc_handles_pickled=b64pickle(handle)))
                answered()
                del flat, handle
        elif kind == "vllm":  # each tensor's own handle, one update
            handles = [{uuid: reduce_tensor(t.detach().contiguous())[1]} for _, t in weights]
            say("update", dict(info(weights), ipc_handles_pickled=b64pickle(handles)))
            answered()
            del handles
        else:  # slime: a new flattened bucket per chunk, dropped once answered
            for chunk in chunks(weights, limit):
                bucket = flattened_bucket(chunk, metadata, as_bytes=True)
                say("tensor", serialize(bucket))
                answered()
                del bucket
                torch.cuda.ipc_collect()
        say("pushed")
        answered()  # the engine has ended the update (finish_weight_update)
    torch.cuda.ipc_collect()
    say("closed", kind, torch.cuda.memory_allocated() - held)
"""


def _engine_side(llm: LLM, trainer: subprocess.Popen, kind: str) -> int:
    """Answer one kind's pushes as the peer's engine does; the bytes the trainer still
    holds after them."""
    for _ in range(PUSHES):
        if kind != "slime":
            llm.start_weight_update()
        while (said := json.loads(trainer.stdout.readline()))[0] != "pushed":
            if said[0] == "update":
                assert llm.update_weights_from_ipc_handles(**said[1]) > 0
            else:
                assert llm.update_weights_from_tensor([said[1]], "flattened_bucket") > 0
            trainer.stdin.write("ok\n")
            trainer.stdin.flush()
        if kind != "slime":
            llm.finish_weight_update()
        trainer.stdin.write("ok\n")
        trainer.stdin.flush()
    said, told, left = json.loads(trainer.stdout.readline())
    assert (said, told) == ("closed", kind)
    return left


@pytest.mark.parametrize("kind", KINDS)
def test_the_trainer_gets_its_memory_back_and_the_engine_serves_its_push(tmp_path, kind):
    old = write_tiny_checkpoint(tmp_path / "old", kind="qwen3", seed=3)
    new = write_tiny_checkpoint(tmp_path / "new", kind="qwen3", seed=4)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[1, 2, 3, 4], [9, 8, 7]]
    settings = dict(enforce_eager=True, max_num_seqs=2, gpu_memory_utilization=0.3)
    with LLM(model=str(new), **settings) as ref:
        expected = [o.token_ids for o in ref.generate(prompts, greedy)]
    with LLM(model=str(old), **settings) as llm:
        assert [o.token_ids for o in llm.generate(prompts, greedy)] != expected
        trainer = subprocess.Popen([sys.executable, "-c", _TRAINER, str(new), kind,
                                    str(PUSHES), str(Path(__file__).parent)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            left = _engine_side(llm, trainer, kind)
            assert [o.token_ids for o in llm.generate(prompts, greedy)] == expected
        finally:
            trainer.stdin.close()
            trainer.wait(60)
    assert trainer.returncode == 0
    assert left == 0, f"after {kind} pushes the trainer still holds {left} bytes"
