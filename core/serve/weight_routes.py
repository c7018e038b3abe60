"""Weights from a trainer's process over HTTP: ``POST /update_weights_from_tensor``,
the weight-update group routes and ``/weights_checksum``.

``/update_weights_from_tensor`` takes either body:

* SGLang's own (``UpdateWeightsFromTensorReqInput``, as SGLang's and slime's senders
  write it): ``serialized_named_tensors`` (one ``MultiprocessingSerializer`` payload
  per tensor-parallel rank: tensors by reference, CUDA IPC or CPU shared memory),
  ``load_format`` (``None``, ``"direct"`` or slime's ``"flattened_bucket"``),
  ``flush_cache``, ``abort_all_requests``, ``weight_version``. The payload is read by
  a restricted unpickler that rebuilds tensors and refuses every other call
  (``kvrunner.weight_sync.tensor_payload``); tensor-parallel rank ``r`` opens entry
  ``r`` (``AsyncLLM.update_weights_from_tensor``: one update, which may hold part
  of the weights; a count of entries other than the engine's TP size is a 400
  naming both).
* kvrunner's push: the body names a :class:`~kvrunner.weight_sync.BucketSender`
  listening in the trainer's process (``ipc_address``, ``ipc_authkey`` as hex); the
  server connects, receives one whole push (double-buffered CUDA-IPC buckets, shared
  memory on the CPU, each acknowledged after its copy completed on the device) and
  answers when it is done. The trainer posts this and runs ``sender.push(...)`` at
  the same time::

    POST /pause_generation {"mode": "in_place"}
    POST /update_weights_from_tensor {"ipc_address": "127.0.0.1:41234",
                                      "ipc_authkey": "9f...", "weight_version": "7"}
    POST /continue_generation

A push that fails part way answers 400 naming the bucket and leaves the engine
refusing to generate until a full push (docs/weight_sync.md). Behind
``--enable-rl-endpoints``, like every control route.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BeforeValidator, Field

from kvrunner.errors import KvrunnerError
from kvrunner.serve.auth import require_rl_endpoints
from kvrunner.serve.body import parse_body
from kvrunner.serve.errors import APIError, engine_error, error_body
from kvrunner.serve.openai_protocol import StrictModel
from kvrunner.weight_sync.errors import WeightSyncError
from kvrunner.weight_sync.tensor_payload import LOAD_FORMATS

router = APIRouter(dependencies=[Depends(require_rl_endpoints)])


class UpdateWeightsFromTensorRequest(StrictModel):
    """``POST /update_weights_from_tensor``: SGLang's fields, or kvrunner's push."""

    #: SGLang's form: one MultiprocessingSerializer payload (base64) per TP rank
    serialized_named_tensors: list[str] | None = None
    #: None / "direct": (name, tensor) pairs; "flattened_bucket": slime's bucket
    load_format: str | None = None
    #: kvrunner's form: where the trainer's BucketSender listens ("host:port" or a
    #: Unix socket path) and its authkey as hex (``sender.authkey.hex()``)
    ipc_address: Annotated[str, Field(min_length=1)] | None = None
    ipc_authkey: Annotated[str, Field(min_length=2)] | None = None
    weight_version: str | None = None
    abort_all_requests: bool = False
    #: reset the prefix cache after the update; false keeps it, as SGLang does (with
    #: ``--salt-prefix-cache-by-weight-version``, the default, no later request reuses
    #: the old weights' KV all the same)
    flush_cache: bool = True
    check_finite: bool = True
    timeout_s: Annotated[float, Field(gt=0)] = 300.0
    #: SGLang's fields for what kvrunner does not have (a draft model) or always does
    #: (the allocator's cache is its own business): accepted at these values
    disable_draft_model: bool | None = None
    torch_empty_cache: bool = False


def _failed(status: int, message: str, param: str | None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param)
                        | {"success": False, "message": message}, status_code=status)


def _loaded(loaded: int, weight_version: str | None) -> JSONResponse:
    version = f"; weight version {weight_version}" if weight_version else ""
    return JSONResponse({"success": True, "message": f"{loaded} tensors loaded{version}",
                         "loaded": loaded})


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: Request) -> JSONResponse:
    """Load the tensors SGLang's ``serialized_named_tensors`` hold, or receive one whole
    push from the trainer's BucketSender named in the body."""
    body = await parse_body(request, UpdateWeightsFromTensorRequest)
    if body.serialized_named_tensors is not None:
        if body.ipc_address is not None or body.ipc_authkey is not None:
            raise APIError(400, "give serialized_named_tensors (SGLang's form) or "
                           "ipc_address and ipc_authkey (kvrunner's push), not both",
                           param="ipc_address")
        return await _from_serialized(request, body)
    for field in ("ipc_address", "ipc_authkey"):
        if getattr(body, field) is None:
            raise APIError(400, f"the body needs serialized_named_tensors, or {field} with "
                           f"the other field of a kvrunner push", param=field)
    return await _from_sender(request, body)


async def _from_serialized(request: Request, body: UpdateWeightsFromTensorRequest
                           ) -> JSONResponse:
    engine = request.app.state.server.engine
    if body.disable_draft_model:
        return _failed(400, "disable_draft_model: kvrunner serves no draft model",
                       "disable_draft_model")
    if body.load_format not in LOAD_FORMATS:
        return _failed(400, f"load_format {body.load_format!r} is not one kvrunner reads "
                       f"({', '.join(repr(f) for f in LOAD_FORMATS)})", "load_format")
    if body.abort_all_requests:
        await engine.abort_all()
    try:
        # each rank opens its own entry (the trainer's shared memory or CUDA IPC
        # handles) and every copy is done before the answer
        loaded = await engine.update_weights_from_tensor(
            body.serialized_named_tensors, body.load_format,
            weight_version=body.weight_version, check_finite=body.check_finite,
            reset_prefix_cache=body.flush_cache)
    except WeightSyncError as e:
        return _failed(400, str(e), "serialized_named_tensors")
    except KvrunnerError as e:
        error = engine_error(e)
        return _failed(error.status, error.message, None)
    return _loaded(loaded, body.weight_version)


async def _from_sender(request: Request, body: UpdateWeightsFromTensorRequest) -> JSONResponse:
    engine = request.app.state.server.engine
    try:
        authkey = bytes.fromhex(body.ipc_authkey or "")
    except ValueError:
        return _failed(400, "ipc_authkey must be hex (sender.authkey.hex())", "ipc_authkey")
    if body.abort_all_requests:
        await engine.abort_all()
    try:
        loaded = await engine.update_weights_from_ipc(
            body.ipc_address, authkey=authkey, weight_version=body.weight_version,
            check_finite=body.check_finite, timeout_s=body.timeout_s,
            reset_prefix_cache=body.flush_cache)
    except WeightSyncError as e:
        return _failed(400, str(e), None)
    except KvrunnerError as e:
        error = engine_error(e)
        return _failed(error.status, error.message, None)
    return _loaded(loaded, body.weight_version)


@router.get("/weights_checksum")
async def weights_checksum(request: Request) -> JSONResponse:
    """Per-tensor digests of the served weights under their Hugging Face names
    (``kvrunner.weight_sync.checksum``), TP shards merged."""
    engine = request.app.state.server.engine
    try:
        digests = await engine.weights_checksum()
    except KvrunnerError as e:
        error = engine_error(e)
        return _failed(error.status, error.message, None)
    return JSONResponse({"success": True, "checksums": digests})


def _port_number(value: Any) -> Any:
    """A port given as decimal text is the number (other values pass unchanged, for the
    field's own checks to name)."""
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return value


class InitWeightsUpdateGroupRequest(StrictModel):
    """``POST /init_weights_update_group`` (SGLang's fields)."""

    master_address: Annotated[str, Field(min_length=1)]
    #: an int, or its decimal text (SGLang coerces it: AReaL and slime send a string)
    master_port: Annotated[int, BeforeValidator(_port_number), Field(gt=0, lt=65536)]
    rank_offset: Annotated[int, Field(ge=1)]
    world_size: Annotated[int, Field(ge=2)]
    group_name: str = "kvrunner_weights"
    backend: Literal["nccl", "gloo"] = "nccl"
    timeout_s: Annotated[float, Field(gt=0)] = 300.0


class UpdateWeightsFromDistributedRequest(StrictModel):
    """``POST /update_weights_from_distributed`` (SGLang's fields)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    weight_version: str | None = None
    group_name: str = "kvrunner_weights"
    flush_cache: bool = True
    abort_all_requests: bool = False
    #: one broadcast per tensor; SGLang's "flattened_bucket" (one broadcast of all)
    #: is refused by name
    load_format: Literal["direct"] | None = None


async def _answer(call: Any, success: str) -> JSONResponse:
    try:
        result = await call
    except WeightSyncError as e:
        return _failed(400, str(e), None)
    except KvrunnerError as e:
        error = engine_error(e)
        return _failed(error.status, error.message, None)
    body: dict[str, Any] = {"success": True, "message": success}
    if isinstance(result, int):
        body["loaded"] = result
    return JSONResponse(body)


@router.post("/init_weights_update_group")
async def init_weights_update_group(request: Request) -> JSONResponse:
    """Join every engine rank to the trainer's weight-update group (rank_offset + r)."""
    body = await parse_body(request, InitWeightsUpdateGroupRequest)
    engine = request.app.state.server.engine
    return await _answer(engine.init_weights_update_group(
        body.master_address, body.master_port, body.rank_offset, body.world_size,
        backend=body.backend, group_name=body.group_name, timeout_s=body.timeout_s),
        f"joined the weight-update group {body.group_name}")


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request) -> JSONResponse:
    """Receive one broadcast per named tensor from the group's rank 0, as one push."""
    body = await parse_body(request, UpdateWeightsFromDistributedRequest)
    engine = request.app.state.server.engine
    if body.abort_all_requests:
        await engine.abort_all()
    return await _answer(engine.update_weights_from_distributed(
        body.names, body.dtypes, body.shapes, weight_version=body.weight_version,
        reset_prefix_cache=body.flush_cache), "weights received")


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request) -> JSONResponse:
    """Leave the weight-update group."""
    return await _answer(request.app.state.server.engine.destroy_weights_update_group(),
                         "left the weight-update group")


class PostProcessWeightsRequest(StrictModel):
    """``POST /post_process_weights`` (slime's SGLang patch: ``PostProcessWeightsReqInput``)."""

    restore_weights_before_load: bool = False
    post_process_quantization: bool = False


@router.post("/post_process_weights")
async def post_process_weights(request: Request) -> JSONResponse:
    """slime's hooks around a push of quantized weights (restore the load layout before,
    re-quantize after). kvrunner serves no quantized weights, so neither has anything
    to do: both answer success."""
    body = await parse_body(request, PostProcessWeightsRequest, optional=True)
    done = [step for step, asked in (("restore_weights_before_load",
                                      body.restore_weights_before_load),
                                     ("post_process_quantization",
                                      body.post_process_quantization)) if asked]
    return JSONResponse({"success": True, "message": (
        f"{', '.join(done)}: nothing to do (no quantized weights)" if done else "nothing asked")})

