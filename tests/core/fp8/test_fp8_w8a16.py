"""The w8a16 kernel (Triton; under the interpreter on the CPU): ``x @ dequant(W).T`` with
the e4m3 weight dequantized tile by tile, equal to the dequantizing reference.

The reference is ``F.linear(x, dequantize_blocks(W, s, x.dtype))`` computed exactly (in
float64): the weight scaled in float32 and rounded to the activations' dtype, as the
kernel rounds each tile. The kernel sums the products in float32 in its own order and
rounds once to the output dtype, so each output lies within
``(|x| @ |dequant(W)|.T) * (K * 2^-23 + ulp)`` of the exact value (plus fp16's
subnormal spacing). Test weights come from ``quantize_blocks`` (torch rounds to e4m3;
the interpreter's own downcast to e4m3 loses a binade when rounding carries, but the
kernel only loads e4m3 and upcasts, which the first test shows is exact for every code).

The interpreter's ``tl.dot`` mishandles bfloat16 and its float32 -> bfloat16 downcast
truncates, so the CPU checks float32 and float16; bf16 is the GPU's case
(``test_fp8_w8a16_gpu.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from kvrunner.layers.fp8.blocks import BLOCK, FP8_MAX, dequantize_blocks, quantize_blocks
from kvrunner.layers.fp8.gemm import fp8_linear, w8a16_serves

pytest.importorskip("triton")
from kvrunner.layers.fp8 import w8a16_triton as kernel  # noqa: E402

DTYPES = (torch.float32, torch.float16)


def assert_equals_reference(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
                            got: torch.Tensor) -> None:
    """``got`` is ``x @ dequant(q, s, x.dtype).T`` to float32 accumulation and one
    rounding to ``x``'s dtype (see the module docstring)."""
    w = dequantize_blocks(q, s, x.dtype).double()
    exact = x.double() @ w.T
    scale = x.double().abs() @ w.abs().T
    half = x.dtype == torch.float16
    ulp = 2.0**-10 if half else 2.0**-23
    tol = scale * (x.shape[-1] * 2.0**-23 + ulp) + (2.0**-25 if half else 1e-30)
    assert got.dtype == x.dtype and got.shape == exact.shape
    assert ((got.double() - exact).abs() <= tol).all(), (got.double() - exact).abs().max()


#: every e4m3 byte but the two NaNs (``x111_1111``): zeros, subnormals, normals, +-448
E4M3_CODES = torch.arange(256, dtype=torch.uint8)[
    (torch.arange(256) & 0x7F) != 0x7F].view(torch.float8_e4m3fn)


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_e4m3_code_loads_and_upcasts_exactly(rows: int, dtype: torch.dtype) -> None:
    """A weight column of every code, scale 1, times ones: each output is its code's value
    (every e4m3 value is exact in float16 and float32), through the one-row kernel and
    the tensor-core one."""
    q = E4M3_CODES.reshape(-1, 1).contiguous()
    s = torch.ones(2, 1)
    y = kernel.w8a16_linear(torch.ones(rows, 1, dtype=dtype), q, s)
    assert torch.equal(y.float(), q.float().T.expand(rows, -1))


def _weights(n: int, k: int, values: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_blocks`` of a random ``[n, k]`` weight whose stored bytes are mostly
    ordinary (``normal``), near the e4m3 maximum (``near_max``: every element within 10%
    of its block's amax), or subnormal (``subnormal``: one large element a block, the
    rest below e4m3's smallest normal, 2^-6, after scaling)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    if values == "near_max":
        w = w.sign() * (0.9 + 0.1 * torch.rand(n, k, generator=g))
    elif values == "subnormal":
        w = w.clamp(-3, 3) * 2.0**-8 / FP8_MAX
        w[::BLOCK, ::BLOCK] = 1.0  # each block's amax: the rest scale below 2^-6
    return quantize_blocks(w)


@given(
    m=st.integers(1, kernel.MAX_ROWS),
    n=st.one_of(st.sampled_from([BLOCK, 2 * BLOCK]), st.integers(1, 300)),
    k=st.one_of(st.sampled_from([BLOCK, 2 * BLOCK]), st.integers(1, 300)),
    dtype=st.sampled_from(DTYPES),
    values=st.sampled_from(["normal", "near_max", "subnormal"]),
    zero_block=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_it_equals_the_dequantizing_reference(m: int, n: int, k: int, dtype: torch.dtype,
                                             values: str, zero_block: bool, seed: int) -> None:
    """Any rows up to ``MAX_ROWS``, N and K aligned to the blocks or ragged, weights of
    every kind, a block whose scale is zero: the default launch equals the reference."""
    q, s = _weights(n, k, values, seed)
    if zero_block:
        s[-1, 0] = 0.0
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    y = kernel.w8a16_linear(x, q, s)
    assert_equals_reference(x, q, s, y)
    if values == "subnormal":  # the bytes but each block's amax are subnormal (or zero)
        rest = torch.ones(n, k, dtype=torch.bool)
        rest[::BLOCK, ::BLOCK] = False
        exponents = q.view(torch.uint8)[rest] & 0x78
        assert (exponents == 0).all() and 2 * (q.float()[rest] != 0).sum() >= rest.sum()


@given(
    gemv=st.booleans(),
    m=st.integers(1, 80),
    n=st.integers(1, 300),
    k=st.integers(1, 400),
    block_m=st.sampled_from([16, 32, 64]),
    block_n=st.sampled_from([8, 16, 32, 64, 128]),
    block_k=st.sampled_from([16, 32, 64, 128, 256, 512]),
    splits=st.integers(1, 6),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_every_launch_equals_the_dequantizing_reference(
        gemv: bool, m: int, n: int, k: int, block_m: int, block_n: int, block_k: int,
        splits: int, dtype: torch.dtype, seed: int) -> None:
    """Any tile shape and split of K, the one-row kernel (K steps spanning several
    scale blocks) or the tensor-core one: the launch changes the speed, never the
    product."""
    m = 1 if gemv else m
    block_n = block_n if gemv else max(16, block_n)
    block_k = block_k if gemv else min(BLOCK, block_k)
    launch = kernel.W8A16Launch(block_m, block_n, block_k, splits, gemv)
    q, s = _weights(n, k, "normal", seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    assert_equals_reference(x, q, s, kernel.w8a16_linear(x, q, s, launch))


@pytest.mark.parametrize("rows", [1, 5])
def test_the_scaled_weight_is_rounded_to_the_activations_dtype(rows: int) -> None:
    """Scales so small that the dequantized weights fall among float16's subnormals
    (spacing 2^-24, a large step for values near 1e-6): the kernel rounds them there,
    as ``dequantize_blocks(W, s, float16)`` does, before it multiplies. A kernel that
    multiplied the float32 weights would be percents off."""
    q, _ = _weights(96, 200, "normal", 5)
    s = torch.full((1, 2), 1e-8)
    x = torch.full((rows, 200), 1000.0, dtype=torch.float16)
    y = kernel.w8a16_linear(x, q, s)
    assert_equals_reference(x, q, s, y)
    unrounded = x.double() @ dequantize_blocks(q, s).double().T
    assert ((y.double() - unrounded).abs() > 1e-3 * unrounded.abs()).any()


def test_a_zero_scale_block_zeroes_its_outputs() -> None:
    """Scale 0 for the block of rows 128..255 and columns 0..127, with K = 128: those
    outputs are exactly zero, every other one is the reference's."""
    q, s = _weights(300, BLOCK, "normal", 0)
    s[1, 0] = 0.0
    x = torch.randn(5, BLOCK, generator=torch.Generator().manual_seed(1))
    y = kernel.w8a16_linear(x, q, s)
    assert torch.equal(y[:, BLOCK:2 * BLOCK], torch.zeros(5, BLOCK))
    assert y[:, :BLOCK].abs().min() > 0
    assert_equals_reference(x, q, s, y)


def test_leading_dimensions_and_empty_shapes() -> None:
    q, s = _weights(40, 70, "normal", 2)
    x = torch.randn(2, 3, 70, dtype=torch.float16)
    y = kernel.w8a16_linear(x, q, s)
    assert y.shape == (2, 3, 40)
    assert_equals_reference(x.reshape(6, 70), q, s, y.reshape(6, 40))
    assert kernel.w8a16_linear(torch.randn(0, 70), q, s).shape == (0, 40)
    empty_q, empty_s = quantize_blocks(torch.zeros(40, 0))
    assert torch.equal(kernel.w8a16_linear(torch.randn(3, 0), empty_q, empty_s),
                       torch.zeros(3, 40))


@given(st.integers(1, kernel.MAX_ROWS), st.integers(1, 30_000), st.integers(1, 30_000))
def test_the_default_launch_fills_the_machine_and_respects_the_blocks(m: int, n: int,
                                                                       k: int) -> None:
    launch = kernel.default_launch(m, n, k)
    assert launch.gemv == (m == 1)
    assert BLOCK % launch.block_n == 0
    assert launch.gemv or BLOCK % launch.block_k == 0
    depth = -(-k // launch.block_k)
    assert 1 <= launch.splits <= depth  # no split shallower than one step
    if not launch.gemv:
        assert launch.block_m >= min(m, 64)
        tiles = -(-n // launch.block_n) * -(-m // launch.block_m)
        assert tiles * launch.splits >= kernel.TARGET_PROGRAMS or launch.splits == depth


@pytest.mark.parametrize(("launch", "problem"), [
    (dict(block_m=16, block_n=48, block_k=128, splits=1), "block_n 48 must divide"),
    (dict(block_m=16, block_n=64, block_k=256, splits=1), "block_k 256 must divide"),
    (dict(block_m=8, block_n=64, block_k=128, splits=1), "tiles of 16 and up"),
    (dict(block_m=16, block_n=64, block_k=128, splits=0), "splits must be at least 1"),
])
def test_a_launch_that_breaks_the_scale_blocks_is_refused(launch: dict, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        kernel.W8A16Launch(**launch)


def test_bad_operands_are_refused_naming_the_problem() -> None:
    q, s = _weights(40, 70, "normal", 3)
    x = torch.randn(2, 70)
    with pytest.raises(ValueError, match="activations must be one of"):
        kernel.w8a16_linear(x.double(), q, s)
    with pytest.raises(ValueError, match="float8_e4m3fn matrix contiguous along K"):
        kernel.w8a16_linear(x, q.float(), s)
    with pytest.raises(ValueError, match=r"scales must be float32 of shape \(1, 1\)"):
        kernel.w8a16_linear(x, q, torch.ones(1, 2))
    with pytest.raises(ValueError, match="width 71 do not fit"):
        kernel.w8a16_linear(torch.randn(2, 71), q, s)
    with pytest.raises(ValueError, match="a gemv launch takes one row, got 2"):
        kernel.w8a16_linear(x, q, s, kernel.W8A16Launch(1, 8, 512, 1, gemv=True))


def test_the_cpu_product_stays_the_dequantizing_reference() -> None:
    """``fp8_linear`` on CPU tensors never takes the kernel: its result is bit for bit
    ``F.linear`` on the dequantized weight (the CPU oracle of an FP8 engine)."""
    q, s = _weights(256, 384, "normal", 4)
    x = torch.randn(3, 384, dtype=torch.bfloat16)
    assert not w8a16_serves(x, q)
    assert torch.equal(fp8_linear(x, q, s), F.linear(x, dequantize_blocks(q, s, x.dtype)))
