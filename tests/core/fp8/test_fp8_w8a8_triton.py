"""The w8a8 block-scaled kernel (Triton; under the interpreter on the CPU): e4m3
activations in 1 x 128 groups times an e4m3 weight in 128 x 128 blocks, equal to the
exact product of the dequantized operands.

The reference is ``dequant(xq, xs) @ dequant(wq, ws).T`` in float64. Each product of two
e4m3 values is exact in float32; the kernel sums a 128-deep block's products in float32,
scales the block's sum and adds it to a float32 accumulator (or to a slice's, the slices
added in order), then rounds once to the output dtype. So each output lies within
``(|x| @ |w|.T) * (K * 2^-23 + ulp)`` of the exact value, ``ulp`` the output dtype's
relative rounding (float32 here: the interpreter's float32 -> bfloat16 downcast
truncates; bf16 output is the GPU's case, ``test_fp8_gpu.py``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrunner.layers.fp8.blocks import BLOCK, dequantize_blocks, quantize_blocks
from kvrunner.layers.fp8.gemm import quantize_token_groups

pytest.importorskip("triton")
from kvrunner.layers.fp8 import w8a8_triton as kernel  # noqa: E402


def operands(m: int, n: int, k: int, seed: int, spread: float = 1.0):
    """Quantized activations (the token-group reference's bytes and column-major scales)
    and a quantized weight, from normal values scaled by ``spread`` per row group."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * spread ** torch.randn(m, 1, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    xq, xs = quantize_token_groups(x)
    wq, ws = quantize_blocks(w)
    return xq, xs, wq, ws


def assert_equals_exact_product(xq, xs, wq, ws, got: torch.Tensor, rows: int) -> None:
    x = (xq.double().view(xq.shape[0], -1, BLOCK) * xs.double()[:, :, None]).view(xq.shape)
    w = dequantize_blocks(wq, ws, torch.float32).double()
    exact = x[:rows] @ w.T
    bound = (x[:rows].abs() @ w.abs().T) * (xq.shape[1] * 2.0**-23 + 2.0**-23) + 1e-30
    assert got.shape == exact.shape and got.dtype == torch.float32
    err = (got.double() - exact).abs()
    worst = err.argmax()
    assert (err <= bound).all(), (f"max error {err.max():.3e}, "
                                  f"bound there {bound.flatten()[worst]:.3e}")


LAUNCHES = st.builds(kernel.W8A8Launch, block_m=st.sampled_from([16, 32, 64]),
                     block_n=st.sampled_from([16, 32, 64, 128]), splits=st.integers(1, 3),
                     num_warps=st.just(4), num_stages=st.sampled_from([1, 3]))


@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, 70), n=st.integers(1, 20).map(lambda i: 16 * i),
       blocks=st.integers(1, 3), seed=st.integers(0, 2**16), launch=LAUNCHES | st.none())
def test_the_product_is_the_exact_product_of_the_dequantized_operands(m, n, blocks, seed, launch):
    """Any rows, columns (a partial last scale block included), K blocks and launch."""
    xq, xs, wq, ws = operands(m, n, blocks * BLOCK, seed)
    got = kernel.w8a8_block_linear(xq, xs, wq, ws, torch.float32, launch=launch)
    assert_equals_exact_product(xq, xs, wq, ws, got, m)


def test_activation_scales_far_apart_scale_each_row_by_its_own():
    """Rows whose groups' scales span 2^-20 to 2^20: each row's result is its own
    groups' scales times its bytes' product, never a neighbour's."""
    xq, xs, wq, ws = operands(40, 96, 2 * BLOCK, seed=5, spread=2.0**10)
    got = kernel.w8a8_block_linear(xq, xs, wq, ws, torch.float32,
                                   launch=kernel.W8A8Launch(16, 32, splits=2))
    assert_equals_exact_product(xq, xs, wq, ws, got, 40)


def test_padding_rows_are_left_out():
    """The token quantization pads rows to a multiple of 16 for scaled_mm; asked for
    the first ``rows``, the kernel computes and returns those only."""
    xq, xs, wq, ws = operands(16, 64, BLOCK, seed=2)
    got = kernel.w8a8_block_linear(xq, xs, wq, ws, torch.float32, rows=5)
    assert_equals_exact_product(xq, xs, wq, ws, got, 5)


@pytest.mark.parametrize("m,n,k,want", [
    # up to 16 rows: 16 x 128 tiles, K split until the tiles and splits fill the machine
    (1, 4096, 4096, (16, 128, 9)), (16, 24576, 4096, (16, 128, 2)),
    # up to 64: 64 x 64 tiles, K split four ways where the tiles are fewer than 264
    (17, 4096, 4096, (64, 64, 4)), (64, 6144, 4096, (64, 64, 4)),
    (64, 24576, 4096, (64, 64, 1)), (32, 4096, 256, (64, 64, 2)),
    # more decode rows: unsplit 64 x 64; a prefill's: 128 x 128
    (65, 4096, 4096, (64, 64, 1)), (256, 4096, 12288, (64, 64, 1)),
    (4096, 6144, 4096, (128, 128, 1)),
])
def test_the_default_launch_follows_the_rows(m, n, k, want):
    launch = kernel.default_launch(m, n, k)
    assert (launch.block_m, launch.block_n, launch.splits) == want


@pytest.mark.parametrize("bad,words", [
    (dict(x_dtype=torch.bfloat16), "must be torch.float8_e4m3fn"),
    (dict(k=200), "not a multiple of 128"),
    (dict(scales_shape=(8, 1)), "activation scales must be float32 of shape"),
    (dict(weight_scales_shape=(1, 1)), "weight scales must be float32 of shape"),
])
def test_bad_operands_are_refused_by_name(bad, words):
    k = bad.get("k", 256)
    xq = torch.zeros(8, k, dtype=bad.get("x_dtype", torch.float8_e4m3fn))
    xs = torch.ones(bad.get("scales_shape", (8, -(-k // BLOCK))))
    wq = torch.zeros(32, k, dtype=torch.float8_e4m3fn)
    ws = torch.ones(bad.get("weight_scales_shape", (1, -(-k // BLOCK))))
    with pytest.raises(ValueError, match=words):
        kernel.w8a8_block_linear(xq, xs, wq, ws, torch.float32)


def test_a_launch_that_cannot_hold_one_weight_scale_is_refused():
    with pytest.raises(ValueError, match="must divide the scale block"):
        kernel.W8A8Launch(16, 96)
