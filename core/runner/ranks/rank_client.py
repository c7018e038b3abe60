"""The driver's calls to every rank, one typed method per call.

The executors carry a call to every rank (in process, down the spawned ranks' pipes,
or over torchrun's broadcast) as :class:`~kvrunner.runner.ranks.rank_calls.RankCalls`
method plus arguments; this client is the one place the driver names them, and
each method returns every rank's typed answer in rank order. A rank's refusal
(a wake that does not fit, a bad tensor) is raised here as that error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from kvrunner.models.weight_specs import TensorSpec
from kvrunner.runner.ranks.rank_calls import RankCalls
from kvrunner.runner.ranks.rank_reports import PushReport, RankCacheInfo, SleepReport, WakeReport

#: an executor's ``call_ranks``: a RankCalls method and its arguments, run on every rank
CallRanks = Callable[..., list[Any]]


class RankClient:
    """Every rank's :class:`~kvrunner.runner.ranks.rank_calls.RankCalls`, from the driver."""

    def __init__(self, call_ranks: CallRanks) -> None:
        self._call = call_ranks

    def capture(self) -> list[float]:
        return self._call(RankCalls.capture)

    def describe(self) -> list[dict[str, Any]]:
        return self._call(RankCalls.describe)

    def sleep(self, level: int, discard_weights: bool) -> list[SleepReport]:
        return self._call(RankCalls.sleep, level, discard_weights)

    def wake_up(self, tags: tuple[str, ...]) -> list[WakeReport]:
        return self._call(RankCalls.wake_up, tags)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[int]:
        return self._call(RankCalls.update_weights, weights)

    def check_weights(self, specs: list[TensorSpec]) -> None:
        self._call(RankCalls.check_weights, specs)

    def load_weights(self, path: str, check_finite: bool) -> list[int]:
        return self._call(RankCalls.load_weights, path, check_finite)

    def begin_weight_update(self) -> None:
        self._call(RankCalls.begin_weight_update)

    def fail_weight_update(self) -> list[PushReport]:
        return self._call(RankCalls.fail_weight_update)

    def finish_weight_update(self) -> list[PushReport]:
        return self._call(RankCalls.finish_weight_update)

    def cache_info(self) -> list[RankCacheInfo]:
        return self._call(RankCalls.cache_info)

    def init_weights_update_group(self, *args: Any) -> None:
        self._call(RankCalls.init_weights_update_group, *args)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                        shapes: list[list[int]],
                                        packed_bytes: int | None = None) -> list[int]:
        return self._call(RankCalls.update_weights_from_distributed, names, dtypes, shapes,
                          packed_bytes)

    def stage_tensor_payload(self, serialized: list[str | bytes], load_format: str | None,
                             check_finite: bool) -> list[list[TensorSpec]]:
        return self._call(RankCalls.stage_tensor_payload, serialized, load_format,
                          check_finite)

    def stage_ipc_handles(self, update: Any, check_finite: bool) -> None:
        self._call(RankCalls.stage_ipc_handles, update, check_finite)

    def load_staged_payload(self) -> list[int]:
        return self._call(RankCalls.load_staged_payload)

    def drop_staged_payload(self) -> None:
        self._call(RankCalls.drop_staged_payload)

    def destroy_weights_update_group(self) -> None:
        self._call(RankCalls.destroy_weights_update_group)

    def weight_digests(self) -> list[dict[str, tuple[int, int, int]]]:
        return self._call(RankCalls.weight_digests)
