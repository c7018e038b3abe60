"""The activations' 1 x 128 quantization (the FP8 w8a8 product's input): the Triton
kernel against the torch reference, ``quantize_token_groups``.

Under Triton's interpreter the scales are the reference's bit for bit (IEEE divisions
of an exact maximum), laid out as ``scaled_mm`` reads them. The bytes are compared on
the GPU only (``test_fp8_gpu.py``), bit for bit: the interpreter's cast to e4m3 is not
the hardware's (it rounds ties away from zero, makes no subnormals, and a value that
rounds up into the next binade, 124 for one, comes out at the binade's start, 64).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrunner.layers.fp8.gemm import quantize_token_groups

pytest.importorskip("triton")


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 5), groups=st.integers(1, 3), seed=st.integers(0, 2**16),
       spread=st.sampled_from([1e-3, 1.0, 300.0]), zero_group=st.booleans())
def test_the_kernel_gives_the_references_scales_column_major(
        rows, groups, seed, spread, zero_group) -> None:
    from kvrunner.layers.fp8.token_groups_triton import quantize_token_groups_triton

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, groups * 128, generator=g) * spread).to(torch.bfloat16)
    if zero_group:
        x[0, :128] = 0  # its scale is 1, not 0
    q, s = quantize_token_groups_triton(x)
    q_ref, s_ref = quantize_token_groups(x)
    assert s.shape == s_ref.shape == (rows, groups)
    assert s.t().is_contiguous()  # column-major, as scaled_mm's 1 x 128 recipe reads
    assert torch.equal(s, s_ref)
    assert q.shape == x.shape and q.dtype == q_ref.dtype == torch.float8_e4m3fn


def test_padding_rows_quantize_as_zeros_with_scale_one() -> None:
    """The w8a8 product pads M to a multiple its kernel takes: the rows past M are zero
    bytes with scale 1 (they add nothing), the first M the reference's."""
    from kvrunner.layers.fp8.token_groups_triton import quantize_token_groups_triton

    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    q, s = quantize_token_groups_triton(x, rows_multiple=16)
    assert q.shape == (16, 256) and s.shape == (16, 2) and s.t().is_contiguous()
    assert torch.equal(s[:5], quantize_token_groups(x)[1])
    assert (q[5:].view(torch.uint8) == 0).all() and (s[5:] == 1).all()
