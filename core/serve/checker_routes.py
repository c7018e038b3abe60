"""``/weights_checker``: SGLang's check that a weight update rewrote every tensor, as
slime drives it with ``--check-weight-update-equal``::

    POST /weights_checker {"action": "snapshot"}       # remember the served weights
    POST /weights_checker {"action": "reset_tensors"}  # overwrite them with noise
    ... the trainer pushes its weights ...
    POST /weights_checker {"action": "compare"}        # 200 if all equal the snapshot

kvrunner remembers per-tensor digests (``AsyncLLM.weights_checksum``: Hugging Face
names, tensor-parallel shards merged), not copies of the tensors, so ``compare``
names the tensors that differ without an error size; ``checksum`` answers the
digests. ``reset_tensors`` loads uniform noise in [0, 1) into every tensor of the
served checkpoint (its names and shapes read from the safetensors headers of the
model directory) as one update that keeps the weight version. A failed check is a
400 with SGLang's ``success: false`` and a message naming the tensors. Behind
``--enable-rl-endpoints``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from kvrunner.errors import KvrunnerError
from kvrunner.serve.auth import require_rl_endpoints
from kvrunner.serve.body import parse_body
from kvrunner.serve.errors import engine_error, error_body
from kvrunner.serve.openai_protocol import StrictModel
from kvrunner.serve.state import ServerState

router = APIRouter(dependencies=[Depends(require_rl_endpoints)])

Value = TypeVar("Value")

#: tensors loaded per update while resetting (bounds the noise held at once)
RESET_CHUNK = 64


class CheckWeightsRequest(StrictModel):
    """``POST /weights_checker`` (SGLang's ``CheckWeightsReqInput``)."""

    action: Literal["snapshot", "reset_tensors", "compare", "checksum"] = "checksum"
    #: substrings of tensor names left out of reset, compare and checksum
    skip_tensor_list: list[str] | None = None
    #: a quantized weight may differ by its rounding (kvrunner has no quantized weights)
    allow_quant_error: bool = False
    selector: Literal["target", "draft", "all"] = "all"


def _answer(status: int, message: str, **extra: Any) -> JSONResponse:
    body = {"success": status == 200, "message": message, **extra}
    if status != 200:
        body |= error_body(status, message, "action")
    return JSONResponse(body, status_code=status)


def _kept(by_name: dict[str, Value], skip: list[str] | None) -> dict[str, Value]:
    return {n: v for n, v in by_name.items() if not any(s in n for s in skip or ())}


def _checkpoint_shapes(state: ServerState) -> dict[str, list[int]]:
    from safetensors import safe_open

    if state.model_path is None:
        return {}
    shapes = {}
    for file in sorted(Path(state.model_path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                shapes[name] = list(f.get_slice(name).get_shape())
    return shapes


async def _reset(state: ServerState, skip: list[str] | None) -> int:
    shapes = _kept(_checkpoint_shapes(state), skip)
    if not shapes:
        raise ValueError("the served model has no safetensors checkpoint to read the "
                         "tensors' shapes from")
    engine = state.engine
    names, loaded = sorted(shapes), 0
    for start in range(0, len(names), RESET_CHUNK):
        noise = [(n, torch.rand(shapes[n])) for n in names[start:start + RESET_CHUNK]]
        loaded += await engine.update_weights(noise, weight_version=engine.weight_version)
    return loaded


@router.api_route("/weights_checker", methods=["GET", "POST"])
async def weights_checker(request: Request) -> JSONResponse:
    """Snapshot, reset, compare or checksum the served weights (above)."""
    state: ServerState = request.app.state.server
    body = await parse_body(request, CheckWeightsRequest, optional=True)
    if body.selector == "draft":
        return _answer(400, "selector 'draft': kvrunner serves no draft model")
    snapshots = request.app.state.__dict__.setdefault("weights_snapshot", {})
    try:
        if body.action == "reset_tensors":
            loaded = await _reset(state, body.skip_tensor_list)
            return _answer(200, f"{loaded} tensors reset to noise")
        digests = _kept(await state.engine.weights_checksum(), body.skip_tensor_list)
    except KvrunnerError as e:
        error = engine_error(e)
        return _answer(error.status, error.message)
    except ValueError as e:
        return _answer(400, str(e))
    if body.action == "snapshot":
        snapshots["digests"] = digests
        return _answer(200, f"{len(digests)} tensors snapshotted")
    if body.action == "checksum":
        return _answer(200, f"{len(digests)} tensors", checksums=digests)
    if "digests" not in snapshots:
        return _answer(400, "compare needs a snapshot first (action 'snapshot')")
    expected = _kept(snapshots["digests"], body.skip_tensor_list)
    differ = sorted(n for n in expected.keys() | digests.keys()
                    if expected.get(n) != digests.get(n))
    if differ:
        return _answer(400, f"check tensor equality failed: {len(differ)} of "
                       f"{len(expected)} tensors differ from the snapshot: "
                       f"{', '.join(differ[:20])}{' ...' if len(differ) > 20 else ''}")
    return _answer(200, f"all {len(expected)} tensors equal the snapshot")
