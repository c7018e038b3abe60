"""Deterministic mode on one rank: what ``EngineConfig.deterministic`` switches.

The layers read the choice per op (``layers/fused/dispatch.py``,
:func:`~kvrunner.layers.fused.dispatch.batch_invariant`): projections, experts and
the LM head take the batch-invariant products (``layers/batch_invariant.py``), the
experts one tiling, and each backend built with ``context.deterministic`` its own
invariant path (paged: ``ops/paged_attention/fixed_order_torch.py`` and
``fixed_order.py``). Under
tensor parallelism the all-reduce is an all-gather and a local sum in rank order
(``distributed/group.py``). Norms, rotary, the sampler's logprobs and draws are per
row already, and unseeded draws are keyed per request (``layers/sampling_seeds.py``).

On the CPU torch also runs one intra-op thread: with more, it splits a large
elementwise op at element offsets that depend on the batch's size, and its
vectorized and scalar SiLU and sigmoid round differently (measured: 157 of 4,096
SiLU values differ by an ulp), so a row's bits would follow the split.
"""

from __future__ import annotations

import torch

from kvrunner.layers.fused.dispatch import choose_batch_invariance


def choose_determinism(enabled: bool, device: torch.device) -> None:
    """Make this process's layers batch-invariant (or not); on the CPU, when enabled,
    pin torch to one intra-op thread (see the module doc)."""
    choose_batch_invariance(enabled)
    if enabled and device.type == "cpu" and torch.get_num_threads() != 1:
        torch.set_num_threads(1)
