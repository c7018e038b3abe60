"""``kvrunner-tbo``: two-batch overlap, an overlap plugin on top of kvrunner's layer backends."""

from kvrunner_tbo.plugin import TwoBatchOverlap

__all__ = ["TwoBatchOverlap"]
