"""FP8 block quantization: bytes and scales as a plain per-block loop computes them.

The reference walks every 128 x 128 block in Python: its amax, ``scale = amax / 448``
(1 for a block of zeros or one whose scale underflows), each element divided,
clamped to +-448 and rounded to e4m3 by torch's cast. The fused version must give the
same bytes and the same scales on every shape (partial blocks included) and value
(subnormals, the e4m3 maximum, zeros), and dequantizing must give ``q * scale``.
"""

from __future__ import annotations

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrunner.layers.fp8.blocks import (
    BLOCK,
    FP8_MAX,
    dequantize_blocks,
    fp8_nan_count,
    quantize_blocks,
    scale_shape,
)


def reference_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, n = w.shape
    w = w.float()
    q = torch.empty(m, n, dtype=torch.float8_e4m3fn)
    scales = torch.empty(-(-m // BLOCK), -(-n // BLOCK), dtype=torch.float32)
    for bi in range(scales.shape[0]):
        for bj in range(scales.shape[1]):
            block = w[bi * BLOCK:(bi + 1) * BLOCK, bj * BLOCK:(bj + 1) * BLOCK]
            scale = block.abs().max() / FP8_MAX
            if not scale > 0:
                scale = torch.tensor(1.0)
            scales[bi, bj] = scale
            q[bi * BLOCK:(bi + 1) * BLOCK, bj * BLOCK:(bj + 1) * BLOCK] = (
                (block / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn))
    return q, scales


def reference_dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    out = q.float()
    for bi in range(scales.shape[0]):
        for bj in range(scales.shape[1]):
            out[bi * BLOCK:(bi + 1) * BLOCK, bj * BLOCK:(bj + 1) * BLOCK] *= scales[bi, bj]
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# values from everywhere float32 reaches: subnormals, tiny, huge, exact zeros
FLOATS = st.one_of(
    st.floats(-1e4, 1e4, width=32, allow_nan=False),
    st.floats(-2.0**-126, 2.0**-126, width=32, allow_subnormal=True),
    st.sampled_from([0.0, -0.0, FP8_MAX, -FP8_MAX, 1e-45, 3e38, -3e38]),
)


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 300), st.integers(1, 300)),
                  elements=FLOATS))
def test_quantize_matches_the_per_block_loop(values: np.ndarray) -> None:
    w = torch.from_numpy(values)
    q, s = quantize_blocks(w)
    rq, rs = reference_quantize(w)
    assert s.shape == scale_shape(w.shape) and s.dtype == torch.float32
    assert torch.equal(s, rs)
    assert same_bytes(q, rq)
    assert fp8_nan_count(q) == 0
    assert torch.equal(dequantize_blocks(q, s), reference_dequantize(rq, rs))


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 260), st.integers(1, 260), st.integers(0, 2**31 - 1),
       st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
def test_round_trip_error_is_within_e4m3_rounding(m: int, n: int, seed: int,
                                                  dtype: torch.dtype) -> None:
    """Each element comes back within half an e4m3 step of its block: 2^-4 of the
    element itself when it is normal in e4m3, else 2^-10 of the block's amax."""
    w = (torch.randn(m, n, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)
    q, s = quantize_blocks(w)
    back = dequantize_blocks(q, s)
    block_amax = reference_dequantize(torch.ones(m, n, dtype=torch.float8_e4m3fn),
                                      s) * FP8_MAX
    bound = torch.maximum(w.float().abs() * 2**-4, block_amax * 2**-9 * 2**-1)
    assert ((back - w.float()).abs() <= bound).all()


def test_block_amax_is_stored_as_the_e4m3_maximum_and_comes_back_exactly() -> None:
    w = torch.zeros(130, 129)
    w[5, 7], w[129, 128] = -3.0, 7.5
    q, s = quantize_blocks(w)
    assert q.float()[5, 7] == -FP8_MAX and q.float()[129, 128] == FP8_MAX
    assert torch.equal(s, torch.tensor([[3.0 / FP8_MAX, 1.0], [1.0, 7.5 / FP8_MAX]]))
    back = dequantize_blocks(q, s)
    assert back[5, 7] == -3.0 and back[129, 128] == 7.5 and back.count_nonzero() == 2


def test_stacked_weights_quantize_each_matrix_alone() -> None:
    w = torch.randn(3, 200, 140)
    q, s = quantize_blocks(w)
    for e in range(3):
        rq, rs = reference_quantize(w[e])
        assert same_bytes(q[e], rq) and torch.equal(s[e], rs)


def test_scales_that_do_not_fit_the_weight_are_refused() -> None:
    q, s = quantize_blocks(torch.randn(256, 256))
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_blocks(q, s[:1])


def test_nan_bytes_are_counted() -> None:
    q = torch.zeros(4, dtype=torch.float8_e4m3fn)
    q.view(torch.uint8)[1] = 0x7F
    q.view(torch.uint8)[3] = 0xFF
    assert fp8_nan_count(q) == 2
