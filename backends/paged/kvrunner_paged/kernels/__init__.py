"""Kernels of the paged backend.

Each operation has a Triton launcher (its own module, imported on demand so the
torch path works where Triton is absent), a torch path (:mod:`.torch_ops`) and a
naive oracle (:mod:`.reference`). Every launcher is a plain function over tensors,
usable from tests and benchmarks without a backend or a model.
"""

from kvrunner_paged.kernels.reference import reference_paged_attention, reference_store_kv
from kvrunner_paged.kernels.torch_ops import (
    paged_decode_attention_torch,
    paged_prefill_attention_torch,
    store_kv_torch,
)

__all__ = [
    "paged_decode_attention_torch",
    "paged_prefill_attention_torch",
    "reference_paged_attention",
    "reference_store_kv",
    "store_kv_torch",
]
