"""``GET /metrics``: the engine's state in Prometheus' text format.

A collector reads :meth:`AsyncLLM.stats` when Prometheus scrapes, so nothing runs
between scrapes and the figures are the engine's own (no second count kept here to
drift from it). Tokens per second over any window is
``rate(kvrunner_generation_tokens_total[1m])``; the gauge
``kvrunner_generation_tokens_per_second`` is the same figure between this scrape and
the one before it, for a reader without Prometheus. Each app has its own registry: two
servers in one process do not share figures.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

router = APIRouter()



class EngineCollector(Collector):
    """The gauges and counters of one engine, read at scrape time."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        #: (monotonic seconds, tokens generated) at the previous scrape
        self._last: tuple[float, int] | None = None

    def _tokens_per_second(self, total: int) -> float:
        now = time.monotonic()
        last, self._last = self._last, (now, total)
        if last is None or now <= last[0]:
            return 0.0
        return max(total - last[1], 0) / (now - last[0])

    def collect(self) -> Iterator[Any]:
        s = self.engine.stats()
        gauges = {
            "kvrunner_num_requests_running": ("requests being generated", s.num_running),
            "kvrunner_num_requests_waiting": ("requests queued or parked", s.num_waiting),
            "kvrunner_kv_blocks_used": ("KV blocks in use", s.blocks_used),
            "kvrunner_kv_blocks_total": ("KV blocks in the pool", s.blocks_total),
            "kvrunner_step_seconds": ("wall time of the last engine step", s.last_step_s),
            "kvrunner_paused": ("1 while generation is paused", int(bool(s.paused))),
            "kvrunner_sleep_level": ("0 awake, 1 the KV pool released, 2 the weights too",
                                     sleep_level(s.sleep_state)),
            "kvrunner_generation_tokens_per_second": (
                "tokens generated per second since the previous scrape",
                self._tokens_per_second(s.generated_tokens_total)),
            "kvrunner_state_slots_used": ("recurrent-state slots in use", s.state_slots_used),
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


def sleep_level(state: str) -> int:
    """The sleep level a stats record's ``sleep_state`` amounts to: 0 awake, 2 while the
    weights are released (whatever else is), 1 while only the KV pool is."""
    if state in ("", "awake"):
        return 0
    released = state.removeprefix("asleep:").replace(" ", "").split(",")
    return 2 if "weights" in released else 1


def make_registry(engine: Any) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine))
    return registry


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """The Prometheus exposition of the engine's figures."""
    registry = request.app.state.server.metrics
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
