"""This step's keys and values written to their slots of the paged pool, one file per
way of computing it:

- ``naive``: a loop over token rows (the tests' oracle);
- ``store`` / ``store_torch``: every row at once (Triton / plain torch, ``index_put_``);
  ``store`` also holds :func:`~kvrunner_paged.ops.store_kv.store.store_newest_kv`, the
  same write from inside an attention kernel that stores as it attends.

Every entry takes ``k``, ``v``, ``k_cache``, ``v_cache`` and ``slot_mapping``, keyword-only
but for the oracle: row ``t`` goes to slot ``slot_mapping[t]`` (block
``s // block_size``, offset ``s % block_size``), and a row whose slot is < 0
(``PAD_SLOT_ID``) writes nothing. The Triton module is imported only where Triton runs;
nothing here imports it.
"""
