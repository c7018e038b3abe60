"""kvrunner: an LLM inference runtime for RL rollouts with pluggable cache backends.

This module is the user's API. A backend plugin imports from
:mod:`kvrunner.plugin_api` instead.
"""

from kvrunner.async_engine.errors import EngineBusyError, EngineClosedError, EngineDeadError
from kvrunner.config import ConfigError
from kvrunner.errors import (
    CheckpointError,
    ConcurrentUseError,
    KvrunnerError,
    NonFiniteLogitsError,
    RequestError,
    SleepStateError,
    WakeError,
    WeightUpdateError,
)
from kvrunner.outputs import RequestOutput
from kvrunner.plugin_api.errors import BackendError
from kvrunner.rl.sleep_state import CacheInfo
from kvrunner.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "AsyncLLM",
    "EngineStats",
    "StreamDelta",
    "BackendError",
    "CacheInfo",
    "CheckpointError",
    "ConcurrentUseError",
    "ConfigError",
    "EngineBusyError",
    "EngineClosedError",
    "EngineDeadError",
    "KvrunnerError",
    "NonFiniteLogitsError",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "SleepStateError",
    "WakeError",
    "WeightUpdateError",
    "WorkerError",
    "__version__",
]


def __getattr__(name: str):
    # LLM pulls in torch models and the runner; import them only when asked for.
    if name == "LLM":
        from kvrunner.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from kvrunner.async_llm import AsyncLLM

        return AsyncLLM
    if name == "StreamDelta":
        from kvrunner.async_engine.delta import StreamDelta

        return StreamDelta
    if name == "EngineStats":
        from kvrunner.async_engine.stats import EngineStats

        return EngineStats
    if name == "WorkerError":
        from kvrunner.distributed.errors import WorkerError

        return WorkerError
    raise AttributeError(f"module 'kvrunner' has no attribute {name!r}")
