"""A colocated trainer gets its GPU memory back: after ``close()`` (or the ``with``
block) each sender holds no CUDA memory, and once the trainer drops its tensors its
allocated memory is back at the level before it made them, though the engine mapped
them (direct push) or the senders' buffers (bucket push) through CUDA IPC.

The trainer is a separate process on the same GPU, as in a colocated RL job; the
engine pushes are real ``update_weights_from_ipc`` calls.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kvrunner import LLM, SamplingParams
from kvrunner.models.tiny import write_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

_TRAINER = """
import json, sys, torch
from safetensors.torch import load_file
from kvrunner.weight_sync import BucketSender, DirectSender

def say(*what):
    print(json.dumps(what), flush=True)

torch.cuda.init()
base = torch.cuda.memory_allocated()
# compared to the byte: a tensor or buffer left behind shows whatever its size
weights = [(n, t.cuda()) for n, t in load_file(sys.argv[1] + "/model.safetensors").items()]
held = torch.cuda.memory_allocated()
for kind in ("direct", "bucket"):
    sender = (DirectSender(device="cuda", chunk_bytes=1 << 20) if kind == "direct"
              else BucketSender(device="cuda", bucket_bytes=1 << 20))
    with sender:
        say("listening", kind, list(sender.address), sender.authkey.hex())
        for _ in range(2):
            sender.push(weights)
    say("closed", kind, torch.cuda.memory_allocated() - held)
del sender
weights.clear()
torch.cuda.ipc_collect()
say("freed", torch.cuda.memory_allocated() - base)
"""


def test_after_close_and_dropping_its_tensors_the_trainer_holds_what_it_held_before(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "m", kind="qwen3", seed=3)
    with LLM(model=str(path), enforce_eager=True, max_num_seqs=2,
             gpu_memory_utilization=0.3) as llm:
        trainer = subprocess.Popen([sys.executable, "-c", _TRAINER, str(path)],
                                   stdout=subprocess.PIPE, text=True)
        try:
            for kind in ("direct", "bucket"):
                said, told, address, key = json.loads(trainer.stdout.readline())
                assert (said, told) == ("listening", kind)
                for _ in range(2):
                    assert llm.update_weights_from_ipc(tuple(address),
                                                       authkey=bytes.fromhex(key)) > 0
                said, told, left = json.loads(trainer.stdout.readline())
                assert (said, told) == ("closed", kind)
                assert left == 0, f"the {kind} sender holds {left} bytes after close()"
            assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids
            said, left = json.loads(trainer.stdout.readline())
            assert said == "freed"
            assert left == 0, f"the trainer still holds {left} bytes after dropping its tensors"
        finally:
            trainer.wait(60)
    assert trainer.returncode == 0
