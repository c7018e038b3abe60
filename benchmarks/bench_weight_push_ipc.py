"""An IPC weight push from a trainer in a second process on the same GPU: the bucket
path beside the direct (one-copy) path, in the same run.

The trainer holds Qwen3-8B-shaped bf16 tensors (random, tied embeddings, 16.4 GB)
on the GPU; the engine (``load_format="dummy"``, eager, a minimal pool) receives
them with ``LLM.update_weights_from_ipc``. Timed end to end on the engine side: from
the call to the end of the push (trainer tensors in the engine's weights, every copy
completed on the device, acknowledged), with and without the finiteness check.
Printed against the device copy rate measured in the same run (bytes copied per
second: half the read+write bandwidth ``common.copy_bandwidth_tbps`` reports).

- ``bucket``: :class:`kvrunner.weight_sync.BucketSender`, two bucket sizes. Every
  byte is copied twice through the same HBM (trainer tensor -> bucket -> weight), so
  its rate is bounded by half the copy rate. Median of 3 pushes after a warm-up.
- ``direct``: :class:`kvrunner.weight_sync.DirectSender`, two chunk sizes (bytes of
  tensors per message), a fresh sender per row: the first push maps every trainer
  storage (CUDA IPC handles) and is reported on its own; the steady state (the
  engine reuses its mappings, only metadata travels) is the median of the next 3.
  The finiteness check reads every byte once more before the copy (one min/max per
  tensor), so with it the rate is bounded by 2/3 of the copy rate.

Then a check that the direct path moves the right bytes: the trainer negates its
tensors in place and pushes them directly (a steady-state push: no storage mapped
anew), the engine's greedy tokens are taken, the same tensors are pushed through
buckets and the tokens must be equal. Last, the trainer closes its sender and drops
its tensors: the memory it still has allocated and reserved is printed (torch frees
IPC-shared blocks only once the engine has let go of them).

    python benchmarks/bench_weight_push_ipc.py
"""

from __future__ import annotations

import json
import multiprocessing
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_tp_decode import SHAPES
from common import copy_bandwidth_tbps

from kvrunner.models.tiny import write_tiny_checkpoint

SHAPE = SHAPES["8B"]
BUCKETS_MB = (2048, 4096)
CHUNKS_MB = (1024, 4096)
PUSHES = 4  # the first is a warm-up (bucket) or the push that maps the storages (direct)
PROMPT = [11, 22, 33, 44, 55, 66, 77, 88]


def tensors(device: str) -> list[tuple[str, torch.Tensor]]:
    s, g = SHAPE, torch.Generator(device=device).manual_seed(0)
    h, d = s["hidden"], s["head_dim"]

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=device, generator=g) * 0.02).to(torch.bfloat16)

    out = [("model.embed_tokens.weight", w(s["vocab"], h)),
           ("model.norm.weight", torch.ones(h, dtype=torch.bfloat16, device=device))]
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", w(s["heads"] * d, h)),
                (p + "self_attn.k_proj.weight", w(s["kv_heads"] * d, h)),
                (p + "self_attn.v_proj.weight", w(s["kv_heads"] * d, h)),
                (p + "self_attn.o_proj.weight", w(h, s["heads"] * d)),
                (p + "self_attn.q_norm.weight", w(d)), (p + "self_attn.k_norm.weight", w(d)),
                (p + "mlp.gate_proj.weight", w(s["inter"], h)),
                (p + "mlp.up_proj.weight", w(s["inter"], h)),
                (p + "mlp.down_proj.weight", w(h, s["inter"])),
                (p + "input_layernorm.weight", w(h)),
                (p + "post_attention_layernorm.weight", w(h))]
    return out


def write_config(path: Path) -> None:
    s = SHAPE
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "torch_dtype": "bfloat16",
        "hidden_size": s["hidden"], "intermediate_size": s["inter"],
        "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"], "hidden_act": "silu",
        "vocab_size": s["vocab"], "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": True, "attention_bias": False,
        "bos_token_id": 0, "eos_token_id": 0,
    }))
    tiny = write_tiny_checkpoint(path / "_tok", kind="qwen3")
    shutil.copy(tiny / "tokenizer.json", path / "tokenizer.json")
    shutil.rmtree(tiny)


def trainer(conn) -> None:
    """The second process: tensors on cuda:0; one sender per command (see main)."""
    from kvrunner.weight_sync import BucketSender, DirectSender

    weights = tensors("cuda")
    conn.send(sum(t.numel() * t.element_size() for _, t in weights))
    while (command := conn.recv()) is not None:
        kind, size_mb = command
        if kind == "bucket":
            with BucketSender(device="cuda", bucket_bytes=size_mb << 20) as sender:
                conn.send((sender.address, sender.authkey))
                for _ in range(PUSHES):
                    sender.push(weights)
        elif kind == "direct":
            with DirectSender(device="cuda", chunk_bytes=size_mb << 20) as sender:
                conn.send((sender.address, sender.authkey))
                stats = []
                for _ in range(PUSHES):
                    sender.push(weights)
                    stats.append(sender.last_push)
                conn.send(stats)
        elif kind == "verify":  # direct, negate in place, direct again, then buckets
            with DirectSender(device="cuda") as direct, \
                    BucketSender(device="cuda", bucket_bytes=size_mb << 20) as bucket:
                conn.send((direct.address, direct.authkey, bucket.address, bucket.authkey))
                direct.push(weights)
                with torch.no_grad():
                    for _, tensor in weights:
                        tensor.neg_()
                direct.push(weights)
                conn.send(direct.last_push)
                bucket.push(weights)
        elif kind == "free":
            weights.clear()
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()
            conn.send((torch.cuda.memory_allocated(), torch.cuda.memory_reserved()))


def row(path: str, size_mb: int, check: bool, first_s: float | None, steady_s: float,
        weight_bytes: int, copy_rate: float) -> str:
    """One line of the table: the steady-state rate in GB/s and against the copy rate."""
    rate = weight_bytes / steady_s
    first = f"{first_s:>8.3f}" if first_s is not None else f"{'':>8}"
    return (f"{path:>7} {size_mb:>6}MB {str(check):>6} {first} {steady_s:>9.4f} "
            f"{rate / 1e9:>7.0f} {rate / copy_rate:>7.2f}")


HEADER = (f"{'path':>7} {'size':>8} {'check':>6} {'first s':>8} {'steady s':>9} "
          f"{'GB/s':>7} {'x copy':>7}")


def timed_pushes(llm, address, authkey, check: bool) -> list[float]:
    """Seconds of each of PUSHES pushes from the sender at ``address``."""
    times = []
    for _ in range(PUSHES):
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.update_weights_from_ipc(address, authkey=authkey, check_finite=check)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    from kvrunner import LLM, SamplingParams

    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=trainer, args=(child,), daemon=True)
    process.start()
    weight_bytes = conn.recv()
    with tempfile.TemporaryDirectory() as tmp:
        write_config(Path(tmp) / "m")
        llm = LLM(model=str(Path(tmp) / "m"), dtype="bfloat16", load_format="dummy",
                  enforce_eager=True, max_num_seqs=1, max_model_len=256,
                  gpu_memory_utilization=0.4, skip_tokenizer_init=True)
        copy_rate = copy_bandwidth_tbps() * 1e12 / 2  # bytes copied per second
        print(f"{torch.cuda.get_device_name()}: {weight_bytes / 1e9:.1f} GB of bf16 weights "
              f"(Qwen3-8B shapes); device copy rate {copy_rate / 1e9:.0f} GB/s")
        print("size: bucket size (bucket) or bytes of tensors per message (direct); "
              "steady s: median of the pushes after the first")
        print(HEADER)
        for bucket_mb in BUCKETS_MB:
            for check in (True, False):
                conn.send(("bucket", bucket_mb))
                address, authkey = conn.recv()
                times = timed_pushes(llm, address, authkey, check)
                print(row("bucket", bucket_mb, check, times[0], statistics.median(times[1:]),
                          weight_bytes, copy_rate), flush=True)
        for chunk_mb in CHUNKS_MB:
            for check in (True, False):
                conn.send(("direct", chunk_mb))
                address, authkey = conn.recv()
                times = timed_pushes(llm, address, authkey, check)
                stats = conn.recv()
                print(row("direct", chunk_mb, check, times[0], statistics.median(times[1:]),
                          weight_bytes, copy_rate)
                      + f"   storages mapped per push: {[s.new_storages for s in stats]}",
                      flush=True)
        greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        conn.send(("verify", BUCKETS_MB[-1]))
        direct_address, direct_key, bucket_address, bucket_key = conn.recv()
        llm.update_weights_from_ipc(direct_address, authkey=direct_key)
        before = llm.generate([PROMPT], greedy)[0].token_ids
        llm.update_weights_from_ipc(direct_address, authkey=direct_key)
        after_direct = llm.generate([PROMPT], greedy)[0].token_ids
        stats = conn.recv()
        llm.update_weights_from_ipc(bucket_address, authkey=bucket_key)
        after_bucket = llm.generate([PROMPT], greedy)[0].token_ids
        same = after_direct == after_bucket
        print(f"negated in place, pushed directly ({stats.new_storages} storages mapped anew) "
              f"then through buckets: tokens {'equal' if same else 'DIFFER'} "
              f"({after_direct[:6]}... vs {after_bucket[:6]}...; before the negation "
              f"{before[:6]}...)", flush=True)
        conn.send(("free", 0))
        allocated, reserved = conn.recv()
        print(f"trainer after close and dropping its tensors: {allocated / 2**20:.0f} MiB "
              f"allocated, {reserved / 2**20:.0f} MiB reserved", flush=True)
        llm.shutdown()
    conn.send(None)
    process.join(30)
    if not same:
        raise SystemExit("the direct push did not land the trainer's tensors")


if __name__ == "__main__":
    sys.exit(main())
