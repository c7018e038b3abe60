"""A weight push over a weight-update group (NCCL) from a trainer on another GPU.

Needs two GPUs: the trainer (group rank 0, a second process) holds Qwen3-8B-shaped
bf16 tensors on cuda:1 and broadcasts them with
:class:`kvrunner.weight_sync.broadcaster.WeightBroadcaster`; the engine on cuda:0
(``load_format="dummy"``, eager, a minimal pool) receives them with
``LLM.update_weights_from_distributed``. Timed on the engine side, end to end (every
tensor received and loaded), median of 3 pushes after a warm-up, against the
GPU-to-GPU copy rate measured in the same run (a 2 GiB ``copy_`` from cuda:1 to
cuda:0). One broadcast per tensor, as OpenRLHF's and slime's groups send them.

    python benchmarks/bench_weight_push_nccl.py
"""

from __future__ import annotations

import multiprocessing
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_weight_push_ipc import tensors, write_config

PUSHES = 4


def peer_copy_gbps(nbytes: int = 2 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    dst.copy_(src)
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize("cuda:1")
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize("cuda:1")
    return 5 * nbytes / (time.perf_counter() - start) / 1e9


def trainer(conn, port: int) -> None:
    from kvrunner.weight_sync.broadcaster import WeightBroadcaster

    torch.cuda.set_device(1)
    weights = tensors("cuda:1")
    conn.send((WeightBroadcaster.spec(weights), sum(t.numel() * t.element_size()
                                                    for _, t in weights)))
    sender = WeightBroadcaster("127.0.0.1", port, world_size=2, backend="nccl",
                               device="cuda:1")
    sender.connect()
    for _ in range(PUSHES):
        conn.recv()
        sender.broadcast(weights)
        torch.cuda.synchronize()


def main() -> None:
    from kvrunner import LLM

    if torch.cuda.device_count() < 2:
        print("needs two GPUs")
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=trainer, args=(child, port), daemon=True)
    process.start()
    spec, weight_bytes = conn.recv()
    rate = peer_copy_gbps()
    with tempfile.TemporaryDirectory() as tmp:
        write_config(Path(tmp) / "m")
        llm = LLM(model=str(Path(tmp) / "m"), dtype="bfloat16", load_format="dummy",
                  enforce_eager=True, max_num_seqs=1, max_model_len=256,
                  gpu_memory_utilization=0.4, skip_tokenizer_init=True)
        llm.init_weights_update_group("127.0.0.1", port, 1, 2, backend="nccl")
        times = []
        for _ in range(PUSHES):
            conn.send("go")
            start = time.perf_counter()
            llm.update_weights_from_distributed(*spec)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times[1:])
        print(f"{torch.cuda.get_device_name()}: {weight_bytes / 1e9:.1f} GB (Qwen3-8B shapes, "
              f"bf16) over NCCL in {seconds:.3f} s = {weight_bytes / seconds / 1e9:.0f} GB/s; "
              f"GPU-to-GPU copy {rate:.0f} GB/s; ratio {weight_bytes / seconds / 1e9 / rate:.2f}")
        llm.destroy_weights_update_group()
        llm.shutdown()
    process.join(30)


if __name__ == "__main__":
    sys.exit(main())
