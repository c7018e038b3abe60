"""kvrunner: an LLM inference runtime for RL rollouts with pluggable cache backends."""

from kvrunner.config import ConfigError
from kvrunner.contract import PAD_SLOT_ID, PLUGIN_API_VERSION
from kvrunner.errors import (
    CheckpointError,
    ConcurrentUseError,
    KvrunnerError,
    NonFiniteLogitsError,
    RequestError,
)
from kvrunner.hookspecs import hookimpl
from kvrunner.outputs import RequestOutput
from kvrunner.sampling_params import SamplingParams
from kvrunner.sleep_state import CacheInfo, SleepStateError, WakeError, WeightUpdateError

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "PAD_SLOT_ID",
    "PLUGIN_API_VERSION",
    "BackendError",
    "CacheInfo",
    "CheckpointError",
    "ConcurrentUseError",
    "ConfigError",
    "KvrunnerError",
    "NonFiniteLogitsError",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "SleepStateError",
    "WakeError",
    "WeightUpdateError",
    "WorkerError",
    "hookimpl",
    "__version__",
]


def __getattr__(name: str):
    # LLM pulls in torch models and the runner; import them only when asked for.
    if name == "LLM":
        from kvrunner.llm import LLM

        return LLM
    if name == "BackendError":
        from kvrunner.plugins import BackendError

        return BackendError
    if name == "WorkerError":
        from kvrunner.distributed.errors import WorkerError

        return WorkerError
    raise AttributeError(f"module 'kvrunner' has no attribute {name!r}")
