"""kvrunner-gdn: a Gated-DeltaNet (Qwen3-Next linear attention) backend (entry point ``gdn``)."""

from kvrunner_gdn.backend import GDNBackend
from kvrunner_gdn.layer import GDNLayer
from kvrunner_gdn.metadata import GDNMetadata

__version__ = "0.1.0"
__all__ = ["GDNBackend", "GDNLayer", "GDNMetadata", "__version__"]
