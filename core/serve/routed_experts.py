"""Routed experts (R3) on the wire: which requests get them, and the two encodings.

The engine returns a request's routes as ``RequestOutput.routed_experts``: ``[prompt +
output - 1, num_hidden_layers, top_k]`` int32, -1 in dense layers (the last output token
is never fed back, so it has none). Two route families carry them:

* vLLM's (``/v1/completions``, ``/v1/chat/completions``, ``/inference/v1/generate``):
  each choice's ``routed_experts``, the array as NumPy ``.npy`` bytes in base64
  (:func:`npy_base64`; a client reads it back with ``np.load(io.BytesIO(
  base64.b64decode(s)))``, shape and dtype included). As in vLLM, a server started with
  ``--enable-return-routed-experts`` gives every choice its routes unless the request
  says ``return_routed_experts: false``; vLLM's ``routed_experts_prompt_start`` leaves
  out the first prompt rows.
* SGLang's ``/generate``: ``meta_info.routed_experts``, the array's little-endian int32
  bytes, flat, in base64 (:func:`flat_int32_base64`), only when the request asks.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np

from kvrunner.serve.errors import APIError

#: the flag a server needs before any request can get routes
SERVER_FLAG = "--enable-return-routed-experts"


def wanted(asked: bool | None, *, recording: bool, param: str = "return_routed_experts"
           ) -> bool:
    """Whether a request gets its routes: ``asked`` as the client set it, None following
    the server (``recording``: it was started with :data:`SERVER_FLAG`), as vLLM does.

    :raises APIError: 400 naming ``param``, for ``True`` on a server that records none
        (its model has no mixture-of-experts layer, or it was started without the flag).
    """
    if asked is None:
        return recording
    if asked and not recording:
        raise APIError(400, f"{param}=true needs a server started with {SERVER_FLAG} "
                       f"(the engine setting enable_return_routed_experts), which records "
                       f"every token's experts; it takes a mixture-of-experts model "
                       f"(Qwen3-MoE, sparse Qwen3-Next) only, and this server records none",
                       param=param)
    return asked


def check_prompt_start(start: int, prompt_len: int, *,
                       param: str = "routed_experts_prompt_start") -> None:
    """vLLM's ``routed_experts_prompt_start``: the first prompt row the answer keeps,
    which must fall inside the prompt.

    :raises APIError: 400 naming ``param``, for a start at or past the prompt's end.
    """
    if start and start >= prompt_len:
        raise APIError(400, f"{param}={start} must be smaller than the prompt's "
                       f"{prompt_len} tokens", param=param)


def npy_base64(routes: np.ndarray) -> str:
    """vLLM's encoding: the array saved as ``.npy`` bytes (shape and dtype in its
    header), in base64."""
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(routes), allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def flat_int32_base64(routes: np.ndarray) -> str:
    """SGLang's encoding: the ``[tokens, layers, top_k]`` expert ids as little-endian
    int32 bytes, flat, in base64 (its clients decode them with ``np.frombuffer(...,
    np.int32)`` and reshape by the model's layers and top-k)."""
    return base64.b64encode(np.ascontiguousarray(routes, dtype="<i4").tobytes()).decode()


def choice_routes(output: Any, prompt_start: int = 0) -> dict[str, str]:
    """A vLLM-shaped choice's ``routed_experts`` field from its finished output (none
    when the request did not get routes), rows from ``prompt_start`` on."""
    routes = None if output is None else getattr(output, "routed_experts", None)
    if routes is None:
        return {}
    return {"routed_experts": npy_base64(routes[prompt_start:])}
