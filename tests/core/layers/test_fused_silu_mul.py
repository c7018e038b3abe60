"""The fused SiLU-and-mul kernel computes what ``silu_and_mul``'s torch path computes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from fused_testing import DTYPES, TORCH_MATH_OPS, assert_same_values, triton_path
from hypothesis import given
from hypothesis import strategies as st
from torch.profiler import profile

from kvrunner.layers.activation import silu_and_mul


def gate_up(shape: tuple[int, ...], d: int, pad: int, dtype: torch.dtype,
            gen: torch.Generator) -> torch.Tensor:
    """``[*shape, 2d]``; with ``pad`` > 0, a row-strided view into a wider buffer."""
    return (3 * torch.randn(*shape, 2 * d + pad, generator=gen)).to(dtype)[..., : 2 * d]


@given(
    shape=st.sampled_from([(1,), (4,), (9,), (2, 3)]),
    d=st.integers(1, 80),
    pad=st.sampled_from([0, 0, 3]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_torch_path(shape: tuple[int, ...], d: int, pad: int, dtype: torch.dtype,
                                   seed: int) -> None:
    x = gate_up(shape, d, pad, dtype, torch.Generator().manual_seed(seed))
    act = silu_and_mul
    with triton_path(False):
        expected = act(x)
    with triton_path(True):
        actual = act(x)
    assert_same_values(actual, expected, roundings=2)  # silu(gate), then its product with up


@given(d=st.integers(1, 80), seed=st.integers(0, 2**16))
def test_float32_kernel_matches_naive_float64(d: int, seed: int) -> None:
    x = gate_up((5,), d, 0, torch.float32, torch.Generator().manual_seed(seed))
    gate, up = x.double()[..., :d], x.double()[..., d:]
    with triton_path(True):
        actual = silu_and_mul(x)
    torch.testing.assert_close(actual.double(), gate * torch.sigmoid(gate) * up,
                               rtol=1e-6, atol=1e-6)


def test_rows_wider_than_one_program() -> None:
    """A row of more columns than one program covers is tiled across programs."""
    x = gate_up((2,), 1100, 0, torch.float32, torch.Generator().manual_seed(7))
    with triton_path(True):
        actual = silu_and_mul(x)
    torch.testing.assert_close(actual, F.silu(x[:, :1100]) * x[:, 1100:])


def test_triton_path_issues_no_torch_math() -> None:
    x = gate_up((4,), 16, 0, torch.float32, torch.Generator().manual_seed(8))

    def math_ops(on: bool) -> set[str]:
        with triton_path(on), profile() as prof:
            silu_and_mul(x)
        return {e.name for e in prof.events()} & TORCH_MATH_OPS

    assert {"aten::silu", "aten::mul"} <= math_ops(False)
    assert math_ops(True) == set()
