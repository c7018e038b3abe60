"""kvrunner: an LLM inference runtime for RL rollouts with pluggable cache backends."""

from kvrunner.contract import PAD_SLOT_ID, PLUGIN_API_VERSION
from kvrunner.hookspecs import hookimpl
from kvrunner.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "PAD_SLOT_ID", "PLUGIN_API_VERSION", "SamplingParams", "hookimpl", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch models and the runner; import it only when asked for.
    if name == "LLM":
        from kvrunner.llm import LLM

        return LLM
    raise AttributeError(f"module 'kvrunner' has no attribute {name!r}")
