"""vLLM's native weight-transfer routes, as ``vllm serve --weight-transfer-config
'{"backend": "nccl"}'`` answers them and TRL's ``VLLMClient`` calls them::

    POST /init_weight_transfer_engine {"init_info": {"master_address": "10.0.0.1",
        "master_port": 29600, "rank_offset": 1, "world_size": 2, "packed": true}}
    POST /start_weight_update {}
    POST /update_weights {"update_info": {"names": [...], "dtype_names": ["bfloat16", ...],
                                          "shapes": [[...], ...]}}     # once or more
    POST /finish_weight_update {"weight_version": "7"}

The ``ipc`` backend takes CUDA IPC handles from a colocated trainer
(:mod:`kvrunner.weight_sync.ipc_handles`): ``/init_weight_transfer_engine`` takes an
empty ``init_info`` and does nothing, and each ``/update_weights`` carries the
handles pickled and base64-encoded::

    POST /update_weights {"update_info": {"names": [...], "dtype_names": [...],
                                          "shapes": [...], "ipc_handles_pickled": "...",
                                          "tensor_sizes": [...]}}     # packed only

The ``nccl`` backend is kvrunner's weight-update group (``kvrunner.weight_sync``,
docs/weight_sync.md): ``/init_weight_transfer_engine`` joins every engine rank to
the trainer's group as ``rank_offset + r`` (NCCL on a CUDA engine, gloo on a CPU
one), ``/update_weights`` receives the announced tensors from its rank 0, one
broadcast each or, ``packed``, vLLM's packed chunks
(:mod:`kvrunner.weight_sync.packed_broadcast`). ``packed`` and its buffer size come
with the init info (vLLM from 0.28) or with each update (before). The updates
between ``/start_weight_update`` and ``/finish_weight_update`` are one weight
update (``AsyncLLM.start_weight_update``): nothing generates until it is finished,
and a part that fails closes it as a failed push. An ``/update_weights`` outside
them is one update by itself. Behind ``--enable-rl-endpoints``; without
``--weight-transfer-config`` the routes answer 400 naming the flag.
"""

from __future__ import annotations

from typing import Annotated, Any

import attrs
from fastapi import APIRouter, Depends, Request
from pydantic import Field

from kvrunner.errors import KvrunnerError
from kvrunner.serve.auth import require_rl_endpoints
from kvrunner.serve.body import parse_body
from kvrunner.serve.errors import APIError, engine_error
from kvrunner.serve.openai_protocol import StrictModel
from kvrunner.serve.state import ServerState
from kvrunner.weight_sync.errors import WeightSyncError
from kvrunner.weight_sync.packed_broadcast import (
    DEFAULT_PACKED_BUFFER_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
)

router = APIRouter(dependencies=[Depends(require_rl_endpoints)])

#: the group's store prefix (the trainer's rank 0 joins under the same name)
GROUP_NAME = "kvrunner_weights"


class NcclInitInfo(StrictModel):
    """vLLM's ``NCCLWeightTransferInitInfo``."""

    master_address: Annotated[str, Field(min_length=1)]
    master_port: Annotated[int, Field(gt=0, lt=65536)]
    rank_offset: Annotated[int, Field(ge=1)]
    world_size: Annotated[int, Field(ge=2)]
    packed: bool = False
    packed_buffer_size_bytes: Annotated[int, Field(gt=0)] = DEFAULT_PACKED_BUFFER_BYTES
    packed_num_buffers: Annotated[int, Field(ge=1)] = DEFAULT_PACKED_NUM_BUFFERS
    #: kvrunner's: how long the rendezvous waits for the trainer
    timeout_s: Annotated[float, Field(gt=0)] = 300.0


class InitWeightTransferRequest(StrictModel):
    """``POST /init_weight_transfer_engine``."""

    init_info: NcclInitInfo


class IpcInitInfo(StrictModel):
    """vLLM's ``IPCWeightTransferInitInfo``: nothing to set up (``packed``, which one
    vLLM version put here, is accepted; the form of each update's handles says it)."""

    packed: bool | None = None


class UpdateInfoBase(StrictModel):
    """The fields vLLM's ``WeightTransferUpdateInfo`` adds to every backend's (its
    trainers send them with ``asdict``), each taken only at the value kvrunner serves."""

    #: the checkpoint's (Hugging Face) names: false (vLLM's kernel layout) is refused
    is_checkpoint_format: bool = True
    #: ``"dense"``: whole tensors (``"sparse_flat"`` patches are refused)
    update_kind: str = "dense"
    #: sparse updates' entry counts (none for a dense update)
    num_updates_list: None = None


class NcclUpdateInfo(UpdateInfoBase):
    """vLLM's ``NCCLWeightTransferUpdateInfo``; the packing fields, when given, are
    those of vLLM before 0.28 (since, they come with the init info)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[Annotated[int, Field(ge=0)]]]
    packed: bool | None = None
    packed_buffer_size_bytes: Annotated[int, Field(gt=0)] | None = None
    packed_num_buffers: Annotated[int, Field(ge=1)] | None = None


class UpdateWeightsRequest(StrictModel):
    """``POST /update_weights``."""

    update_info: NcclUpdateInfo


class IpcUpdateInfo(UpdateInfoBase):
    """vLLM's ``IPCWeightTransferUpdateInfo`` as its HTTP client sends it."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[Annotated[int, Field(ge=0)]]]
    #: base64 of the pickled handles: a list of ``{gpu_uuid: handle}`` (one per tensor)
    #: or one ``{gpu_uuid: handle}`` (packed)
    ipc_handles_pickled: str | None = None
    #: the handles unpickled: vLLM's Ray client's form, which JSON cannot carry
    ipc_handles: Any = None
    #: packed: each tensor's bytes in the buffer
    tensor_sizes: list[Annotated[int, Field(ge=0)]] | None = None
    #: the form, as one vLLM version said it per update
    packed: bool | None = None


class IpcUpdateWeightsRequest(StrictModel):
    """``POST /update_weights`` of the ``ipc`` backend."""

    update_info: IpcUpdateInfo


class IpcInitWeightTransferRequest(StrictModel):
    """``POST /init_weight_transfer_engine`` of the ``ipc`` backend."""

    init_info: IpcInitInfo


class StartWeightUpdateRequest(StrictModel):
    """``POST /start_weight_update`` (an empty body is fine)."""

    #: the tensors come under the checkpoint's (Hugging Face) names, the only form
    #: kvrunner loads; false (vLLM's kernel layout) is refused by name
    is_checkpoint_format: bool = True


class FinishWeightUpdateRequest(StrictModel):
    """``POST /finish_weight_update`` (an empty body is fine)."""

    weight_version: str | None = None


@attrs.frozen
class Packing:
    """How the trainer announced it packs (the init info's settings)."""

    packed: bool
    buffer_bytes: int


def transfer_state(request: Request) -> ServerState:
    state = request.app.state.server
    if state.settings.weight_transfer_backend is None:
        raise APIError(400, "this server has no weight-transfer engine: start it with "
                       "--weight-transfer-config '{\"backend\": \"nccl\"}' (a weight-update "
                       "group) or '{\"backend\": \"ipc\"}' (CUDA IPC handles from a "
                       "colocated trainer)", param="body")
    return state


async def transfer_call(coro: Any) -> Any:
    try:
        return await coro
    except WeightSyncError as e:
        raise APIError(400, str(e)) from None
    except KvrunnerError as e:
        raise engine_error(e) from None


@router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(request: Request) -> dict[str, Any]:
    """Join every engine rank to the trainer's weight-update group (returns once the
    trainer's rank 0 has joined too); the ``ipc`` backend has nothing to set up."""
    state = transfer_state(request)
    if state.settings.weight_transfer_backend == "ipc":
        await parse_body(request, IpcInitWeightTransferRequest)
        return {"message": "Weight transfer initialized"}
    info = (await parse_body(request, InitWeightTransferRequest)).init_info
    backend = "nccl" if state.engine.device.startswith("cuda") else "gloo"
    await transfer_call(state.engine.init_weights_update_group(
        info.master_address, info.master_port, info.rank_offset, info.world_size,
        backend=backend, group_name=GROUP_NAME, timeout_s=info.timeout_s))
    state.weight_transfer = Packing(info.packed, info.packed_buffer_size_bytes)
    return {"message": "Weight transfer initialized"}


@router.post("/start_weight_update")
async def start_weight_update(request: Request) -> dict[str, Any]:
    """Open one weight update: the ``/update_weights`` calls until
    ``/finish_weight_update`` are its parts."""
    state = transfer_state(request)
    body = await parse_body(request, StartWeightUpdateRequest, optional=True)
    if not body.is_checkpoint_format:
        raise APIError(400, "is_checkpoint_format: kvrunner loads tensors under the "
                       "checkpoint's names only (false, vLLM's kernel layout, is not "
                       "served)", param="is_checkpoint_format")
    await transfer_call(state.engine.start_weight_update())
    return {"message": "Weight update started"}


@router.post("/update_weights")
async def update_weights(request: Request) -> dict[str, Any]:
    """Receive the announced tensors from the group's rank 0 (``nccl``) or open the
    colocated trainer's IPC handles (``ipc``) and load them."""
    state = transfer_state(request)
    if state.settings.weight_transfer_backend == "ipc":
        return await _update_from_ipc_handles(state, request)
    info = (await parse_body(request, UpdateWeightsRequest)).update_info
    loaded = await receive_from_group(state, info, "update_info")
    return {"message": "Weights updated", "loaded": loaded}


async def receive_from_group(state: ServerState, info: NcclUpdateInfo, field: str) -> int:
    """Receive ``info``'s tensors from the weight-transfer group's rank 0 and load
    them (``field`` names where the info came in, for the errors); returns how many
    loaded."""
    check_update_info(info, field)
    packing = state.weight_transfer
    if packing is None:
        raise APIError(400, "no weight-transfer group: POST /init_weight_transfer_engine "
                       "first", param=field)
    packed = packing.packed if info.packed is None else info.packed
    buffer_bytes = info.packed_buffer_size_bytes or packing.buffer_bytes
    return await transfer_call(state.engine.update_weights_from_distributed(
        info.names, info.dtype_names, info.shapes,
        packed_bytes=buffer_bytes if packed else None))


def check_update_info(info: UpdateInfoBase, field: str = "update_info") -> None:
    """Refuse what a model cannot say: lists of other lengths than ``names``, and the
    base fields at a value kvrunner does not serve (``field`` names the info)."""
    names = info.names  # type: ignore[attr-defined]
    for name in ("dtype_names", "shapes"):
        if len(getattr(info, name)) != len(names):
            raise APIError(400, f"{field}.{name} has {len(getattr(info, name))} "
                           f"entries for {len(names)} names", param=f"{field}.{name}")
    if not info.is_checkpoint_format:
        raise APIError(400, f"{field}.is_checkpoint_format: kvrunner loads tensors under "
                       "the checkpoint's names only (false, vLLM's kernel layout, is not "
                       "served)", param=f"{field}.is_checkpoint_format")
    if info.update_kind != "dense":
        raise APIError(400, f"{field}.update_kind {info.update_kind!r}: kvrunner loads "
                       f"whole tensors ('dense') only", param=f"{field}.update_kind")


async def _update_from_ipc_handles(state: ServerState, request: Request) -> dict[str, Any]:
    info = (await parse_body(request, IpcUpdateWeightsRequest)).update_info
    check_update_info(info)
    if info.ipc_handles is not None:
        raise APIError(400, "update_info.ipc_handles: CUDA IPC handles cannot travel as "
                       "JSON; send them pickled and base64-encoded in ipc_handles_pickled, "
                       "as vLLM's HTTP client does", param="update_info.ipc_handles")
    if info.ipc_handles_pickled is None:
        raise APIError(400, "update_info needs ipc_handles_pickled (the base64 of the "
                       "pickled handles)", param="update_info.ipc_handles_pickled")
    if info.tensor_sizes is not None and len(info.tensor_sizes) != len(info.names):
        raise APIError(400, f"update_info.tensor_sizes has {len(info.tensor_sizes)} entries "
                       f"for {len(info.names)} names", param="update_info.tensor_sizes")
    loaded = await transfer_call(state.engine.update_weights_from_ipc_handles(
        info.names, info.dtype_names, info.shapes,
        ipc_handles_pickled=info.ipc_handles_pickled, tensor_sizes=info.tensor_sizes,
        packed=info.packed))
    return {"message": "Weights updated", "loaded": loaded}


@router.post("/finish_weight_update")
async def finish_weight_update(request: Request) -> dict[str, Any]:
    """Close the open weight update; the served version becomes ``weight_version``."""
    state = transfer_state(request)
    body = await parse_body(request, FinishWeightUpdateRequest, optional=True)
    await transfer_call(state.engine.finish_weight_update(weight_version=body.weight_version))
    return {"message": "Weight update finished"}


@router.post("/start_draft_weight_update")
async def start_draft_weight_update(request: Request) -> dict[str, Any]:
    """vLLM's update of a speculative draft model: kvrunner serves none."""
    transfer_state(request)
    raise APIError(400, "start_draft_weight_update: kvrunner serves no draft model")
