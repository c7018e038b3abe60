"""The errors of a weight push from another process."""

from __future__ import annotations

from kvrunner.errors import WeightUpdateError


class WeightSyncError(WeightUpdateError):
    """A push from another process failed: the trainer went away, a bucket was
    malformed, a message came late, or the engine refused a tensor. The message says
    which bucket and which field.

    On the engine this is a :class:`~kvrunner.errors.WeightUpdateError`: if the
    push had loaded anything, the weights are ``"partial"`` and generation is refused
    until a full push. On the trainer, :meth:`BucketSender.push` raises it with the
    engine's reason.
    """
