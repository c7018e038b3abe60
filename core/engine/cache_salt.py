"""A request's prefix-cache salt: what, besides its tokens, decides which cached
blocks it may share.

Two parts, each optional:

- the caller's ``cache_salt`` (vLLM's request field; SGLang's ``extra_key``): a
  namespace of the caller's choosing, such as a tenant or a rollout's policy step;
- the weight version the request's KV is computed under, when the engine salts by
  it (``[cache] salt_prefix_cache_by_weight_version``): it is read when the request
  is admitted (again after a preemption), so KV computed under other weights is
  never a hit, whether or not the prefix cache was reset when they changed.

The salt enters the hash of a request's first block (``hash_block_tokens``), and
through the chain every later one. The parts are encoded as tagged, length-prefixed
fields, so no value of one part can equal another's: a ``cache_salt`` of ``"7"`` is
not weight version 7, and weight version 7 is not weight version ``"7"``.
"""

from __future__ import annotations

from typing import Any

from kvrunner.errors import RequestError

WeightVersion = str | int


def check_cache_salt(value: Any, name: str) -> str | None:
    """``value`` as a request's ``cache_salt``: None (unsalted) or a non-empty string,
    as vLLM takes it.

    :param name: the request, for the error (``request 3``, ``request 'abc'``).
    :raises RequestError: any other value, named.
    """
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise RequestError(
            f"{name}: cache_salt must be a non-empty string (or None for no salt), "
            f"got {value!r} ({type(value).__name__})"
        )
    return value


def _field(tag: bytes, data: bytes) -> bytes:
    return tag + len(data).to_bytes(8, "little") + data


def salt_bytes(cache_salt: str | None, weight_version: WeightVersion | None) -> bytes | None:
    """The bytes a request's first block hashes beside its tokens; None when it has
    neither part (its hashes are then the unsalted ones)."""
    if cache_salt is None and weight_version is None:
        return None
    parts = b""
    if cache_salt is not None:
        parts += _field(b"s", cache_salt.encode("utf-8"))
    if weight_version is not None:
        kind = b"i" if isinstance(weight_version, int) else b"t"
        parts += _field(b"v" + kind, str(weight_version).encode("utf-8"))
    return parts
