"""kvrunner-paged: a paged-KV softmax attention backend for kvrunner (entry point ``paged``)."""

from kvrunner_paged.backend import PagedBackend
from kvrunner_paged.layer import PagedAttention
from kvrunner_paged.metadata import PagedMetadata

__version__ = "0.1.0"
__all__ = ["PagedAttention", "PagedBackend", "PagedMetadata", "__version__"]
