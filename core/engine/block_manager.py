"""Maps sequences onto KV blocks and state slots; finds and publishes cached prefixes.

The scheduler decides *who* runs; the block manager decides *where* their KV goes.
Every method either does all of its work or none of it, so the scheduler can probe
(``can_allocate``, ``ensure_slots``) without undoing anything.
"""

from __future__ import annotations

import sys

from kvrunner.engine.block_pool import BlockPool, NoFreeBlocksError, hash_block_tokens
from kvrunner.engine.cache_salt import WeightVersion, salt_bytes
from kvrunner.engine.sequence import Sequence
from kvrunner.engine.state_slots import NoFreeStateSlotError, StateSlotPool
from kvrunner.engine.table_rows import TableRows

#: "every block published already": a sequence so marked publishes no more blocks
_NEVER = sys.maxsize


class BlockManager:
    """KV blocks and recurrent-state slots for running sequences.

    :param num_blocks: physical KV blocks in the pool.
    :param block_size: tokens per block.
    :param enable_prefix_caching: reuse full blocks whose whole prefix matches.
    :param num_state_slots: per-request recurrent-state slots (0: the model has no
        recurrent layers). A running sequence holds one slot when this is > 0.
    :param salt_by_weight_version: salt every sequence's hashes with
        :attr:`weight_version` as of its admission (``engine/cache_salt.py``), so KV
        computed under other weights is never a prefix hit.

    A sequence is keyed at admission (``allocate``, and the ``can_allocate`` /
    ``num_cached_tokens`` probes before it): its salt is its ``cache_salt`` and, when
    salting by version, the weight version then. A running sequence keeps that salt,
    also across a weight change: the blocks it fills afterwards attend to KV of the
    old weights, so they are published under the old version, where no request
    admitted later looks.

    Prefix caching is switched off whenever ``num_state_slots > 0``: a cached KV block
    lets attention skip a prefix, but a recurrent layer's state after that prefix is
    not in any block and cannot be rebuilt from them, so a "hit" would start the
    recurrence from the wrong state. Such models always prefill from token 0, so a
    chunk with ``start_pos == 0`` is exactly the runner's cue to start a fresh state in
    the chunk's slot (slots are reused: by later requests, and by a preempted request
    that resumes in a different slot).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_state_slots: int = 0,
        salt_by_weight_version: bool = False,
    ) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.state_slots = StateSlotPool(num_state_slots)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching and num_state_slots == 0
        # seq_id -> how many leading blocks of its table are already published (or were
        # prefix hits), so mark_computed hashes each block once; _NEVER for a sequence
        # whose blocks must not be published at all (see reset_prefix_cache).
        self._num_published: dict[int, int] = {}
        #: every held table again, one array row each (``Sequence.table_row``): a
        #: step's tables are then one gather, not one tuple per sequence
        self.table_rows = TableRows()
        #: tokens admission took from the prefix cache rather than computing, ever
        self.prefix_hit_tokens = 0
        self.salt_by_weight_version = salt_by_weight_version
        self._weight_version: WeightVersion = 0
        # counts weight-version changes: a sequence keyed in this epoch has its salt
        # (admission probes run every step for every waiting sequence: they skip it)
        self._salt_epoch = 0

    # -- sizes ------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_state_slots(self) -> int:
        return self.state_slots.num_slots

    @property
    def num_free_state_slots(self) -> int:
        return self.state_slots.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens of KV."""
        return -(-num_tokens // self.block_size)

    # -- salts ------------------------------------------------------------------------

    @property
    def weight_version(self) -> WeightVersion:
        """The version of the weights the runner holds (``LLMEngine.weights_changed``)."""
        return self._weight_version

    @weight_version.setter
    def weight_version(self, version: WeightVersion) -> None:
        self._weight_version = version
        self._salt_epoch += 1

    def admission_salt(self, seq: Sequence) -> bytes | None:
        """The salt ``seq`` would be admitted with now (see the class docstring)."""
        version = self.weight_version if self.salt_by_weight_version else None
        return salt_bytes(seq.cache_salt, version)

    # -- admission --------------------------------------------------------------------

    def num_cached_tokens(self, seq: Sequence) -> int:
        """Leading tokens of ``seq`` the prefix cache holds right now.

        Block-aligned and at most ``len(token_ids) - 1``: the last token is always
        computed so the step produces a logit to sample from. When the whole sequence
        is cached this drops the last full block, rather than recomputing one token
        into a block other requests share.
        """
        return len(self._prefix_hits(seq)) * self.block_size

    def can_allocate(self, seq: Sequence, num_new_tokens: int | None = None) -> bool:
        """Whether :meth:`allocate` would succeed now.

        ``num_new_tokens`` is the first chunk the sequence computes after its cached
        prefix (default: all of its remaining tokens).
        """
        if self.num_state_slots > 0 and self.num_free_state_slots == 0:
            return False
        hits = self._prefix_hits(seq)
        return self._admission_cost(seq, hits, num_new_tokens) <= self.pool.num_free

    def allocate(self, seq: Sequence, num_new_tokens: int | None = None) -> None:
        """Give a sequence entering RUNNING its cached prefix, blocks and state slot.

        Sets ``num_computed_tokens`` to the prefix-cache hit length and grows the block
        table to hold that plus ``num_new_tokens`` (default: every remaining token).
        Raises :class:`NoFreeBlocksError` / :class:`NoFreeStateSlotError` without
        changing anything when it does not fit (check with :meth:`can_allocate`).
        """
        if seq.block_table or seq.state_slot != -1:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks or a state slot")
        if self.num_state_slots > 0 and self.num_free_state_slots == 0:
            raise NoFreeStateSlotError(f"no state slot free for sequence {seq.seq_id}")
        hits = self._prefix_hits(seq)
        cost = self._admission_cost(seq, hits, num_new_tokens)
        if cost > self.pool.num_free:
            raise NoFreeBlocksError(
                f"sequence {seq.seq_id} needs {cost} blocks, {self.pool.num_free} free"
            )
        # Revive hits first: they may be free cached blocks that allocate() would evict.
        for block_id in hits:
            self.pool.ref(block_id)
        hit_tokens = len(hits) * self.block_size
        n = seq.num_tokens - hit_tokens if num_new_tokens is None else num_new_tokens
        fresh = self.blocks_needed(hit_tokens + n) - len(hits)
        seq.block_table = hits + [self.pool.allocate() for _ in range(fresh)]
        seq.table_row = self.table_rows.acquire(seq.block_table)
        seq.num_computed_tokens = hit_tokens
        self._num_published[seq.seq_id] = len(hits)
        self.prefix_hit_tokens += hit_tokens
        if seq.num_cached_tokens < 0:
            seq.num_cached_tokens = hit_tokens
        if self.num_state_slots > 0:
            seq.state_slot = self.state_slots.allocate()

    # -- running ----------------------------------------------------------------------

    def ensure_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow the block table to hold ``num_computed_tokens + num_new_tokens``.

        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        missing = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(
            seq.block_table
        )
        if missing <= 0:
            return True
        if missing > self.pool.num_free:
            return False
        new = [self.pool.allocate() for _ in range(missing)]
        seq.block_table.extend(new)
        if seq.table_row == -1:  # a table not from allocate() (tests build them by hand)
            seq.table_row = self.table_rows.acquire(seq.block_table)
        else:
            self.table_rows.extend(seq.table_row, new)
        return True

    def mark_computed(self, seq: Sequence, num_tokens: int) -> None:
        """Record that ``num_tokens`` more tokens of ``seq`` now have KV in cache.

        Blocks that became full are published to the prefix cache, so later requests
        (or this one, after a preemption) can reuse them.
        """
        computed = seq.num_computed_tokens + num_tokens
        if num_tokens < 0 or computed > seq.num_tokens:
            raise ValueError(
                f"sequence {seq.seq_id}: cannot mark {num_tokens} more tokens computed "
                f"({seq.num_computed_tokens} of {seq.num_tokens} already are)"
            )
        if computed > len(seq.block_table) * self.block_size:
            raise ValueError(
                f"sequence {seq.seq_id}: {computed} computed tokens exceed its "
                f"{len(seq.block_table)} blocks"
            )
        seq.num_computed_tokens = computed
        if not self.enable_prefix_caching:
            return
        published = self._num_published.get(seq.seq_id, 0)
        full = computed // self.block_size
        for i in range(published, full):
            self.pool.cache_full_block(seq.block_table[i], self._block_hash(seq, i))
        self._num_published[seq.seq_id] = max(published, full)

    def free(self, seq: Sequence) -> None:
        """Release everything ``seq`` holds; its KV is then no longer its own.

        The block table is emptied and ``num_computed_tokens`` reset to 0. Blocks are
        released tail first, so under LRU eviction a prompt's tail is overwritten
        before its head - heads (system prompts, shared few-shot prefixes) are the
        parts other requests are most likely to share.
        """
        for block_id in reversed(seq.block_table):
            self.pool.free(block_id)
        seq.block_table.clear()
        if seq.table_row != -1:
            self.table_rows.release(seq.table_row)
            seq.table_row = -1
        seq.num_computed_tokens = 0
        if seq.state_slot != -1:
            self.state_slots.free(seq.state_slot)
            seq.state_slot = -1
        self._num_published.pop(seq.seq_id, None)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (after a weight update the cached KV is stale).

        The sequences holding blocks now (parked across a weight update) publish none
        of their blocks from here on: their KV was computed under what the reset
        declares stale, and so, through attention over it, is every block they fill
        later. A sequence admitted afresh (a new request, or a preempted one that
        recomputes) publishes as usual.
        """
        for seq_id in self._num_published:
            self._num_published[seq_id] = _NEVER
        return self.pool.reset_prefix_cache()

    # -- internals --------------------------------------------------------------------

    def _rekey(self, seq: Sequence) -> None:
        """Key a sequence being admitted: hashes of another salt (a weight change since
        it last ran) are dropped, to be recomputed under this one."""
        if seq.salt_epoch == self._salt_epoch:
            return
        seq.salt_epoch = self._salt_epoch
        salt = self.admission_salt(seq)
        if salt != seq.hash_salt:
            seq.hash_salt = salt
            seq.block_hashes.clear()

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        self._rekey(seq)
        # A request scoring its prompt needs every prompt position's logits: a cached
        # block has none, so it computes its whole prompt (and still publishes it).
        if not self.enable_prefix_caching or seq.sampling_params.prompt_logprobs is not None:
            return []
        hits: list[int] = []
        # Hash lazily: a miss on block i makes every later block a miss too.
        for i in range((seq.num_tokens - 1) // self.block_size):
            block_id = self.pool.lookup(self._block_hash(seq, i))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _admission_cost(self, seq: Sequence, hits: list[int], num_new: int | None) -> int:
        """Free blocks that admitting ``seq`` consumes (revived hits + fresh blocks)."""
        hit_tokens = len(hits) * self.block_size
        remaining = seq.num_tokens - hit_tokens
        n = remaining if num_new is None else num_new
        if not 1 <= n <= remaining:
            raise ValueError(
                f"sequence {seq.seq_id}: first chunk must be 1..{remaining} tokens, got {n}"
            )
        revived = sum(1 for b in hits if self.pool.ref_count(b) == 0)
        return revived + self.blocks_needed(hit_tokens + n) - len(hits)

    def _block_hash(self, seq: Sequence, index: int) -> int:
        """Prefix hash of ``seq``'s block ``index`` (which must be full of tokens)."""
        hashes = seq.block_hashes
        bs = self.block_size
        while len(hashes) <= index:
            i = len(hashes)
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            if len(tokens) != bs:
                raise ValueError(f"sequence {seq.seq_id}: block {i} is not full")
            if hashes:
                hashes.append(hash_block_tokens(hashes[-1], tokens))
            else:
                hashes.append(hash_block_tokens(None, tokens, seq.hash_salt))
        return hashes[index]
