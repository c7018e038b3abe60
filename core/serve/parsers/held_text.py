"""Where a stream parser must stop sending text: the start of a tag not yet whole.

A tag (``<tool_call>``, ``</think>``) may arrive split across text deltas; the tail of
what has arrived that could still grow into one is held back until the next delta
says whether it does.
"""

from __future__ import annotations

from collections.abc import Iterable


def hold_point(text: str, tags: Iterable[str]) -> int:
    """The smallest index from which ``text``'s tail is a proper prefix of one of
    ``tags`` (``len(text)`` when none is): ``text[:hold_point]`` is safe to send."""
    tags = tuple(tags)
    start = max(0, len(text) - max(len(t) for t in tags) + 1)
    for i in range(start, len(text)):
        tail = text[i:]
        if any(len(tail) < len(t) and t.startswith(tail) for t in tags):
            return i
    return len(text)


def first_of(text: str, tags: Iterable[str], start: int = 0) -> tuple[int, str]:
    """The earliest whole tag in ``text[start:]``: (its index, the tag), or (-1, "")."""
    best, found = -1, ""
    for tag in tags:
        i = text.find(tag, start)
        if i >= 0 and (best < 0 or i < best):
            best, found = i, tag
    return best, found
