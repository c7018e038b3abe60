"""How a seeded request's draws are keyed: by its seed and the tokens it generated.

Two keyings, one per noise path of the sampler: :func:`step_seed` re-seeds torch's
generator per row (without Triton); :func:`int64_seed` is the seed the Triton kernel
keys on the device together with the count (``layers/fused/seeded_uniform_triton.py``).
"""

from __future__ import annotations

import hashlib


def _hash63(text: str) -> int:
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def step_seed(seed: int, num_generated: int) -> int:
    """The generator seed for a seeded request's draw after ``num_generated`` tokens.

    Hashed rather than summed so ``(seed, n)`` and ``(seed + 1, n - 1)`` do not collide.
    """
    return _hash63(f"{seed}:{num_generated}")


def int64_seed(seed: int) -> int:
    """``seed`` itself where it fits an int64, else a 63-bit hash of it."""
    return seed if -(2**63) <= seed < 2**63 else _hash63(str(seed))
