"""What a conformance check raises when a backend breaks the contract."""

from __future__ import annotations


class ConformanceError(AssertionError):
    """A backend broke a property of the plugin contract."""
