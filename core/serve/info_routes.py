"""Health and what the server serves, at SGLang's paths: ``/health``,
``/health_generate``, ``/get_model_info``, ``/get_weight_version``, ``/server_info``
(also ``/get_server_info``, with vLLM's ``vllm_config`` beside SGLang's keys). Open
to every client holding the API key."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from kvrunner import __version__
from kvrunner.sampling_params import SamplingParams
from kvrunner.serve.errors import APIError
from kvrunner.serve.state import ServerState, new_id
from kvrunner.serve.vllm_routes import is_sleeping

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _require_serving(state: ServerState) -> None:
    dead = state.engine.dead_error
    if dead is not None:
        raise APIError(503, f"{dead}; the server is exiting")
    if not state.admission.open:
        raise APIError(503, "the server is shutting down")


@router.get("/health")
async def health(request: Request) -> dict[str, str]:
    """200 while the server takes requests (the engine is loaded), 503 once it is
    shutting down or its engine is dead (a rank died: the process then exits
    non-zero)."""
    _require_serving(_state(request))
    return {"status": "ok"}


@router.get("/health_generate")
async def health_generate(request: Request) -> dict[str, Any]:
    """Generate one token end to end; 503 while shutting down, asleep or paused (it
    could not generate), or when the engine fails."""
    state = _state(request)
    _require_serving(state)
    engine = state.engine
    if engine.is_paused or is_sleeping(engine.stats()):
        raise APIError(503, "the engine is paused or asleep and generates nothing now")
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    try:
        out = await engine.generate([0], params, request_id=new_id("health"))
    except Exception as e:
        raise APIError(503, f"generating one token failed: {type(e).__name__}: {e}") from None
    return {"status": "ok", "token_ids": list(out.token_ids)}


@router.get("/get_model_info")
async def get_model_info(request: Request) -> dict[str, Any]:
    state = _state(request)
    path = str(state.model_path) if state.model_path else state.model_name
    return {
        "model_path": path,
        "tokenizer_path": path if state.engine.tokenizer is not None else None,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": state.engine.stats().weight_version,
        "served_model_name": state.model_name,
    }


@router.get("/get_weight_version")
async def get_weight_version(request: Request) -> dict[str, Any]:
    return {"weight_version": _state(request).engine.stats().weight_version}


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(request: Request) -> dict[str, Any]:
    """The server's settings (not the key), the engine's and its live figures; the
    engine's settings again as vLLM's ``vllm_config`` (``?config_format=json`` for the
    object, else its text, as vLLM answers)."""
    state = _state(request)
    config = state.engine.config
    stats = state.engine.stats()
    settings = state.settings
    vllm_config = _vllm_config(state)
    if request.query_params.get("config_format", "text") != "json":
        vllm_config = ", ".join(
            f"{section}={values}" if not isinstance(values, dict) else
            ", ".join(f"{section}.{key}={value}" for key, value in values.items())
            for section, values in vllm_config.items())
    return {
        "vllm_config": vllm_config,
        "version": __version__,
        "model_path": str(state.model_path) if state.model_path else state.model_name,
        "served_model_name": state.model_name,
        "host": settings.host,
        "port": settings.port,
        "api_key_set": settings.api_key is not None,
        "enable_rl_endpoints": settings.enable_rl_endpoints,
        "max_n": settings.max_n,
        "max_logprobs": settings.max_logprobs,
        "max_body_bytes": settings.max_body_bytes,
        "shutdown_mode": settings.shutdown_mode,
        "tp_size": int(config.parallel.tensor_parallel_size),
        **_sglang_server_args(state),
        "max_running_requests": int(config.scheduler.max_num_seqs),
        "max_model_len": state.max_model_len,
        "context_length": state.max_model_len,
        "weight_version": stats.weight_version,
        "internal_states": [{
            "num_running": stats.num_running, "num_waiting": stats.num_waiting,
            "blocks_used": stats.blocks_used, "blocks_total": stats.blocks_total,
            "paused": bool(stats.paused), "sleep_state": stats.sleep_state,
            "last_step_s": stats.last_step_s,
        }],
    }


def _sglang_server_args(state: ServerState) -> dict[str, Any]:
    """SGLang ``ServerArgs`` keys the RL trainers read from a server they did not start
    (slime's external engines, ``slime/backends/sglang_utils/external.py`` and
    ``sglang_engine.py::_init_external``): its parallel layout, its dtype, and what it
    can do. ``enable_memory_saver`` is true: ``/release_memory_occupation`` always
    frees the weights' and the KV cache's device memory; ``enable_return_routed_experts``
    is the engine's (``/generate`` then answers ``return_routed_experts``)."""
    config = state.engine.config
    tp = int(config.parallel.tensor_parallel_size)
    return {"pp_size": 1, "dp_size": 1, "ep_size": 1, "moe_dp_size": 1, "num_gpus": tp,
            "dtype": state.engine.dtype, "random_seed": config.seed,
            "enable_memory_saver": True,
            "enable_return_routed_experts": bool(config.enable_return_routed_experts),
            "disaggregation_mode": "null", "encoder_only": False}


def _vllm_config(state: ServerState) -> dict[str, dict[str, Any]]:
    """The engine's settings under the names of vLLM's config sections."""
    config = state.engine.config
    tp = int(config.parallel.tensor_parallel_size)
    backend = state.settings.weight_transfer_backend
    return {
        "model_config": {"model": str(state.model_path or state.model_name),
                         "served_model_name": state.model_name,
                         "dtype": state.engine.dtype,
                         "max_model_len": state.max_model_len, "seed": config.seed,
                         "logprobs_mode": config.logprobs_mode},
        "parallel_config": {"tensor_parallel_size": tp, "pipeline_parallel_size": 1,
                            "data_parallel_size": 1, "world_size": tp},
        "scheduler_config": {"max_num_seqs": int(config.scheduler.max_num_seqs)},
        "cache_config": {"block_size": int(config.cache.block_size)},
        "weight_transfer_config": (None if backend is None else {"backend": backend}),
    }
