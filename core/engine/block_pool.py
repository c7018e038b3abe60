"""The physical KV blocks: who holds each one, and which hold reusable prefixes.

A block is *free* when its reference count is 0. A free block that carries a prefix
hash keeps its contents and can be revived by a later request with the same prefix
(:meth:`BlockPool.ref`); it is only overwritten when a fresh block is needed and no
plain free block is left, oldest-freed first (LRU).

Prefix hashes chain: a block's hash covers its parent's hash and its own tokens, so
equal hashes mean equal *whole prefixes*, not just equal blocks. A request's salt
(``engine/cache_salt.py``: its ``cache_salt``, and the weight version when the engine
salts by it) enters the first block's hash only, and so, through the chain, every
block after it: requests with different salts never share a block, equal salts do.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Sequence


class NoFreeBlocksError(RuntimeError):
    """The pool has neither a plain free block nor an evictable cached one."""


def hash_block_tokens(
    parent_hash: int | None, token_ids: Sequence[int], salt: bytes | None = None
) -> int:
    """Prefix hash of one full block: a 128-bit BLAKE2b digest of (parent, tokens), the
    first block's (no parent) also of its request's ``salt`` (None: unsalted).

    Why not Python's ``hash`` of a tuple: it is a 64-bit non-cryptographic hash whose
    collisions are easy to construct, and a collision here is not a slow path but a
    wrong answer - one request would silently attend to another request's KV. BLAKE2b
    costs about a microsecond per block and is identical across processes, Python
    versions and ``PYTHONHASHSEED``, so every rank and every run agrees on it.
    """
    h = hashlib.blake2b(digest_size=16)
    # A flag byte keeps "no parent", "no parent, salted" and any parent digest apart;
    # the salt's length before it keeps where the salt ends and the tokens begin.
    if parent_hash is not None:
        if salt is not None:
            raise ValueError("a salt enters the first block's hash only (it has no parent)")
        h.update(b"\x01" + parent_hash.to_bytes(16, "little"))
    elif salt is None:
        h.update(b"\x00" + bytes(16))
    else:
        h.update(b"\x02" + len(salt).to_bytes(8, "little") + salt)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest(), "little")


class BlockPool:
    """Fixed set of ``num_blocks`` KV blocks with reference counts and a prefix cache."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"BlockPool needs num_blocks >= 1 and block_size >= 1, "
                f"got {num_blocks} and {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._block_of: dict[int, int] = {}
        # Two free lists so that cached contents are overwritten only as a last resort.
        self._free_plain: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # oldest-freed first

    # -- queries ----------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks :meth:`allocate` can still hand out (plain free + evictable cached)."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_cached(self) -> int:
        """Blocks carrying a prefix hash, in use or not."""
        return len(self._block_of)

    def ref_count(self, block_id: int) -> int:
        return self._refs[self._check(block_id)]

    def block_hash(self, block_id: int) -> int | None:
        return self._hash_of[self._check(block_id)]

    def lookup(self, block_hash: int) -> int | None:
        """The block holding the prefix with this hash, in use or free, if any."""
        return self._block_of.get(block_hash)

    # -- transitions ------------------------------------------------------------------

    def allocate(self) -> int:
        """Hand out a fresh block (ref count 1), evicting the LRU cached one if need be."""
        if self._free_plain:
            block_id = self._free_plain.popleft()
        elif self._free_cached:
            block_id, _ = self._free_cached.popitem(last=False)
            self._uncache(block_id)
        else:
            raise NoFreeBlocksError(f"all {self.num_blocks} KV blocks are in use")
        self._refs[block_id] = 1
        return block_id

    def ref(self, block_id: int) -> None:
        """Add a holder to a block in use, or revive a free cached block (prefix hit)."""
        self._check(block_id)
        if self._refs[block_id] == 0:
            if block_id not in self._free_cached:
                # A plain free block's contents are garbage: sharing it is a bug.
                raise ValueError(f"block {block_id} is free and holds no cached prefix")
            del self._free_cached[block_id]
        self._refs[block_id] += 1

    def free(self, block_id: int) -> None:
        """Drop one holder; at zero the block is free (kept for reuse if cached)."""
        self._check(block_id)
        if self._refs[block_id] == 0:
            raise ValueError(f"block {block_id} freed more times than it was held")
        self._refs[block_id] -= 1
        if self._refs[block_id] == 0:
            if self._hash_of[block_id] is None:
                self._free_plain.append(block_id)
            else:
                self._free_cached[block_id] = None  # most recently freed: evicted last

    def cache_full_block(self, block_id: int, block_hash: int) -> bool:
        """Publish a full, computed block under its prefix hash.

        Returns False (and leaves the block private) when another block already holds
        that prefix - two requests computed the same prefix in the same step; the
        first one stays canonical.
        """
        self._check(block_id)
        if self._refs[block_id] == 0:
            raise ValueError(f"block {block_id} is free; only a held block can be cached")
        current = self._hash_of[block_id]
        if current is not None:
            if current != block_hash:
                raise ValueError(f"block {block_id} is already cached under another prefix")
            return True
        if block_hash in self._block_of:
            return False
        self._hash_of[block_id] = block_hash
        self._block_of[block_hash] = block_id
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (e.g. after a weight update made the KV stale).

        Blocks in use keep their holders and contents but can no longer be matched.
        Returns how many prefixes were dropped.
        """
        dropped = len(self._block_of)
        for block_id in self._block_of.values():
            self._hash_of[block_id] = None
        self._block_of.clear()
        self._free_plain.extend(self._free_cached)
        self._free_cached.clear()
        return dropped

    # -- internals --------------------------------------------------------------------

    def _uncache(self, block_id: int) -> None:
        block_hash = self._hash_of[block_id]
        if block_hash is not None:
            del self._block_of[block_hash]
            self._hash_of[block_id] = None

    def _check(self, block_id: int) -> int:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} out of range [0, {self.num_blocks})")
        return block_id
