"""Sleep, wake, recapture and weight pushes, as an RL trainer drives them.

Random bf16 checkpoints shaped like Qwen3-0.6B and Qwen3-8B (tied embeddings), one
H200, pools sized at ``gpu_memory_utilization=0.6``, decode graphs for batch sizes
up to 256. For each sleep kind (level 1; level 2 offloading to pinned host memory;
level 2 discarding, then pushing the weights back the way verl does:
``wake_up(["weights"])``, ``update_weights``, ``wake_up(["kv_cache"])``) the
median of 3 cycles of: sleep seconds, MiB returned to the device, wake seconds
(allocation plus recapture) and the recapture alone.

Also: ``update_weights`` throughput from device tensors and from host tensors, each
against its copy bandwidth measured in the same run; the capture audit's checksum
pass over the whole pool against the HBM floor (pool bytes / copy bandwidth); and
a capture with the audit on against one with it off.

Anchor: vLLM reports a level-1 wake of 0.26 s for Qwen3-0.6B on an A100, without
recapture (its graphs survive at the same virtual addresses).

Host tensors are pushed twice: pageable (a trainer's CPU state dict: each tensor
is staged through pinned chunks, ``layers/weight_copy.py``) and pinned.

``--kept`` records the allocator's history and, after a level-2 sleep, prints each
device segment still reserved with the live blocks that hold it (size and the
allocating frames), to say what a sleep could not return.

    python benchmarks/bench_sleep_wake.py [0.6B] [8B] [--push-only] [--kept]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import attrs
import torch
from bench_e2e_decode import SHAPE, release_memory, write_checkpoint
from bench_tp_decode import SHAPES
from common import copy_bandwidth_tbps

from kvrunner import LLM, SamplingParams
from kvrunner.layers import weight_copy
from kvrunner.models.loader import iter_safetensors
from kvrunner.runner.capture.capture_safety import PoolSnapshot

MiB = 1 << 20
OURS = str(Path(__file__).resolve().parents[1])  # frames of this repository's files
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
KINDS = (("level 1", 1, False), ("level 2 offload", 2, False), ("level 2 discard+push", 2, True))


def synced(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, out


def host_to_device_gbps(nbytes: int = 1 << 30) -> float:
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(pinned, non_blocking=True)
    seconds, _ = synced(lambda: dev.copy_(pinned, non_blocking=True))
    return nbytes / seconds / 1e9


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(1, SHAPE["vocab"], (n, 64), generator=g).tolist()


def cycle(llm: LLM, level: int, discard: bool, push: list) -> dict[str, float]:
    sleep_s = llm.sleep(level, discard_weights=discard)
    freed = llm.cache_info().last_freed_bytes
    push_s = 0.0
    if discard:
        wake_s, _ = synced(lambda: llm.wake_up(["weights"]))
        push_s, _ = synced(lambda: llm.update_weights(push))
        kv_s, _ = synced(lambda: llm.wake_up(["kv_cache"]))
        wake_s += kv_s
    else:
        wake_s, _ = synced(llm.wake_up)
    info = llm.cache_info()
    return {"sleep": sleep_s, "freed": freed, "wake": wake_s,
            "recapture": info.last_recapture_s, "push": push_s}


def print_kept_segments(limit: int = 12) -> None:
    """The segments a sleep left reserved, largest first, with their live blocks."""
    segments = torch.cuda.memory._snapshot()["segments"]
    kept = sorted(segments, key=lambda s: -s["total_size"])
    total = sum(s["total_size"] for s in kept)
    live = sum(s["allocated_size"] for s in kept)
    print(f"  still reserved: {len(kept)} segments, {total / MiB:.0f} MiB, of which "
          f"{live / MiB:.1f} MiB live blocks")
    for seg in kept[:limit]:
        blocks = [b for b in seg["blocks"] if b["state"] == "active_allocated"]
        print(f"  segment {seg['total_size'] / MiB:9.1f} MiB, pool {seg['segment_pool_id']}, "
              f"{len(blocks)} live blocks, {seg['allocated_size'] / MiB:.2f} MiB live")
        for block in sorted(blocks, key=lambda b: -b["size"])[:3]:
            frames = [f"{Path(f['filename']).name}:{f['line']}:{f['name']}"
                      for f in block.get("frames", []) if OURS in f["filename"]]
            print(f"    {block['size'] / MiB:8.2f} MiB  {' < '.join(frames[:4]) or '?'}")


def bench(name: str, root: Path, push_only: bool, kept: bool = False) -> None:
    path = root / f"qwen3-{name}-random"
    weight_bytes = write_checkpoint(path, SHAPES[name])
    llm = LLM(model=str(path), dtype="bfloat16", max_num_seqs=256, max_model_len=256,
              max_num_batched_tokens=8192, gpu_memory_utilization=0.6)
    reference = [o.token_ids for o in llm.generate(prompts(32), GREEDY)]
    info = llm.cache_info()
    pool_bytes = info.pool_bytes
    graphs = len(llm.runner.graph_capture.graphs)
    print(f"\n== {name}: weights {weight_bytes / 1e9:.2f} GB, pool {pool_bytes / 1e9:.1f} GB "
          f"({info.num_blocks} blocks), {graphs} decode graphs", flush=True)
    device_push = [(n, t.cuda()) for n, t in iter_safetensors(path, torch.bfloat16)]
    if push_only:
        push_rates(llm, path, weight_bytes, device_push)
        llm.shutdown()
        release_memory()
        return
    if kept:
        llm.sleep(2)
        print_kept_segments()
        llm.wake_up()
    print(f"{'sleep kind':>22} {'sleep s':>8} {'MiB freed':>10} {'wake s':>7} "
          f"{'recapture s':>12} {'alloc s':>8} {'same answers':>13} {'freed - released MiB':>21}")
    for label, level, discard in KINDS:
        runs = [cycle(llm, level, discard, device_push) for _ in range(3)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        same = [o.token_ids for o in llm.generate(prompts(32), GREEDY)] == reference
        # what the sleep released: the pools, and at level 2 the weights too (the
        # graphs' memory comes on top, so a sleep that returns it all is positive)
        released = pool_bytes + (weight_bytes if level == 2 else 0)
        print(f"{label:>22} {med['sleep']:>8.3f} {med['freed'] / MiB:>10.0f} "
              f"{med['wake']:>7.3f} {med['recapture']:>12.3f} "
              f"{med['wake'] - med['recapture'] - med['push']:>8.3f} {str(same):>13} "
              f"{(med['freed'] - released) / MiB:>+21.0f}", flush=True)
    push_rates(llm, path, weight_bytes, device_push)
    del device_push
    copy_bw = copy_bandwidth_tbps() * 1e12
    # the capture audit: one checksum pass over every pool, and a capture with it on
    pools = llm.runner.cache.pools
    PoolSnapshot(pools)
    pass_s, _ = synced(lambda pools=pools: PoolSnapshot(pools))
    floor_s = pool_bytes / copy_bw
    print(f"checksum pass over {pool_bytes / 1e9:.1f} GB of pools: {pass_s * 1e3:.1f} ms, "
          f"{pool_bytes / pass_s / 1e12:.2f} TB/s = {pass_s / floor_s:.2f}x the HBM floor")
    runner = llm.runner
    plain_s = llm.recapture()
    runner.config = attrs.evolve(runner.config,
                                 capture=attrs.evolve(runner.config.capture, audit=True))
    audited_s = llm.recapture()
    print(f"capture of {graphs} graphs: {plain_s:.3f} s without the audit, {audited_s:.3f} s "
          f"with it (+{(audited_s - plain_s) * 1e3:.0f} ms, {graphs + 1} checksum passes)")
    del runner, pools  # the runner holds the pools: drop every reference before shutdown
    llm.shutdown()
    release_memory()


def push_rates(llm: LLM, path: Path, weight_bytes: int, device_push: list) -> None:
    """``update_weights`` throughput, in verl's order (no recapture inside the timing),
    from device, pageable host and pinned host tensors, each against its copy rate."""
    copy_bw = copy_bandwidth_tbps() * 1e12
    h2d = host_to_device_gbps()
    pageable = [(n, t.contiguous()) for n, t in iter_safetensors(path, torch.bfloat16)]
    pinned = [(n, t.pin_memory()) for n, t in pageable]
    reference = [o.token_ids for o in llm.generate(prompts(8), GREEDY)]
    min_bytes = weight_copy.STAGE_MIN_BYTES
    for label, push, peer in (("device tensors", device_push, copy_bw / 1e9 / 2),
                              ("host tensors (pageable)", pageable, h2d),
                              ("host tensors (pageable, unstaged)", pageable, h2d),
                              ("host tensors (pinned)", pinned, h2d)):
        # "unstaged": every tensor below the staging threshold: one pageable copy each
        weight_copy.STAGE_MIN_BYTES = 1 << 62 if "unstaged" in label else min_bytes
        llm.sleep(2, discard_weights=True)
        llm.wake_up(["weights"])
        seconds, _ = synced(lambda push=push: llm.update_weights(push))
        llm.wake_up(["kv_cache"])
        same = [o.token_ids for o in llm.generate(prompts(8), GREEDY)] == reference
        gbps = weight_bytes / seconds / 1e9
        print(f"update_weights from {label}: {seconds:.3f} s, {gbps:.1f} GB/s = "
              f"{gbps / peer:.2f}x the {label.split()[0]} copy bandwidth ({peer:.0f} GB/s); "
              f"same answers after: {same}", flush=True)
    weight_copy.STAGE_MIN_BYTES = min_bytes


def main() -> None:
    push_only = "--push-only" in sys.argv
    kept = "--kept" in sys.argv
    if kept:
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    names = [a for a in sys.argv[1:] if not a.startswith("--")] or ["0.6B", "8B"]
    root = Path(tempfile.mkdtemp())
    for name in names:
        bench(name, root, push_only, kept)
    print("\nanchor: vLLM level-1 wake 0.26 s (Qwen3-0.6B, A100, no recapture); "
          "aim: wake + recapture < 0.5 s at 0.6B")


if __name__ == "__main__":
    main()
