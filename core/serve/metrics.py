"""``GET /metrics``: the engine's state in Prometheus' text format.

A collector reads :meth:`AsyncLLM.stats` when Prometheus scrapes, so nothing runs
between scrapes and the figures are the engine's own (no second count kept here to
drift from it). Tokens per second is ``rate(kvrunner_generation_tokens_total[1m])``.
Each app has its own registry: two servers in one process do not share figures.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

router = APIRouter()

#: the sleep states a stats record reports, as the gauge's value
SLEEP_STATES = {"awake": 0, "level1": 1, "level2": 2}


class EngineCollector(Collector):
    """The gauges and counters of one engine, read at scrape time."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Any]:
        s = self.engine.stats()
        gauges = {
            "kvrunner_num_requests_running": ("requests being generated", s.num_running),
            "kvrunner_num_requests_waiting": ("requests queued or parked", s.num_waiting),
            "kvrunner_kv_blocks_used": ("KV blocks in use", s.blocks_used),
            "kvrunner_kv_blocks_total": ("KV blocks in the pool", s.blocks_total),
            "kvrunner_step_seconds": ("wall time of the last engine step", s.last_step_s),
            "kvrunner_paused": ("1 while generation is paused", int(bool(s.paused))),
            "kvrunner_sleep_level": ("0 awake, 1 or 2: the sleep level",
                                     _sleep_level(s.sleep_state)),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=float(value or 0))
        counters = {
            "kvrunner_generation_tokens": ("tokens generated", s.generated_tokens_total),
            "kvrunner_prompt_tokens": ("prompt tokens admitted", s.prompt_tokens_total),
            "kvrunner_nonfinite_rows": ("sampled rows whose logits were not finite",
                                        s.nonfinite_rows),
            "kvrunner_requests_aborted": ("requests ended by an abort", s.num_aborted),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=float(value or 0))
        yield InfoMetricFamily("kvrunner_weight", "the weight version being served",
                               value={"version": str(s.weight_version)})


def _sleep_level(state: Any) -> int:
    if isinstance(state, int):
        return state
    return SLEEP_STATES.get(str(state), 0 if state in (None, "", "awake") else -1)


def make_registry(engine: Any) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine))
    return registry


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """The Prometheus exposition of the engine's figures."""
    registry = request.app.state.server.metrics
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
