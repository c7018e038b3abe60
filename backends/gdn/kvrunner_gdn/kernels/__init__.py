"""GDN kernels: one file per op, each a Triton kernel, its launcher and a plain-torch path.

``reference`` holds the naive fp32 token-by-token oracles the others are tested against.
"""

from kvrunner_gdn.kernels.chunked_prefill import gdn_prefill
from kvrunner_gdn.kernels.conv_prefill import conv1d_prefill
from kvrunner_gdn.kernels.conv_update import conv1d_update
from kvrunner_gdn.kernels.recurrent_decode import gdn_decode

__all__ = ["conv1d_prefill", "conv1d_update", "gdn_decode", "gdn_prefill"]
