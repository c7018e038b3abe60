"""The RL trainers' weight pushes to an SGLang server, replayed from their source in a
process of their own, against a live ``kvrunner serve``. Nothing here is kvrunner's:
each job makes the torch calls and the HTTP calls the peer's code makes, in its
order, with its bodies.

* ``areal``: AReaL 4aef98d8d818af55b43621aaadba047ae10f4e77,
  ``areal/engine/fsdp_engine.py`` (``_init_weight_update_from_distributed``,
  ``_update_bucket_weights_from_distributed_async``), the group from
  ``areal/engine/core/distributed.py::init_custom_process_group``, the bodies from
  ``areal/engine/sglang_remote.py`` (``master_port`` as a string,
  ``abort_all_requests: true``).
* ``slime_group``: slime (THUDM/slime) 624b824a898ab0ec1fcb4d373004c7f3852bf515,
  ``slime/backends/megatron_utils/update_weight/update_weight_from_distributed.py``
  (``connect_rollout_engines_from_distributed``, ``update_weights``,
  ``update_weights_from_distributed``, ``disconnect_rollout_engines_from_distributed``),
  the group from ``slime/utils/distributed_utils.py::init_process_group``, the bodies
  from ``slime/backends/sglang_utils/sglang_engine.py``.
* ``slime_tensor``: the same slime commit,
  ``update_weight_from_tensor.py`` (``UpdateWeightFromTensor.update_weights``,
  ``_send_to_colocated_engine``): each chunk one flattened bucket, serialized by
  SGLang's ``MultiprocessingSerializer`` (sglang 0.5.23,
  ``python/sglang/srt/utils/common.py``: ``ForkingPickler`` then base64) and posted
  with ``load_format="flattened_bucket"``; the bucket as SGLang's
  ``FlattenedTensorBucket`` (``python/sglang/srt/weight_sync/tensor_bucket.py``)
  writes it, its metadata pickled under SGLang's class name. On the CPU the tensors
  travel in shared memory by file name (``set_sharing_strategy("file_system")``).
* ``sglang_pairs``: SGLang's plain form, a list of ``(name, tensor)``
  (``load_format`` null), as SGLang's ``Engine.update_weights_from_tensor`` writes it.
* ``trl_vllm``: TRL 1.16.0's ``VLLMClient`` (``trl/generation/vllm_client.py``:
  ``init_communicator``, ``weight_update``, ``update_named_param``,
  ``update_named_params``, ``update_model_params``) against vLLM's weight-transfer
  routes, its bodies as it writes them for vLLM >= 0.28 (``packed`` in the init info)
  or before (``packed`` in each update's info); the data plane is vLLM's
  (vllm-project/vllm 00a9ccfb4cefdaf0092392b0afba5721b33886e6,
  ``vllm/distributed/weight_transfer/packed_tensor.py``: ``pack_tensors``,
  ``packed_nccl_broadcast_producer``; unpacked, one broadcast per tensor, as
  ``NCCLWeightTransferEngine.trainer_send_weights``). TRL builds that group with
  vLLM's ``trainer_init`` (``StatelessProcessGroup`` and ``PyNcclCommunicator``,
  CUDA only); on the CPU the trainer joins the engine's group as torch's tcp://
  rendezvous meets it, over gloo.
* ``skyrl_broadcast``: SkyRL (NovaSky-AI/SkyRL) a9564572eb8e91076be43c1bd5e4615e3de17265,
  ``skyrl/backends/skyrl_train/workers/worker.py`` (``init_weight_sync_state``: the
  world size from ``/get_world_size``, the sender's group joined while
  ``init_weight_update_communicator`` posts ``/init_weight_transfer_engine``),
  ``workers/worker_dispatch.py`` (``save_weights_for_sampler``, not colocated: a keep
  pause around the push), ``weight_sync/broadcast_strategy.py``
  (``BroadcastInitInfo.to_api_payload``, ``_send_chunks_vllm_native``: start, one
  ``update_weights_nccl`` of every tensor with ``packed: true`` while vLLM's
  ``trainer_send_weights`` broadcasts them packed, finish), ``workers/fsdp/
  fsdp_worker.py`` (``broadcast_to_inference_engines``: every tensor in the generator
  dtype, then ``reset_prefix_cache(reset_running_requests=True)``); with
  ``offload_kv``, ``worker_dispatch.py``'s fully async sequence inside the pause
  (``sleep_for_weight_sync``, ``wake_for_weight_sync(["weights"])``, the push,
  ``wake_for_weight_sync(["kv_cache"])``). Each call's route
  and body from ``inference_servers/remote_inference_client.py``. The group is vLLM's
  ``trainer_init`` there; here, as for ``trl_vllm``, torch's tcp:// rendezvous over gloo.
* ``skyrl_ipc``: the same commit, colocated: ``weight_sync/cuda_ipc_strategy.py``
  (``CudaIpcInitInfo.to_api_payload``: ``{}``; ``_send_chunks_vllm_native`` on one
  trainer rank: start, per chunk the tensors copied into one flat buffer of the
  generator dtype, ``reduce_tensor`` of it keyed by the GPU's UUID, pickled and
  base64-encoded, posted with ``sizes`` in elements to ``update_weights_ipc``; finish),
  around it ``worker_dispatch.py``'s colocated wake (``/wake_up?tags=weights``, the
  push, ``/wake_up?tags=kv_cache``) after the trainer loop's ``/sleep?level=2``. CUDA
  only.

Run as ``python peer_trainers.py '<job as JSON>'``; prints one JSON line per step.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import sys
import threading
import types
from datetime import timedelta
from typing import Any

import requests
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    Backend,
    PrefixStore,
    _new_process_group_helper,
    _world,
    rendezvous,
)

sys.path.insert(0, os.path.dirname(__file__))
from trainer_process import checkpoint_tensors  # noqa: E402


def pushed_tensors(path: str, mixed: bool) -> list[tuple[str, torch.Tensor]]:
    """What the trainer pushes: the checkpoint's tensors, every other one in bfloat16
    when ``mixed`` (a bucket of several dtypes)."""
    pairs = checkpoint_tensors(path, 0)
    if not mixed:
        return pairs
    return [(n, t.to(torch.bfloat16) if i % 2 else t) for i, (n, t) in enumerate(pairs)]


def chunks(pairs: list[tuple[str, torch.Tensor]], count: int
           ) -> list[list[tuple[str, torch.Tensor]]]:
    size = -(-len(pairs) // count)
    return [pairs[i:i + size] for i in range(0, len(pairs), size)]


class Server:
    """The engine as the peers' HTTP helpers post to it (``requests``)."""

    def __init__(self, url: str, api_key: str | None) -> None:
        self.url = url
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def post(self, endpoint: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
        r = requests.post(f"{self.url}/{endpoint}", json=payload or {}, headers=self.headers,
                          timeout=120)
        if r.status_code != 200:
            raise RuntimeError(f"{endpoint} answered {r.status_code}: {r.text}")
        return r.json()

    def get(self, endpoint: str) -> dict[str, Any]:
        r = requests.get(f"{self.url}/{endpoint}", headers=self.headers, timeout=120)
        if r.status_code != 200:
            raise RuntimeError(f"{endpoint} answered {r.status_code}: {r.text}")
        return r.json()

    def post_in_thread(self, endpoint: str, payload: dict[str, Any]) -> Any:
        """The call a peer makes from another thread (a Ray actor, a future) while it
        joins or broadcasts; ``.result()`` waits for the answer."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["answer"] = self.post(endpoint, payload)
            except Exception as e:  # reported by result()
                box["error"] = e

        thread = threading.Thread(target=run, daemon=True)
        thread.start()

        class Pending:
            @staticmethod
            def result() -> dict[str, Any]:
                thread.join(120)
                if "error" in box:
                    raise box["error"]
                return box["answer"]

        return Pending()


def trainers_group(*, backend: str, address: str, port: int, world_size: int,
                   group_name: str) -> Any:
    """The group both trainers make (AReaL's ``init_custom_process_group``, slime's
    ``init_process_group``): torch's tcp:// rendezvous, a store prefixed by the group
    name, torch's group helper, group rank r registered as rank r."""
    timeout = timedelta(seconds=60)
    store, rank, size = next(rendezvous(f"tcp://{address}:{port}", 0, world_size,
                                        timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(size, rank, [], Backend(backend),
                                         PrefixStore(group_name, store),
                                         group_name=group_name, backend_options=None,
                                         timeout=timeout, group_desc=group_name)
    _world.pg_group_ranks[group] = {i: i for i in range(size)}
    return group


def say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def areal(server: Server, job: dict[str, Any]) -> None:
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = str(False)
    group_name = "update_weight_group"
    pending = server.post_in_thread("init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": str(job["port"]), "rank_offset": 1,
        "world_size": job["world_size"], "backend": "gloo", "group_name": group_name})
    group = trainers_group(backend="gloo", address="127.0.0.1", port=job["port"],
                           world_size=job["world_size"], group_name=group_name)
    say(step="init", answer=pending.result())
    server.post("pause_generation", {})
    for chunk in chunks(pushed_tensors(job["path"], False), job["chunks"]):
        pending = server.post_in_thread("update_weights_from_distributed", {
            "names": [n for n, _ in chunk],
            "dtypes": [str(t.dtype).split("torch.")[1] for _, t in chunk],
            "shapes": [list(t.shape) for _, t in chunk],
            "group_name": group_name, "abort_all_requests": True})
        handles = [dist.broadcast(t, src=0, group=group, async_op=True) for _, t in chunk]
        for handle in handles:
            handle.wait()
        say(step="chunk", answer=pending.result())
    server.post("continue_generation", {})


def slime_group(server: Server, job: dict[str, Any]) -> None:
    group_name = "slime-pp_0"
    pending = server.post_in_thread("init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": job["port"], "rank_offset": 1,
        "world_size": job["world_size"], "group_name": group_name, "backend": "gloo"})
    group = trainers_group(backend="gloo", address="127.0.0.1", port=job["port"],
                           world_size=job["world_size"], group_name=group_name)
    say(step="init", answer=pending.result())
    weight_version = 1
    server.post("pause_generation", {})
    server.get("flush_cache")
    for chunk in chunks(pushed_tensors(job["path"], False), job["chunks"]):
        pending = server.post_in_thread("update_weights_from_distributed", {
            "names": [n for n, _ in chunk],
            "dtypes": [str(t.dtype).replace("torch.", "") for _, t in chunk],
            "shapes": [list(t.shape) for _, t in chunk],
            "group_name": group_name, "flush_cache": False,
            "weight_version": str(weight_version)})
        handles = [dist.broadcast(t.data, 0, group=group, async_op=True) for _, t in chunk]
        for handle in handles:
            handle.wait()
        say(step="chunk", answer=pending.result())
    server.post("continue_generation", {})
    server.post("destroy_weights_update_group", {"group_name": group_name})
    dist.destroy_process_group(group)


def sglang_metadata_class() -> type:
    """SGLang's ``FlattenedTensorMetadata`` under its module name, so the pickle names
    the class SGLang's pickle names (sglang itself does not import without its
    serving dependencies)."""
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


def flattened_bucket(pairs: list[tuple[str, torch.Tensor]], metadata: type,
                     as_bytes: bool) -> dict[str, Any]:
    """SGLang's FlattenedTensorBucket: every tensor flattened (as bytes, indices in
    bytes; or, the older writer, in its one dtype, indices in elements) and
    concatenated."""
    flats, entries, at = [], [], 0
    for name, tensor in pairs:
        flat = tensor.flatten().view(torch.uint8) if as_bytes else tensor.flatten()
        entries.append(metadata(name=name, shape=tensor.shape, dtype=tensor.dtype,
                                start_idx=at, end_idx=at + flat.numel(), numel=flat.numel()))
        flats.append(flat)
        at += flat.numel()
    return {"flattened_tensor": torch.cat(flats), "metadata": entries}


def serialize(obj: Any) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)``."""
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("utf-8")


def slime_tensor(server: Server, job: dict[str, Any]) -> None:
    torch.multiprocessing.set_sharing_strategy("file_system")
    metadata = sglang_metadata_class()
    as_bytes = job.get("as_bytes", True)
    weight_version = 1
    server.post("pause_generation", {})
    server.get("flush_cache")
    for chunk in chunks(pushed_tensors(job["path"], job["mixed"]), job["chunks"]):
        # the multi-dtype writer packs a chunk in one bucket, the older one per dtype
        by_dtype: dict[Any, list[tuple[str, torch.Tensor]]] = {}
        for name, tensor in chunk:
            by_dtype.setdefault("all" if as_bytes else tensor.dtype, []).append((name, tensor))
        live = []  # slime keeps the buckets alive until the engine answered
        for named in by_dtype.values():
            bucket = flattened_bucket(named, metadata, as_bytes)
            live.append(bucket)
            answer = server.post("update_weights_from_tensor", {
                "serialized_named_tensors": [serialize(bucket)],
                "load_format": "flattened_bucket", "flush_cache": False,
                "weight_version": str(weight_version)})
            say(step="bucket", answer=answer)
    server.post("continue_generation", {})


def sglang_pairs(server: Server, job: dict[str, Any]) -> None:
    torch.multiprocessing.set_sharing_strategy("file_system")
    pairs = pushed_tensors(job["path"], job["mixed"])
    answer = server.post("update_weights_from_tensor", {
        "serialized_named_tensors": [serialize(pairs)], "load_format": None,
        "flush_cache": True, "weight_version": "pairs"})
    say(step="pairs", answer=answer)


class Communicator:
    """The trainer's end of the group as vLLM's ``PyNcclCommunicator`` is used by its
    callers (``broadcast(tensor, src=0)``; ``.group`` holding the store, which TRL's
    ``close_communicator`` drops), over a gloo group on the CPU."""

    def __init__(self, group: Any) -> None:
        self.process_group = group
        self.group = types.SimpleNamespace(store=None, socket=None)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        dist.broadcast(tensor, src=src, group=self.process_group)


def packed_nccl_broadcast_producer(iterator: Any, group: Communicator, src: int,
                                   post_iter_func: Any,
                                   buffer_size_bytes: int = 1024 ** 3,
                                   num_buffers: int = 2) -> None:
    """vLLM's ``packed_nccl_broadcast_producer`` (its signature; ``pack_tensors``'s
    rule): each tensor's bytes appended to the chunk, the chunk broadcast once its size
    passes ``buffer_size_bytes``, the rest as one last chunk. ``num_buffers`` only
    sets vLLM's CUDA streams."""
    pending: list[torch.Tensor] = []
    total = 0
    for item in iterator:
        flat = post_iter_func(item).contiguous().view(torch.uint8).view(-1)
        pending.append(flat)
        total += flat.numel()
        if total > buffer_size_bytes:
            group.broadcast(torch.cat(pending), src=src)
            pending, total = [], 0
    if pending:
        group.broadcast(torch.cat(pending), src=src)


def trl_vllm(server: Server, job: dict[str, Any]) -> None:
    config = server.get("server_info?config_format=json")["vllm_config"]
    assert config["weight_transfer_config"] is not None, config
    world_size = server.get("get_world_size")["world_size"] + 1
    init_info = {"master_address": "127.0.0.1", "master_port": job["port"],
                 "rank_offset": 1, "world_size": world_size}
    packed, legacy = job["packing"] != "unpacked", job["packing"] == "legacy"
    buffer_bytes = job.get("buffer_bytes", 1024 ** 3)
    if packed and not legacy:
        init_info |= {"packed": True, "packed_buffer_size_bytes": buffer_bytes}
    pending = server.post_in_thread("init_weight_transfer_engine", {"init_info": init_info})
    group = Communicator(trainers_group(backend="gloo", address="127.0.0.1",
                                        port=job["port"], world_size=world_size,
                                        group_name="kvrunner_weights"))
    say(step="init", answer=pending.result())

    def update_named_params(pairs: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        info: dict[str, Any] = {"names": [n for n, _ in pairs],
                                "dtype_names": [str(t.dtype).removeprefix("torch.")
                                                for _, t in pairs],
                                "shapes": [list(t.shape) for _, t in pairs]}
        if legacy:
            info |= {"packed": True, "packed_buffer_size_bytes": buffer_bytes}
        pending = server.post_in_thread("update_weights", {"update_info": info})
        if packed:
            packed_nccl_broadcast_producer(iter(pairs), group, 0, lambda item: item[1],
                                           buffer_bytes)
        else:
            for _, tensor in pairs:
                group.broadcast(tensor, src=0)
        return pending.result()

    pairs = pushed_tensors(job["path"], job["mixed"])
    if job["calls"] == "weight_update":  # with client.weight_update(): update_named_param
        server.post("start_weight_update", {})
        for pair in pairs:
            say(step="param", answer=update_named_params([pair]))
        say(step="finish", answer=server.post("finish_weight_update",
                                              {"weight_version": job["version"]}))
    else:  # update_model_params: start, one update of every tensor, finish
        server.post("start_weight_update", {})
        say(step="model", answer=update_named_params(pairs))
        say(step="finish", answer=server.post("finish_weight_update", {}))
    dist.destroy_process_group(group.process_group)


def skyrl_rpc(server: Server, method: str, **kwargs: Any) -> dict[str, Any]:
    """SkyRL's ``RemoteInferenceClient`` calling its worker extension: the body it
    posts to vLLM's ``/collective_rpc`` (``kwargs`` left out when it sends none)."""
    return server.post("collective_rpc", {"method": method, "kwargs": kwargs} if kwargs
                       else {"method": method})


def skyrl_broadcast(server: Server, job: dict[str, Any]) -> None:
    world_size = server.get("get_world_size")["world_size"] + 1   # + the trainer's rank 0
    init_info = {"master_address": "127.0.0.1", "master_port": job["port"],
                 "rank_offset": 1, "world_size": world_size}
    pending = server.post_in_thread("init_weight_transfer_engine", {"init_info": init_info})
    group = Communicator(trainers_group(backend="gloo", address="127.0.0.1",
                                        port=job["port"], world_size=world_size,
                                        group_name="kvrunner_weights"))
    say(step="init", answer=pending.result())

    dtype = getattr(torch, job["dtype"])
    pairs = [(n, t.to(dtype)) for n, t in pushed_tensors(job["path"], False)]
    metadata = {"names": [n for n, _ in pairs],
                "dtype_names": [job["dtype"]] * len(pairs),
                "shapes": [list(t.shape) for _, t in pairs]}
    say(step="pause", answer=server.post("pause?mode=keep&clear_cache=false"))
    if job["offload_kv"]:  # offload_kv_for_weight_sync under the fully async trainer
        say(step="sleep", answer=skyrl_rpc(server, "skyrl_sleep_for_weight_sync",
                                           offload_kv=True))
        say(step="wake_weights", answer=skyrl_rpc(server, "skyrl_wake_for_weight_sync",
                                                  tags=["weights"]))
    say(step="start", answer=skyrl_rpc(server, "skyrl_start_weight_update",
                                       is_checkpoint_format=True))
    update = server.post_in_thread("collective_rpc", {
        "method": "update_weights_nccl",
        "kwargs": {"update_info": {**metadata, "packed": True}}})
    # trainer_send_weights(trainer_args={"group": ..., "packed": True}): vLLM's default
    # chunk size, which the engine assumes too (no size is announced)
    packed_nccl_broadcast_producer(iter(pairs), group, 0, lambda item: item[1])
    say(step="update", answer=update.result())
    say(step="finish", answer=skyrl_rpc(server, "skyrl_finish_weight_update"))
    if not job["offload_kv"]:  # the fully async trainer keeps the KV it offloads
        say(step="reset", answer=server.post("reset_prefix_cache",
                                             {"reset_running_requests": True}))
    else:
        say(step="wake_kv", answer=skyrl_rpc(server, "skyrl_wake_for_weight_sync",
                                             tags=["kv_cache"]))
    say(step="resume", answer=server.post("resume"))
    dist.destroy_process_group(group.process_group)


def skyrl_ipc(server: Server, job: dict[str, Any]) -> None:
    import pickle

    from torch.multiprocessing.reductions import reduce_tensor

    device = torch.cuda.current_device()
    gpu_uuid = str(torch.cuda.get_device_properties(device).uuid)
    dtype = getattr(torch, job["dtype"])
    say(step="init", answer=server.post("init_weight_transfer_engine", {"init_info": {}}))
    say(step="sleep", answer=server.post("sleep?level=2"))
    say(step="wake_weights", answer=server.post("wake_up?tags=weights"))
    say(step="start", answer=skyrl_rpc(server, "skyrl_start_weight_update",
                                       is_checkpoint_format=True))
    pairs = [(n, t.to(device)) for n, t in pushed_tensors(job["path"], False)]
    for chunk in chunks(pairs, job["chunks"]):
        names, dtype_names, shapes, sizes = [], [], [], []
        packed_tensor = torch.empty(sum(t.numel() for _, t in chunk), device=device,
                                    dtype=dtype, requires_grad=False)
        offset = 0
        for name, tensor in chunk:
            size = tensor.numel()
            packed_tensor[offset:offset + size].copy_(tensor.detach().reshape(-1))
            offset += size
            names.append(name)
            dtype_names.append(job["dtype"])
            shapes.append(list(tensor.shape))
            sizes.append(size)
        merged_handles = {gpu_uuid: reduce_tensor(packed_tensor)}
        torch.cuda.synchronize()
        pickled = base64.b64encode(pickle.dumps(merged_handles)).decode("utf-8")
        say(step="chunk", answer=skyrl_rpc(server, "update_weights_ipc", update_info={
            "names": names, "dtype_names": dtype_names, "shapes": shapes, "sizes": sizes,
            "ipc_handles_pickled": pickled}))
        del packed_tensor  # kept past the answer, as SkyRL keeps it past its barrier
        torch.cuda.ipc_collect()
        torch.cuda.synchronize()
    say(step="finish", answer=skyrl_rpc(server, "skyrl_finish_weight_update"))
    say(step="wake_kv", answer=server.post("wake_up?tags=kv_cache"))


JOBS = {"areal": areal, "slime_group": slime_group, "slime_tensor": slime_tensor,
        "sglang_pairs": sglang_pairs, "trl_vllm": trl_vllm,
        "skyrl_broadcast": skyrl_broadcast, "skyrl_ipc": skyrl_ipc}

if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    JOBS[job["peer"]](Server(job["url"], job.get("api_key")), job)
    say(step="done")
