"""Run under ``torchrun --nproc-per-node 2 ... DTYPE`` on two GPUs: the symmetric
all-reduce against NCCL's, eagerly and replayed from a CUDA graph. Rank 0 prints one
JSON line. One dtype per run, as in a runner: one symmetric buffer per process.

Sizes cross the one-shot / two-shot threshold and the buffer's limit (which falls
back to NCCL); dtypes are the two the kernels take.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import sys

import torch
import torch.distributed as dist

from kvrunner.distributed import symm_all_reduce
from kvrunner.distributed.group import DistGroup

SHAPES = [(1, 64), (64, 1024), (64, 4096), (256, 4096), (1024, 4096), (2048, 4096)]


def main() -> None:
    # A hang is a failure: dump every thread's stack and exit rather than wait.
    faulthandler.dump_traceback_later(60, exit=True)
    store, rank, world = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=60)))
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    group = DistGroup.init(rank=rank, size=world, device=device, backend="nccl",
                           timeout_s=60, store=store)
    results = []
    dtype = getattr(torch, sys.argv[1])
    tp = group.tp_group(dtype=dtype, all_reduce="symm_mem")
    for shape in SHAPES:
        torch.manual_seed(rank * 1000 + shape[0])
        x = torch.randn(shape, device=device, dtype=dtype)
        expected = x.clone()
        dist.all_reduce(expected)  # NCCL
        eager = tp.all_reduce(x.clone())
        # The same reduction captured in a graph, replayed on fresh input.
        static = torch.zeros_like(x)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            tp.all_reduce(static.clone())
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = tp.all_reduce(static)
        static.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        nbytes = x.numel() * x.element_size()
        print(f"rank {rank}: {dtype} {shape} done", flush=True)
        results.append({
            "dtype": str(dtype), "shape": list(shape),
            "path": "symm_mem" if nbytes <= symm_all_reduce.MAX_BYTES else "nccl",
            "eager_err": float((eager.float() - expected.float()).abs().max()),
            "graph_err": float((replayed.float() - expected.float()).abs().max()),
            "scale": float(expected.float().abs().max()),
        })
    if rank == 0:
        print(json.dumps({"impl": group.all_reduce_impl, "results": results}), flush=True)
    print(f"rank {rank}: leaving the group", flush=True)
    group.destroy()


if __name__ == "__main__":
    main()
