"""The fused (residual add +) RMSNorm kernel computes what the torch path computes.

Both norm variants (Qwen3's: round, then multiply by ``w``; Qwen3-Next's
zero-centred: multiply by ``1 + w`` in float32, then round), with and without the
residual, on contiguous and row-strided inputs. The kernel runs under the Triton
interpreter (``[kernels] triton_on_cpu``); the torch path is the oracle, and float32
results are also held to a float64 naive norm.
"""

from __future__ import annotations

import torch
from fused_testing import DTYPES, TORCH_MATH_OPS, assert_same_values, triton_path
from hypothesis import given
from hypothesis import strategies as st
from torch.profiler import profile

from kvrunner.layers.rmsnorm import RMSNorm, ZeroCenteredRMSNorm

NORMS = (RMSNorm, ZeroCenteredRMSNorm)
EPS = 1e-6
#: a large eps too, so that dropping it (or adding it in the wrong place) shows
EPSILONS = st.sampled_from([EPS, 0.5])


def make_norm(cls: type[RMSNorm], hidden: int, dtype: torch.dtype, gen: torch.Generator,
              eps: float = EPS) -> RMSNorm:
    """A norm whose weight is not its init (a dropped weight multiply must show)."""
    norm = cls(hidden, eps, dtype=dtype, device="cpu")
    base = 0.0 if cls is ZeroCenteredRMSNorm else 1.0
    norm.weight.data = (base + 0.3 * torch.randn(hidden, generator=gen)).to(dtype)
    return norm


def rows_of(rows: int, hidden: int, pad: int, dtype: torch.dtype,
            gen: torch.Generator) -> torch.Tensor:
    """``[rows, hidden]``; with ``pad`` > 0, a row-strided view into a wider buffer."""
    return (2 * torch.randn(rows, hidden + pad, generator=gen)).to(dtype)[:, :hidden]


@given(
    rows=st.integers(1, 9),
    hidden=st.integers(16, 64),
    cls=st.sampled_from(NORMS),
    dtype=st.sampled_from(DTYPES),
    with_residual=st.booleans(),
    pad=st.sampled_from([0, 0, 5]),
    eps=EPSILONS,
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_torch_path(rows: int, hidden: int, cls: type[RMSNorm],
                                   dtype: torch.dtype, with_residual: bool, pad: int,
                                   eps: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    norm = make_norm(cls, hidden, dtype, gen, eps)
    x = rows_of(rows, hidden, pad, dtype, gen)
    residual = rows_of(rows, hidden, pad, dtype, gen) if with_residual else None
    x_before = x.clone()
    with triton_path(False):
        expected = norm(x, residual)
    with triton_path(True):
        actual = norm(x, residual)
    torch.testing.assert_close(x, x_before, rtol=0, atol=0)  # inputs are not written
    # Roundings to the dtype: the residual sum; then the normalised value and its
    # product with the weight (plain), or the one product with 1 + w (zero-centred).
    norm_roundings = 1 if cls is ZeroCenteredRMSNorm else 2
    if residual is None:
        assert_same_values(actual, expected, roundings=norm_roundings)
    else:
        assert_same_values(actual[0], expected[0], roundings=1 + norm_roundings)
        assert_same_values(actual[1], expected[1], roundings=1)


@given(
    rows=st.integers(1, 9),
    hidden=st.integers(16, 64),
    cls=st.sampled_from(NORMS),
    eps=EPSILONS,
    seed=st.integers(0, 2**16),
)
def test_float32_kernel_matches_naive_float64_norm(rows: int, hidden: int,
                                                   cls: type[RMSNorm], eps: float,
                                                   seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    norm = make_norm(cls, hidden, torch.float32, gen, eps)
    x, residual = (rows_of(rows, hidden, 0, torch.float32, gen) for _ in range(2))
    total = x.double() + residual.double()
    rms = total.pow(2).mean(-1, keepdim=True).add(eps).sqrt()
    w = norm.weight.double() + (1.0 if cls is ZeroCenteredRMSNorm else 0.0)
    with triton_path(True):
        out, new_residual = norm(x, residual)
    torch.testing.assert_close(new_residual.double(), total, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.double(), total / rms * w, rtol=1e-5, atol=1e-5)


def test_leading_dimensions_are_rows() -> None:
    """A ``[T, heads, D]`` input (per-head norm) normalises each head separately."""
    gen = torch.Generator().manual_seed(1)
    norm = make_norm(RMSNorm, 16, torch.float32, gen)
    x = torch.randn(3, 4, 16, generator=gen)
    with triton_path(False):
        expected = norm(x)
    with triton_path(True):
        actual = norm(x)
    assert_same_values(actual, expected, roundings=2)


def test_triton_path_issues_no_torch_math() -> None:
    """The env switch really changes the path: the torch ops are gone under Triton."""
    gen = torch.Generator().manual_seed(2)
    norm = make_norm(RMSNorm, 32, torch.float32, gen)
    x, residual = torch.randn(4, 32, generator=gen), torch.randn(4, 32, generator=gen)

    def math_ops(on: bool) -> set[str]:
        with triton_path(on), profile() as prof:
            norm(x, residual)
        return {e.name for e in prof.events()} & TORCH_MATH_OPS

    assert {"aten::rsqrt", "aten::pow", "aten::add"} <= math_ops(False)
    assert math_ops(True) == set()


def test_unknown_subclass_keeps_its_own_formula() -> None:
    """A subclass with another ``_norm`` is not run through a kernel that ignores it."""

    class DoubledNorm(RMSNorm):
        def _norm(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super()._norm(x)

    gen = torch.Generator().manual_seed(3)
    norm = DoubledNorm(16, EPS, dtype=torch.float32, device="cpu")
    x = torch.randn(2, 16, generator=gen)
    with triton_path(True):
        out = norm(x)
    torch.testing.assert_close(out, 2 * RMSNorm(16, EPS, dtype=torch.float32, device="cpu")(x))


def test_mixed_dtypes_keep_torch_promotion() -> None:
    """bf16 weight on a float32 activation: torch's promotion, not the kernel's dtype."""
    gen = torch.Generator().manual_seed(4)
    norm = make_norm(RMSNorm, 16, torch.bfloat16, gen)
    x = torch.randn(3, 16, generator=gen)
    with triton_path(False):
        expected = norm(x)
    with triton_path(True):
        actual = norm(x)
    assert actual.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
