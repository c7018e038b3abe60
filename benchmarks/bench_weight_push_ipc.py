"""An IPC weight push from a trainer in a second process on the same GPU.

The trainer holds Qwen3-8B-shaped bf16 tensors (random, tied embeddings, 16.4 GB)
on the GPU and pushes them through :class:`kvrunner.weight_sync.BucketSender`; the
engine (``load_format="dummy"``, eager, a minimal pool) receives them with
``LLM.update_weights_from_ipc``. Timed end to end on the engine side: from the call
to the trainer's last acknowledgement and the end of the push (trainer tensors in
the engine's weights, every bucket's copy completed on the device), median of 3
pushes after a warm-up push, for two bucket sizes, with and without the finiteness
check. Printed against the device copy rate measured in the same run (bytes copied
per second: half the read+write bandwidth ``common.copy_bandwidth_tbps`` reports).

The bucket path copies every byte twice through the same HBM (trainer tensor ->
bucket, bucket -> weight), so its end-to-end rate is bounded by half the copy rate.

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
BUCKETS_MB = (512, 2048)
PUSHES = 4  # the first is a warm-up (maps the buffers, first-touch costs)


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
    """The second process: tensors on cuda:0, one sender per bucket size."""
    from kvrunner.weight_sync import BucketSender

    weights = tensors("cuda")
    conn.send(sum(t.numel() * t.element_size() for _, t in weights))
    while (bucket_mb := conn.recv()) is not None:
        with BucketSender(device="cuda", bucket_bytes=bucket_mb << 20) as sender:
            conn.send((sender.address, sender.authkey))
            for _ in range(PUSHES):
                sender.push(weights)


def main() -> None:
    from kvrunner import LLM

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
        print(f"{'bucket':>8} {'finite check':>12} {'push s':>8} {'GB/s':>7} {'x copy':>7}")
        for bucket_mb in BUCKETS_MB:
            for check in (True, False):
                conn.send(bucket_mb)
                address, authkey = conn.recv()
                times = []
                for _ in range(PUSHES):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    llm.update_weights_from_ipc(address, authkey=authkey, check_finite=check)
                    times.append(time.perf_counter() - start)
                seconds = statistics.median(times[1:])
                rate = weight_bytes / seconds
                print(f"{bucket_mb:>6}MB {str(check):>12} {seconds:>8.3f} {rate / 1e9:>7.0f} "
                      f"{rate / copy_rate:>7.2f}", flush=True)
        llm.shutdown()
    conn.send(None)
    process.join(30)


if __name__ == "__main__":
    sys.exit(main())
