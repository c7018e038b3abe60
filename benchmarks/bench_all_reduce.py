"""All-reduce inside a CUDA graph at decode sizes: NCCL vs torch symmetric memory.

Two GPUs of one host. Per size: a graph of 64 all-reduces is replayed 10 times and
the time per all-reduce printed, for NCCL (``dist.all_reduce``) and for the
copy-into-a-symmetric-buffer + one-shot / two-shot kernels the runner uses
(``kvrunner.distributed.symm_all_reduce``), each checked against NCCL's sum first.

    python benchmarks/bench_all_reduce.py
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = [(64, 1024), (64, 4096), (256, 1024), (256, 4096)]  # [batch, hidden] bf16
PER_GRAPH, REPLAYS = 64, 10


def run(rank: int, world: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    import torch.distributed._symmetric_memory as symm_mem

    name = dist.group.WORLD.group_name
    buf = symm_mem.empty(256 * 4096, dtype=torch.bfloat16, device=f"cuda:{rank}")
    symm_mem.rendezvous(buf, name)

    def nccl(x: torch.Tensor) -> None:
        dist.all_reduce(x)

    def one_shot(x: torch.Tensor) -> None:
        staged = buf[: x.numel()]
        staged.copy_(x.view(-1))
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", name, out=x.view(-1))

    def two_shot(x: torch.Tensor) -> None:
        staged = buf[: x.numel()]
        staged.copy_(x.view(-1))
        torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", name)
        x.view(-1).copy_(staged)

    for rows, hidden in SIZES:
        us = {}
        for label, fn in (("nccl", nccl), ("one_shot", one_shot), ("two_shot", two_shot)):
            torch.manual_seed(rank)
            x0 = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
            parts = [torch.empty_like(x0) for _ in range(world)]
            dist.all_gather(parts, x0)
            ref = sum(p.float() for p in parts)
            x = x0.clone()
            fn(x)
            torch.cuda.synchronize()
            err = (x.float() - ref).abs().max().item()
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                for _ in range(3):
                    fn(x)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(PER_GRAPH):
                    fn(x)
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(REPLAYS):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            us[label] = start.elapsed_time(end) / REPLAYS / PER_GRAPH * 1e3
            if rank == 0:
                print(f"[{rows},{hidden}] {label}: {us[label]:.1f} us/all-reduce, "
                      f"max err vs NCCL's sum {err:.3g}", flush=True)
        if rank == 0:
            best = min(us["one_shot"], us["two_shot"])
            print(f"[{rows},{hidden}] symmetric / NCCL: {best / us['nccl']:.2f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs 2 CUDA devices")
    mp.spawn(run, args=(2,), nprocs=2)
