"""vLLM's ``POST /collective_rpc`` for the methods of SkyRL's vLLM worker extension
(``NewInferenceWorkerWrap``), the ones SkyRL's ``RemoteInferenceClient`` calls::

    POST /collective_rpc {"method": "skyrl_start_weight_update",
                          "kwargs": {"is_checkpoint_format": true}}
    POST /collective_rpc {"method": "update_weights_ipc", "kwargs": {"update_info": {
        "names": [...], "dtype_names": [...], "shapes": [...], "sizes": [...],
        "ipc_handles_pickled": "..."}}}                       # colocated, once or more
    POST /collective_rpc {"method": "update_weights_nccl", "kwargs": {"update_info": {
        "names": [...], "dtype_names": [...], "shapes": [...], "packed": true}}}
    POST /collective_rpc {"method": "skyrl_finish_weight_update"}
    POST /collective_rpc {"method": "skyrl_sleep_for_weight_sync",
                          "kwargs": {"offload_kv": true}}
    POST /collective_rpc {"method": "skyrl_wake_for_weight_sync",
                          "kwargs": {"tags": ["weights"]}}

vLLM runs the named method on every worker with ``args`` and ``kwargs`` and answers
``{"results": [...]}``, one entry per worker. kvrunner runs no worker code: each of
these names maps onto the engine's own call, and any other name is a 400 naming it.
The arguments bind as they would to the worker's method (positionally from ``args``,
by name from ``kwargs``), each checked as the weight-transfer routes check theirs.

* ``skyrl_start_weight_update`` / ``skyrl_finish_weight_update`` open and close one
  weight update (``AsyncLLM.start_weight_update``): the chunks between them are its
  parts, and a refused part closes it as a failed push.
* ``update_weights_ipc``: one chunk as SkyRL packs it, a flat buffer of the chunk's
  one dtype shared by CUDA IPC (``{gpu_uuid: (rebuild_cuda_tensor, args)}``, pickled
  and base64-encoded) with ``sizes`` in elements, read by the same restricted reader
  as vLLM's IPC handles (:mod:`kvrunner.weight_sync.ipc_handles`).
* ``update_weights_nccl``: vLLM's update info, received from the weight-transfer
  group (``/init_weight_transfer_engine``) as ``/update_weights`` receives it.
* ``skyrl_sleep_for_weight_sync`` frees the KV pool and the weights (level 2, the
  weights discarded: the push rewrites them all); kvrunner keeps no KV cache on the
  host, so it is refused (409) while requests are in the engine.
  ``skyrl_wake_for_weight_sync`` brings back the tagged parts.

``timeout`` is taken and bounds nothing: a weight push cut short would leave partial
weights, so every call runs to its end (or its refusal). Behind
``--enable-rl-endpoints`` and ``--weight-transfer-config``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import attrs
from fastapi import APIRouter, Depends, Request
from pydantic import Field, ValidationError

from kvrunner.async_engine.errors import EngineBusyError
from kvrunner.errors import KvrunnerError
from kvrunner.serve.auth import require_rl_endpoints
from kvrunner.serve.body import parse_body
from kvrunner.serve.errors import APIError, engine_call, engine_error, validation_error
from kvrunner.serve.openai_protocol import StrictModel
from kvrunner.serve.state import ServerState
from kvrunner.serve.weight_transfer_routes import (
    NcclUpdateInfo,
    receive_from_group,
    transfer_call,
    transfer_state,
)

router = APIRouter(dependencies=[Depends(require_rl_endpoints)])


class CollectiveRpcRequest(StrictModel):
    """vLLM's ``/collective_rpc`` body."""

    method: Annotated[str, Field(min_length=1)]
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    #: seconds vLLM waits for its workers; taken, bounds nothing here (module doc)
    timeout: Annotated[float, Field(gt=0)] | None = None


class StartArgs(StrictModel):
    """``skyrl_start_weight_update(is_checkpoint_format=True)``."""

    is_checkpoint_format: bool = True


class NoArgs(StrictModel):
    """A method that takes no arguments."""


class SkyrlIpcUpdateInfo(StrictModel):
    """One chunk of SkyRL's CUDA IPC push (``CudaIpcWeightTransferSender``): the
    tensors packed back to back in one flat buffer of their one dtype."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[Annotated[int, Field(ge=0)]]]
    #: each tensor's elements in the buffer
    sizes: list[Annotated[int, Field(ge=0)]]
    #: base64 of the pickled ``{gpu_uuid: (rebuild_cuda_tensor, args)}`` of the buffer
    ipc_handles_pickled: str


class IpcArgs(StrictModel):
    """``update_weights_ipc(update_info)``."""

    update_info: SkyrlIpcUpdateInfo


class NcclArgs(StrictModel):
    """``update_weights_nccl(update_info)``: vLLM's NCCL update info."""

    update_info: NcclUpdateInfo


class SleepArgs(StrictModel):
    """``skyrl_sleep_for_weight_sync(offload_kv=True)``."""

    offload_kv: bool = True


class WakeArgs(StrictModel):
    """``skyrl_wake_for_weight_sync(tags)``."""

    tags: list[str] | None


async def _start(state: ServerState, call: StartArgs) -> None:
    if not call.is_checkpoint_format:
        raise APIError(400, "skyrl_start_weight_update: is_checkpoint_format false (vLLM's "
                       "kernel layout) is not served; kvrunner loads tensors under the "
                       "checkpoint's names only", param="kwargs.is_checkpoint_format")
    await transfer_call(state.engine.start_weight_update())


async def _update_ipc(state: ServerState, call: IpcArgs) -> None:
    info = call.update_info
    for name in ("dtype_names", "shapes", "sizes"):
        if len(getattr(info, name)) != len(info.names):
            raise APIError(400, f"update_info.{name} has {len(getattr(info, name))} entries "
                           f"for {len(info.names)} names", param=f"kwargs.update_info.{name}")
    await transfer_call(state.engine.update_weights_from_ipc_handles(
        info.names, info.dtype_names, info.shapes,
        ipc_handles_pickled=info.ipc_handles_pickled, element_sizes=info.sizes))


async def _update_nccl(state: ServerState, call: NcclArgs) -> None:
    if state.settings.weight_transfer_backend != "nccl":
        raise APIError(400, "update_weights_nccl needs the nccl weight-transfer backend "
                       "(--weight-transfer-config '{\"backend\": \"nccl\"}'); this server "
                       f"runs {state.settings.weight_transfer_backend!r}", param="method")
    await receive_from_group(state, call.update_info, "kwargs.update_info")


async def _finish(state: ServerState, _call: NoArgs) -> None:
    await transfer_call(state.engine.finish_weight_update())


async def _sleep(state: ServerState, _call: SleepArgs) -> None:
    # offload_kv says what becomes of the frozen requests' KV; with none in the engine
    # (the only case served) there is nothing to keep either way
    try:
        await state.engine.sleep(level=2, discard_weights=True)
    except EngineBusyError as e:
        raise APIError(409, f"skyrl_sleep_for_weight_sync: {e}. kvrunner keeps no KV cache "
                       f"on the host across a sleep, so requests frozen by a keep pause "
                       f"cannot sleep through a weight sync (SkyRL: leave "
                       f"generator.inference_engine.offload_kv_for_weight_sync false)"
                       ) from None
    except KvrunnerError as e:
        raise engine_error(e) from None


async def _wake(state: ServerState, call: WakeArgs) -> None:
    await engine_call(state.engine.wake_up(tags=call.tags))


@attrs.frozen
class Method:
    """One worker-extension method kvrunner serves: its arguments and its engine call."""

    arguments: type[StrictModel]
    run: Callable[[ServerState, Any], Awaitable[None]]


#: the methods of SkyRL's worker extension, by name
METHODS: dict[str, Method] = {
    "skyrl_start_weight_update": Method(StartArgs, _start),
    "update_weights_ipc": Method(IpcArgs, _update_ipc),
    "update_weights_nccl": Method(NcclArgs, _update_nccl),
    "skyrl_finish_weight_update": Method(NoArgs, _finish),
    "skyrl_sleep_for_weight_sync": Method(SleepArgs, _sleep),
    "skyrl_wake_for_weight_sync": Method(WakeArgs, _wake),
}


def bind(name: str, method: Method, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """``args`` and ``kwargs`` bound to ``method``'s parameters as Python binds them to
    the worker's method, then checked; a fault is a 400 naming the argument
    (``args.0``, ``kwargs.update_info.names``)."""
    fields = list(method.arguments.model_fields)
    if len(args) > len(fields):
        raise APIError(400, f"collective_rpc method {name!r} takes {len(fields)} argument(s) "
                       f"({', '.join(fields) or 'none'}), got {len(args)} in args",
                       param="args")
    values, where = dict(kwargs), {k: ("kwargs", k) for k in kwargs}
    for i, (field, value) in enumerate(zip(fields, args, strict=False)):
        if field in kwargs:
            raise APIError(400, f"collective_rpc method {name!r}: {field} is given both in "
                           f"args and in kwargs", param=f"kwargs.{field}")
        values[field], where[field] = value, ("args", i)
    try:
        return method.arguments.model_validate(values)
    except ValidationError as e:
        errors = []
        for error in e.errors(include_url=False):
            loc = tuple(error.get("loc", ()))
            head = where.get(loc[0], ("kwargs", loc[0])) if loc else ("kwargs",)
            errors.append({**error, "loc": (*head, *loc[1:])})
        raise validation_error(errors) from None


@router.post("/collective_rpc")
async def collective_rpc(request: Request) -> dict[str, Any]:
    """Run one of SkyRL's worker-extension methods as the engine's own call; answers
    vLLM's ``{"results": [null, ...]}``, one per engine rank."""
    state = transfer_state(request)
    body = await parse_body(request, CollectiveRpcRequest)
    method = METHODS.get(body.method)
    if method is None:
        raise APIError(400, f"collective_rpc method {body.method!r} is not served: kvrunner "
                       f"runs no worker code, and serves SkyRL's worker-extension methods "
                       f"{sorted(METHODS)}", param="method")
    await method.run(state, bind(body.method, method, body.args, body.kwargs))
    ranks = int(state.engine.config.parallel.tensor_parallel_size)
    return {"results": [None] * ranks}
