"""Weights from the trainer's processes into a running engine.

- :class:`BucketSender` (trainer side, any torch process): CUDA-IPC buckets on the
  same GPU (shared memory on the CPU), double-buffered, each acknowledged only once
  the engine's copy of it has completed on the device. The engine side is
  ``LLM.update_weights_from_ipc``, ``AsyncLLM.update_weights_from_ipc`` and
  ``POST /update_weights_from_tensor``.
- :class:`DirectSender`: the same engine side, one copy: the engine reads the
  trainer tensors' own storages (mapped once, kept across pushes) instead of buckets.
- vLLM's IPC handles (:mod:`kvrunner.weight_sync.ipc_handles`): what torch's
  ``reduce_tensor`` gives a trainer's tensors, keyed by GPU UUID, sent as vLLM's
  senders send them; the engine side is ``LLM.update_weights_from_ipc_handles`` and
  ``POST /update_weights`` with ``--weight-transfer-config '{"backend": "ipc"}'``.

The protocol and its guarantees: docs/weight_sync.md.
"""

from kvrunner.weight_sync.direct_sender import DirectSender
from kvrunner.weight_sync.errors import WeightSyncError
from kvrunner.weight_sync.sender import DEFAULT_BUCKET_BYTES, BucketSender, gathered

__all__ = ["DEFAULT_BUCKET_BYTES", "BucketSender", "DirectSender", "WeightSyncError", "gathered"]
