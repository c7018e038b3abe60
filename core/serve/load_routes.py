"""``GET /v1/loads``: SGLang's load report, which slime polls after
``/abort_request {"abort_all": true}`` until no request is left
(``slime/backends/sglang_utils/server_control.py``) and routers read to balance.

One entry in ``loads`` (kvrunner has one data-parallel rank per server), with
SGLang's core keys: ``num_running_reqs`` (requests stepping or parked by a pause),
``num_waiting_reqs``, KV tokens used and in total, ``token_usage``. ``include``
takes SGLang's section names; kvrunner has only the core section, so every valid
name answers it and an unknown one is a 400. ``format=prometheus`` is refused
(``/metrics`` is kvrunner's Prometheus surface). Open to every client holding the
API key, as SGLang's.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request

from kvrunner import __version__
from kvrunner.serve.errors import APIError
from kvrunner.serve.state import ServerState

router = APIRouter()

#: SGLang's sections of a load report
SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})


@router.get("/v1/loads")
async def loads(request: Request, include: str | None = None, dp_rank: int | None = None,
                format: str | None = None) -> dict[str, Any]:  # noqa: A002 (SGLang's name)
    """The engine's load now, in SGLang's shape."""
    state: ServerState = request.app.state.server
    asked = {s.strip() for s in include.split(",")} if include else set()
    if asked - SECTIONS:
        raise APIError(400, f"include: unknown sections {sorted(asked - SECTIONS)}; "
                       f"SGLang's are {sorted(SECTIONS)}", param="include")
    if format not in (None, "json"):
        raise APIError(400, f"format {format!r}: only json (Prometheus: GET /metrics)",
                       param="format")
    if dp_rank not in (None, 0):
        raise APIError(400, f"dp_rank {dp_rank}: this server has the one rank 0",
                       param="dp_rank")
    stats = state.engine.stats()
    config = state.engine.config
    block_size = int(config.cache.block_size)
    used, total = stats.blocks_used * block_size, stats.blocks_total * block_size
    tp = int(config.parallel.tensor_parallel_size)
    return {
        "timestamp": datetime.now(UTC).isoformat(),
        "version": __version__,
        "accelerator": None,
        "num_accelerators": tp,
        "loads": [{
            "dp_rank": 0,
            "num_running_reqs": int(stats.num_running),
            "num_waiting_reqs": int(stats.num_waiting),
            "num_used_tokens": used,
            "num_total_tokens": used,
            "max_total_num_tokens": total,
            "max_running_requests": int(config.scheduler.max_num_seqs),
            "token_usage": used / total if total else 0.0,
        }],
    }
