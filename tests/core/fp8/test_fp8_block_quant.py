"""A weight quantized in place by blocks on the GPU path (``quantize_blocks_into``,
one Triton launch): the torch reference's scales bit for bit, written into views of
a larger parameter and nowhere else.

Under Triton's interpreter the scales are compared bitwise (IEEE divisions of an exact
maximum); the bytes bitwise on the GPU only (``test_fp8_gpu.py``): the interpreter's
cast to e4m3 rounds ties away from zero and makes no subnormals.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrunner.layers.fp8.blocks import (
    BLOCK,
    FP8_DTYPE,
    fp8_nan_count,
    quantize_blocks,
    scale_shape,
)

pytest.importorskip("triton")


@settings(max_examples=10, deadline=None)
@given(m=st.integers(1, 300), n=st.integers(1, 300), seed=st.integers(0, 2**16),
       spread=st.sampled_from([1e-3, 1.0, 300.0]), column_shard=st.booleans(),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]))
def test_the_kernel_writes_the_references_scales_into_its_rows_only(
        m, n, seed, spread, column_shard, dtype) -> None:
    from kvrunner.layers.fp8.block_quant_triton import quantize_blocks_triton

    g = torch.Generator().manual_seed(seed)
    full = (torch.randn(m, 2 * n if column_shard else n, generator=g) * spread).to(dtype)
    w = full[:, n:] if column_shard else full  # a tensor-parallel column shard: strided
    w[: min(m, BLOCK), : min(n, BLOCK)] = 0  # a block of zeros: scale 1
    # the parameter holds another part above this one (rows of a fused qkv)
    above = BLOCK
    q_param = torch.full((above + m, n), 0x7F, dtype=torch.uint8).view(FP8_DTYPE)  # NaN
    mb, nb = scale_shape((m, n))
    s_param = torch.full((above // BLOCK + mb, nb), -1.0)
    quantize_blocks_triton(w, q_param[above:], s_param[above // BLOCK:])
    q_ref, s_ref = quantize_blocks(w)
    assert torch.equal(s_param[above // BLOCK:], s_ref)
    assert fp8_nan_count(q_param[:above]) == above * n and (s_param[: above // BLOCK] == -1).all()
    # every element of its own rows written, none NaN (the zero block's bytes are zeros)
    assert fp8_nan_count(q_param[above:]) == 0
    assert (q_param[above:above + min(m, BLOCK), : min(n, BLOCK)].float() == 0).all()
