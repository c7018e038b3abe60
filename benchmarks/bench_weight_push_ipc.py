"""An IPC weight push from a trainer in a second process on the same GPU: kvrunner's
bucket and direct (one-copy) paths beside the two peers' colocated formats (slime's
flattened buckets, vLLM's IPC weight transfer), in the same run.

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

- ``slime``: slime's colocated push (``UpdateWeightFromTensor``,
  ``_send_to_colocated_engine``) into ``LLM.update_weights_from_tensor``: the
  trainer cuts its tensors into buckets of slime's ``--update-weight-buffer-size``
  (512 MiB, its default, and 2 GiB; a tensor larger than the buffer is a bucket of its
  own), concatenates each bucket's bytes into one new ``uint8`` tensor with SGLang's
  ``FlattenedTensorMetadata`` per tensor (SGLang's multi-dtype
  ``FlattenedTensorBucket``), serialises it as SGLang's ``MultiprocessingSerializer``
  does (torch's ``ForkingPickler`` reductions: CUDA IPC handles, base64 text), and
  waits for the engine's answer before the next bucket; after each answer it drops
  the bucket and calls ``ipc_collect`` and ``empty_cache`` as slime does. Each bucket is
  one ``update_weights_from_tensor`` call (``load_format="flattened_bucket"``). Every
  byte is copied twice (tensor -> bucket in the trainer, bucket -> weight in the
  engine), so the rate is bounded by half the copy rate.
- ``vllm``: vLLM's IPC weight transfer (``IPCWeightTransferEngine.trainer_send_weights``
  into ``LLM.update_weights_from_ipc_handles`` between ``start_weight_update`` and
  ``finish_weight_update``), both forms. Per tensor: one update naming every tensor,
  each ``{gpu_uuid: args}`` from torch's ``reduce_tensor`` of the trainer's own tensor
  (no copy in the trainer; the peer does not bucket it). Packed
  (``packed_ipc_producer``): one ``uint8`` buffer allocated and exported once per
  push (one ``reduce_tensor``, its handle sent with every chunk), each chunk's
  tensors copied into it back to back, one update per chunk with ``tensor_sizes``,
  the next chunk packed once the engine has answered; buffers of 2 and 4 GiB (vLLM's
  default of 1 GiB cannot hold the 1.24 GB embedding of this shape: vLLM refuses a
  tensor larger than its buffer). The per-tensor form copies
  each byte once (bounded by the copy rate), the packed form twice.

The timed span of a peer's push runs from the engine's signal to start (the trainer
then builds and sends its first payload) to the end of the engine's last call: the
trainer's packing and serialising are in it, as they are in the peer's step. After
each peer's rows the engine's greedy tokens are taken: every way leaves the trainer's
tensors in the engine, so they must all equal those after a direct push.

Each row also prints what its pushes left in the trainer (``held MiB``): its allocated
memory beyond its weights once its senders closed and it dropped its buckets and
collected its IPC blocks. Anything here is a share the engine never released.

Then a check that the direct path moves the right bytes: the trainer negates its
tensors in place and pushes them directly (a steady-state push: no storage mapped
anew), the engine's greedy tokens are taken, the same tensors are pushed through
buckets and the tokens must be equal. Last, the trainer closes its sender and drops
its tensors: the memory it still has allocated and reserved is printed (torch frees
IPC-shared blocks only once the engine has let go of them).

    python benchmarks/bench_weight_push_ipc.py
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import multiprocessing
import pickle
import shutil
import statistics
import sys
import tempfile
import time
import types
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch
from bench_tp_decode import SHAPES
from common import copy_bandwidth_tbps

from kvrunner.models.tiny import write_tiny_checkpoint

SHAPE = SHAPES["8B"]
BUCKETS_MB = (2048, 4096)
CHUNKS_MB = (1024, 4096)
#: slime's --update-weight-buffer-size: its default, and a larger one
SLIME_BUCKETS_MB = (512, 2048)
#: vLLM's packed buffer (its default, 1 GiB, is smaller than this shape's embedding)
VLLM_BUFFERS_MB = (2048, 4096)
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


def sglang_metadata_class() -> type:
    """SGLang's ``FlattenedTensorMetadata``, defined under its module's name so the
    pickle names the class SGLang's pickle names (SGLang is not installed here)."""
    module_name = "sglang.srt.weight_sync.tensor_bucket"
    for name in ("sglang", "sglang.srt", "sglang.srt.weight_sync", module_name):
        sys.modules.setdefault(name, types.ModuleType(name))

    @dataclasses.dataclass
    class FlattenedTensorMetadata:
        name: str
        shape: torch.Size
        dtype: torch.dtype
        start_idx: int
        end_idx: int
        numel: int

    FlattenedTensorMetadata.__module__ = module_name
    FlattenedTensorMetadata.__qualname__ = "FlattenedTensorMetadata"
    sys.modules[module_name].FlattenedTensorMetadata = FlattenedTensorMetadata
    return FlattenedTensorMetadata


def buffer_chunks(weights: list[tuple[str, torch.Tensor]], limit: int
                  ) -> list[list[tuple[str, torch.Tensor]]]:
    """The tensors in order, cut where the next one would take a chunk past ``limit``
    bytes (a tensor larger than ``limit`` is a chunk of its own)."""
    chunks: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if chunks[-1] and size + nbytes > limit:
            chunks.append([])
            size = 0
        chunks[-1].append((name, tensor))
        size += nbytes
    return chunks


def serialize(obj: Any) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)``: torch's
    reductions (a CUDA tensor as its IPC handle) through ``ForkingPickler``, base64."""
    from torch.multiprocessing.reductions import init_reductions

    init_reductions()  # what importing torch.multiprocessing does: idempotent
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("utf-8")


def slime_push(conn, weights: list[tuple[str, torch.Tensor]], bucket_bytes: int,
               metadata: type) -> None:
    """One push as slime's colocated path makes it: per bucket, SGLang's flattened
    bucket (every tensor's bytes, one new tensor), serialised, sent, answered, freed."""
    for chunk in buffer_chunks(weights, bucket_bytes):
        flats, entries, at = [], [], 0
        for name, tensor in chunk:
            flat = tensor.flatten().view(torch.uint8)
            entries.append(metadata(name=name, shape=tensor.shape, dtype=tensor.dtype,
                                    start_idx=at, end_idx=at + flat.numel(),
                                    numel=flat.numel()))
            flats.append(flat)
            at += flat.numel()
        bucket = {"flattened_tensor": torch.cat(flats), "metadata": entries}
        conn.send(serialize(bucket))
        conn.recv()  # the engine's answer: its copies are done
        del bucket, flats
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()
    conn.send(None)


def vllm_info(pairs: list[tuple[str, torch.Tensor]], handles: Any) -> dict[str, Any]:
    """An ``update_info`` of vLLM's IPC backend as its HTTP sender writes it."""
    return {"names": [n for n, _ in pairs],
            "dtype_names": [str(t.dtype).split(".")[-1] for _, t in pairs],
            "shapes": [list(t.shape) for _, t in pairs],
            "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode("utf-8")}


def vllm_tensors_push(conn, weights: list[tuple[str, torch.Tensor]], uuid: str) -> None:
    """vLLM's unpacked IPC send: one update, each tensor's own ``reduce_tensor``."""
    from torch.multiprocessing.reductions import reduce_tensor

    handles = [{uuid: reduce_tensor(t.detach().contiguous())[1]} for _, t in weights]
    conn.send(vllm_info(weights, handles))
    conn.recv()
    conn.send(None)


def vllm_packed_push(conn, weights: list[tuple[str, torch.Tensor]], uuid: str,
                     buffer: torch.Tensor, args: tuple[Any, ...]) -> None:
    """vLLM's packed IPC send: the tensors' bytes copied back to back into the one
    exported buffer, a chunk sent when the next tensor would not fit, the next chunk
    packed once the engine has answered."""
    capacity = buffer.numel()
    pending: list[tuple[str, torch.Tensor]] = []
    used = 0

    def send() -> None:
        torch.cuda.current_stream().synchronize()
        info = vllm_info(pending, {uuid: args})
        info["tensor_sizes"] = [t.numel() * t.element_size() for _, t in pending]
        conn.send(info)
        conn.recv()

    for name, tensor in weights:
        flat = tensor.contiguous().view(torch.uint8).view(-1)
        if flat.numel() > capacity:
            raise ValueError(f"{name} ({flat.numel()} bytes) exceeds the packed buffer of "
                             f"{capacity} bytes")
        if used + flat.numel() > capacity:
            send()
            pending, used = [], 0
        buffer[used:used + flat.numel()].copy_(flat)
        pending.append((name, tensor))
        used += flat.numel()
    if pending:
        send()
    conn.send(None)


def trainer(conn) -> None:
    """The second process: tensors on cuda:0; one sender per command (see main)."""
    from kvrunner.weight_sync import BucketSender, DirectSender

    weights = tensors("cuda")
    held = torch.cuda.memory_allocated()
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
        elif kind in ("slime", "vllm", "vllm-packed"):  # the peers' formats
            uuid = str(torch.cuda.get_device_properties(0).uuid)
            if kind == "slime":
                metadata = sglang_metadata_class()
            conn.send("ready")
            for _ in range(PUSHES):
                assert conn.recv() == "go"  # the engine's signal to start
                if kind == "slime":
                    slime_push(conn, weights, size_mb << 20, metadata)
                elif kind == "vllm":
                    vllm_tensors_push(conn, weights, uuid)
                else:  # a buffer per transfer, exported once (packed_ipc_producer)
                    from torch.multiprocessing.reductions import reduce_tensor

                    buffer = torch.empty(size_mb << 20, dtype=torch.uint8, device="cuda")
                    vllm_packed_push(conn, weights, uuid, buffer, reduce_tensor(buffer)[1])
                    del buffer
                assert conn.recv() == "finished"
        elif kind == "free":
            weights.clear()
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()
            conn.send((torch.cuda.memory_allocated(), torch.cuda.memory_reserved()))
            continue
        # what the row's pushes left behind once the trainer dropped what it made for
        # them (its senders closed, its buckets freed)
        torch.cuda.ipc_collect()
        conn.send(torch.cuda.memory_allocated() - held)


def row(path: str, size_mb: int | None, check: bool, first_s: float | None, steady_s: float,
        weight_bytes: int, copy_rate: float, held: int) -> str:
    """One line of the table: the steady-state rate in GB/s and against the copy rate,
    and the bytes the trainer still holds for the row's pushes (``held``: its
    allocated memory beyond its weights once it dropped what it made for them; a share
    the engine never released stays here)."""
    rate = weight_bytes / steady_s
    first = f"{first_s:>8.3f}" if first_s is not None else f"{'':>8}"
    size = f"{size_mb:>6}MB" if size_mb is not None else f"{'-':>8}"
    return (f"{path:>11} {size} {str(check):>6} {first} {steady_s:>9.4f} "
            f"{rate / 1e9:>7.0f} {rate / copy_rate:>7.2f} {held / 2**20:>9.0f}")


HEADER = (f"{'path':>11} {'size':>8} {'check':>6} {'first s':>8} {'steady s':>9} "
          f"{'GB/s':>7} {'x copy':>7} {'held MiB':>9}")


def timed_pushes(llm, address, authkey, check: bool) -> list[float]:
    """Seconds of each of PUSHES pushes from the sender at ``address``."""
    times = []
    for _ in range(PUSHES):
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.update_weights_from_ipc(address, authkey=authkey, check_finite=check)
        times.append(time.perf_counter() - start)
    return times


def peer_pushes(llm, conn, kind: str, check: bool) -> list[float]:
    """Seconds of each of PUSHES pushes in a peer's format (``kind``): from the signal
    to start to the end of the engine's last call for it."""
    times = []
    for _ in range(PUSHES):
        torch.cuda.synchronize()
        start = time.perf_counter()
        conn.send("go")
        if kind == "vllm" or kind == "vllm-packed":
            llm.start_weight_update()
        while (payload := conn.recv()) is not None:
            if kind == "slime":
                llm.update_weights_from_tensor([payload], "flattened_bucket",
                                               check_finite=check)
            else:
                llm.update_weights_from_ipc_handles(**payload, check_finite=check)
            conn.send("done")
        if kind == "vllm" or kind == "vllm-packed":
            llm.finish_weight_update()
        times.append(time.perf_counter() - start)
        conn.send("finished")  # the update is over: the engine let go of the trainer's memory
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
                          weight_bytes, copy_rate, conn.recv()), flush=True)
        for chunk_mb in CHUNKS_MB:
            for check in (True, False):
                conn.send(("direct", chunk_mb))
                address, authkey = conn.recv()
                times = timed_pushes(llm, address, authkey, check)
                stats = conn.recv()
                print(row("direct", chunk_mb, check, times[0], statistics.median(times[1:]),
                          weight_bytes, copy_rate, conn.recv())
                      + f"   storages mapped per push: {[s.new_storages for s in stats]}",
                      flush=True)
        greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        peer_tokens = {}
        for kind, sizes in (("slime", SLIME_BUCKETS_MB), ("vllm", (None,)),
                            ("vllm-packed", VLLM_BUFFERS_MB)):
            for size_mb in sizes:
                for check in (True, False):
                    conn.send((kind, size_mb))
                    assert conn.recv() == "ready"
                    times = peer_pushes(llm, conn, kind, check)
                    print(row(kind, size_mb, check, times[0], statistics.median(times[1:]),
                              weight_bytes, copy_rate, conn.recv()), flush=True)
                    peer_tokens[kind, size_mb, check] = llm.generate(
                        [PROMPT], greedy)[0].token_ids
        conn.send(("verify", BUCKETS_MB[-1]))
        direct_address, direct_key, bucket_address, bucket_key = conn.recv()
        llm.update_weights_from_ipc(direct_address, authkey=direct_key)
        before = llm.generate([PROMPT], greedy)[0].token_ids
        llm.update_weights_from_ipc(direct_address, authkey=direct_key)
        after_direct = llm.generate([PROMPT], greedy)[0].token_ids
        stats = conn.recv()
        llm.update_weights_from_ipc(bucket_address, authkey=bucket_key)
        after_bucket = llm.generate([PROMPT], greedy)[0].token_ids
        verify_held = conn.recv()
        same = after_direct == after_bucket
        differ = [k for k, tokens in peer_tokens.items() if tokens != before]
        print(f"the peers' pushes: tokens {'equal' if not differ else 'DIFFER'} to those "
              f"after a direct push of the same tensors"
              + (f" ({', '.join(map(str, differ))})" if differ else ""), flush=True)
        print(f"negated in place, pushed directly ({stats.new_storages} storages mapped anew) "
              f"then through buckets: tokens {'equal' if same else 'DIFFER'} "
              f"({after_direct[:6]}... vs {after_bucket[:6]}...; before the negation "
              f"{before[:6]}...); the trainer holds {verify_held / 2**20:.0f} MiB for them "
              f"after close", flush=True)
        conn.send(("free", 0))
        allocated, reserved = conn.recv()
        print(f"trainer after close and dropping its tensors: {allocated / 2**20:.0f} MiB "
              f"allocated, {reserved / 2**20:.0f} MiB reserved", flush=True)
        llm.shutdown()
    conn.send(None)
    process.join(30)
    if not same:
        raise SystemExit("the direct push did not land the trainer's tensors")
    if differ:
        raise SystemExit(f"a peer's push did not land the trainer's tensors: {differ}")


if __name__ == "__main__":
    sys.exit(main())
