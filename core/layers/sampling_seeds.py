"""How a request's draws are keyed: by its seed and the tokens it generated.

Two keyings, one per noise path of the sampler: :func:`step_seed` re-seeds torch's
generator per row (without Triton); the Triton kernel keys on the device by the row's
int64 key together with the count (``layers/fused/seeded_uniform_triton.py``). A
seeded request's key is its seed's (``sampling_params.int64_seed``, kept in the
``SamplingColumns``' ``seed`` column); a request without a seed is keyed by the
engine (:func:`request_keys`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from kvrunner.engine.step_io import SamplingColumns


def step_seed(seed: int, num_generated: int) -> int:
    """The generator seed for a keyed row's draw after ``num_generated`` tokens.

    Hashed rather than summed so ``(seed, n)`` and ``(seed + 1, n - 1)`` do not collide.
    """
    digest = hashlib.blake2b(f"{seed}:{num_generated}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


_MASK64 = (1 << 64) - 1


def request_keys(engine_seed: int, seq_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """The int64 keys the engine draws unseeded requests' noise with, one per id.

    A request without a seed is keyed like a seeded one, by a splitmix64 mix of the
    engine's seed and its request id: its draws depend only on (engine seed, request
    id, tokens generated), never on which other requests share its batch, their
    order or a preemption. For one engine seed the mix is a bijection of the id, so
    two requests (the n samples of one prompt) never share their noise. Vectorised:
    a decode step keys every row.
    """
    # The offset keeps the keys away from small user seeds (splitmix64 maps 0 to 0).
    offset = (engine_seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & _MASK64
    # Ids as int64 bits (the runner's profiling step numbers its rows -1, -2, ...).
    z = np.asarray(seq_ids, dtype=np.int64).view(np.uint64) + np.uint64(offset)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return z.view(np.int64)


def row_keys(
    sampling: SamplingColumns, seq_ids: Sequence[int], engine_seed: int
) -> np.ndarray:
    """Each row's int64 draw key ([N] int64): its own seed's (the ``seed`` column), or
    for an unseeded drawing row the engine's (:func:`request_keys`); a greedy row
    draws nothing and gets 0."""
    keys = sampling.seed.copy()  # 0 where a row has no seed
    unseeded = np.flatnonzero(~sampling.has_seed & sampling.drawing)
    if len(unseeded):
        keys[unseeded] = request_keys(engine_seed, np.asarray(seq_ids, np.int64)[unseeded])
    return keys
