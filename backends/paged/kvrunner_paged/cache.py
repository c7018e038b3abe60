"""The paged KV pools: one tensor per served layer, keys and values side by side."""

from __future__ import annotations

import torch

from kvrunner_paged.kv_format import KVFormat

#: Name prefix of each layer's pool in the dict ``allocate_cache`` returns.
POOL_PREFIX = "kv."


def cache_rows(pool_name: str, pool: torch.Tensor) -> tuple[str, torch.Tensor]:
    """One row per KV slot (``block * block_size + offset``): its keys and values.

    For the conformance kit, which reads a slot without knowing this layout.
    """
    del pool_name  # every pool of this backend has the same layout
    return "kv", pool.permute(1, 2, 0, 3, 4).flatten(0, 1)


class PagedKVPools:
    """Owns ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` per served layer.

    Index 0 holds keys, index 1 values; a slot ``s`` is block ``s // block_size``,
    offset ``s % block_size``. Layers look their pool up on every forward, so a pool
    re-allocated after a wake is picked up without rebuilding the layers. The elements
    are ``fmt.dtype``: the model's, or FP8 scaled per layer (:mod:`.kv_format`).
    """

    def __init__(
        self,
        *,
        layers: tuple[int, ...],
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        fmt: KVFormat,
        device: torch.device,
    ) -> None:
        self.layers = layers
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.fmt = fmt
        self.dtype = fmt.dtype
        self.device = device
        self._pools: dict[int, torch.Tensor] = {}

    @property
    def bytes_per_block(self) -> int:
        """Keys + values of one block, over every served layer (one byte an element in
        FP8; its scales live in a small table outside the pools, no block bytes)."""
        element = torch.empty((), dtype=self.dtype).element_size()
        per_layer = 2 * self.block_size * self.num_kv_heads * self.head_dim * element
        return per_layer * len(self.layers)

    def allocate(self, num_blocks: int) -> dict[str, torch.Tensor]:
        """Allocate every layer's pool (zeroed) and return them by ``kv.<layer>``."""
        if num_blocks < 1:
            raise ValueError(f"paged backend needs at least one KV block, got {num_blocks}")
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        # Zeroed, not empty: a freshly allocated pool never holds NaN bit patterns that
        # a masked-but-multiplied read could leak.
        self._pools = {
            layer: torch.zeros(shape, dtype=self.dtype, device=self.device)
            for layer in self.layers
        }
        return {f"{POOL_PREFIX}{layer}": pool for layer, pool in self._pools.items()}

    def release(self) -> None:
        """Drop every pool (a later :meth:`allocate` makes new ones)."""
        self._pools = {}

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_cache, v_cache)`` views of ``layer``'s pool, each ``[blocks, bs, kvh, dim]``."""
        try:
            pool = self._pools[layer]
        except KeyError:
            state = "released or never allocated" if not self._pools else "not served here"
            raise RuntimeError(f"paged KV pool for layer {layer} is {state}") from None
        return pool[0], pool[1]
