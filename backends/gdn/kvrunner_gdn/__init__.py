"""kvrunner-gdn: the Gated-DeltaNet (Qwen3-Next linear attention) recurrent-state backend."""

__version__ = "0.1.0"
