"""The fused q/k norm + rotary kernel computes what the module sequence computes.

``qk_norm_rope(positions, q, k, q_norm, k_norm, rotary)`` must equal
``rotary(positions, q_norm(q), k_norm(k))``: for both norm variants, full and
partial rotary, and q/k laid out as the models produce them (contiguous, split
from a fused qkv row, interleaved head by head with an output gate). The same
kernel without the norms is ``RotaryEmbedding.forward``'s Triton path.
"""

from __future__ import annotations

import torch
from fused_testing import DTYPES, assert_same_values, operand_scale, triton_path
from hypothesis import given
from hypothesis import strategies as st

from kvrunner.layers.fused import qk_norm_rope
from kvrunner.layers.rmsnorm import RMSNorm, ZeroCenteredRMSNorm
from kvrunner.layers.rotary import RotaryEmbedding

MAX_POSITION, BASE, EPS = 64, 500.0, 1e-6
#: a large eps too, so that dropping it (or adding it in the wrong place) shows
EPSILONS = st.sampled_from([EPS, 0.5])
LAYOUTS = ("contiguous", "qkv", "gated", "padded")


def make_qk(layout: str, tokens: int, hq: int, hk: int, d: int, dtype: torch.dtype,
            gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[T, hq, d]`` and k ``[T, hk, d]`` in one of the models' layouts."""
    if layout == "qkv":  # Qwen3: views into one [T, (hq + 2 hk) d] projection output
        row = torch.randn(tokens, (hq + 2 * hk) * d, generator=gen).to(dtype)
        return row[:, : hq * d].view(tokens, hq, d), row[:, hq * d : (hq + hk) * d].view(
            tokens, hk, d
        )
    if layout == "padded":  # any head stride: both with room after every head
        q = torch.randn(tokens, hq, d + 3, generator=gen).to(dtype)[..., :d]
        return q, torch.randn(tokens, hk, d + 5, generator=gen).to(dtype)[..., :d]
    k = torch.randn(tokens, hk, d, generator=gen).to(dtype)
    if layout == "gated":  # Qwen3-Next: per head [q | gate], q is every other half-row
        return torch.randn(tokens, hq, 2 * d, generator=gen).to(dtype)[..., :d], k
    return torch.randn(tokens, hq, d, generator=gen).to(dtype), k


def make_norm(cls: type[RMSNorm], d: int, dtype: torch.dtype, gen: torch.Generator,
              eps: float = EPS) -> RMSNorm:
    norm = cls(d, eps, dtype=dtype, device="cpu")
    base = 0.0 if cls is ZeroCenteredRMSNorm else 1.0
    norm.weight.data = (base + 0.3 * torch.randn(d, generator=gen)).to(dtype)
    return norm


def naive_rotary(x: torch.Tensor, pos: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Pair dim i with i + r/2 and rotate the pair as a complex number (float64)."""
    half = rotary_dim // 2
    freq = BASE ** (-torch.arange(half, dtype=torch.float64) * 2 / rotary_dim)
    angle = pos.double()[:, None, None] * freq
    pair = torch.complex(x[..., :half].double(), x[..., half:rotary_dim].double())
    rotated = pair * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([rotated.real, rotated.imag, x[..., rotary_dim:].double()], dim=-1)


def naive_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    xd = x.double()
    w = norm.weight.double() + (1.0 if type(norm) is ZeroCenteredRMSNorm else 0.0)
    return xd / xd.pow(2).mean(-1, keepdim=True).add(norm.eps).sqrt() * w


shapes = dict(
    tokens=st.integers(1, 9),
    hq=st.integers(1, 4),
    hk=st.integers(1, 2),
    d=st.sampled_from([16, 32]),
    rotary_fraction=st.sampled_from([1, 2, 4]),  # rotary_dim = d / fraction
    layout=st.sampled_from(LAYOUTS),
    seed=st.integers(0, 2**16),
)


@given(cls=st.sampled_from((RMSNorm, ZeroCenteredRMSNorm)), dtype=st.sampled_from(DTYPES),
       eps=EPSILONS, **shapes)
def test_fused_matches_module_sequence(cls: type[RMSNorm], dtype: torch.dtype, eps: float,
                                       tokens: int, hq: int, hk: int, d: int,
                                       rotary_fraction: int, layout: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(d, max_position=MAX_POSITION, base=BASE, rotary_dim=d // rotary_fraction)
    q_norm, k_norm = make_norm(cls, d, dtype, gen, eps), make_norm(cls, d, dtype, gen, eps)
    q, k = make_qk(layout, tokens, hq, hk, d, dtype, gen)
    positions = torch.randint(0, MAX_POSITION, (tokens,), generator=gen)
    q_before, k_before = q.clone(), k.clone()
    with triton_path(False):
        expected_q, expected_k = rope(positions, q_norm(q), k_norm(k))
        scale_q, scale_k = operand_scale(q_norm(q)), operand_scale(k_norm(k))
    with triton_path(True):
        actual_q, actual_k = qk_norm_rope(positions, q, k, q_norm, k_norm, rope)
    assert actual_q.is_contiguous() and actual_k.is_contiguous()
    # Roundings: the norm's (one or two, as in test_fused_rmsnorm), then the rotation's.
    roundings = (1 if cls is ZeroCenteredRMSNorm else 2) + 1
    assert_same_values(actual_q, expected_q, roundings=roundings, scale=scale_q)
    assert_same_values(actual_k, expected_k, roundings=roundings, scale=scale_k)
    # The kernel reads the strided views in place and writes only its outputs.
    torch.testing.assert_close(q, q_before, rtol=0, atol=0)
    torch.testing.assert_close(k, k_before, rtol=0, atol=0)


@given(cls=st.sampled_from((RMSNorm, ZeroCenteredRMSNorm)), eps=EPSILONS, **shapes)
def test_float32_fused_matches_naive_float64(cls: type[RMSNorm], eps: float, tokens: int,
                                             hq: int, hk: int, d: int, rotary_fraction: int,
                                             layout: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rotary_dim = d // rotary_fraction
    rope = RotaryEmbedding(d, max_position=MAX_POSITION, base=BASE, rotary_dim=rotary_dim)
    q_norm, k_norm = (make_norm(cls, d, torch.float32, gen, eps) for _ in range(2))
    q, k = make_qk(layout, tokens, hq, hk, d, torch.float32, gen)
    positions = torch.randint(0, MAX_POSITION, (tokens,), generator=gen)
    with triton_path(True):
        actual_q, actual_k = qk_norm_rope(positions, q, k, q_norm, k_norm, rope)
    for actual, x, norm in ((actual_q, q, q_norm), (actual_k, k, k_norm)):
        normed = naive_norm(x, norm)
        # float32 angles (as HF computes them) err by ~position * 2**-24 radians.
        atol = (MAX_POSITION * 2e-7 + 1e-6) * float(normed.abs().max())
        torch.testing.assert_close(actual.double(), naive_rotary(normed, positions, rotary_dim),
                                   rtol=1e-5, atol=atol)


@given(dtype=st.sampled_from(DTYPES), **shapes)
def test_rotary_kernel_matches_torch_rotary(dtype: torch.dtype, tokens: int, hq: int, hk: int,
                                            d: int, rotary_fraction: int, layout: str,
                                            seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(d, max_position=MAX_POSITION, base=BASE, rotary_dim=d // rotary_fraction)
    q, k = make_qk(layout, tokens, hq, hk, d, dtype, gen)
    positions = torch.randint(0, MAX_POSITION, (tokens,), generator=gen)
    with triton_path(False):
        expected_q, expected_k = rope(positions, q, k)
    with triton_path(True):
        actual_q, actual_k = rope(positions, q, k)
    # The same float32 arithmetic on the same inputs, rounded once.
    assert_same_values(actual_q, expected_q, roundings=1)
    assert_same_values(actual_k, expected_k, roundings=1)


def test_last_table_row_and_int32_positions() -> None:
    """The largest position reads the table's last row; int32 positions work too."""
    gen = torch.Generator().manual_seed(5)
    rope = RotaryEmbedding(16, max_position=MAX_POSITION, base=BASE)
    q_norm, k_norm = (make_norm(RMSNorm, 16, torch.float32, gen) for _ in range(2))
    q, k = make_qk("qkv", 3, 2, 1, 16, torch.float32, gen)
    positions = torch.tensor([MAX_POSITION - 1, 0, 7], dtype=torch.int32)
    with triton_path(False):
        expected = rope(positions.long(), q_norm(q), k_norm(k))
    with triton_path(True):
        actual = qk_norm_rope(positions, q, k, q_norm, k_norm, rope)
    for a, e in zip(actual, expected, strict=True):
        assert_same_values(a, e, roundings=3)


def test_mismatched_norm_variants_take_the_module_sequence() -> None:
    """A zero-centred q_norm with a plain k_norm cannot share one kernel flag."""
    gen = torch.Generator().manual_seed(6)
    rope = RotaryEmbedding(16, max_position=MAX_POSITION, base=BASE, rotary_dim=8)
    q_norm = make_norm(ZeroCenteredRMSNorm, 16, torch.float32, gen)
    k_norm = make_norm(RMSNorm, 16, torch.float32, gen)
    q, k = make_qk("gated", 2, 2, 1, 16, torch.float32, gen)
    positions = torch.tensor([3, 9])
    with triton_path(False):
        expected = rope(positions, q_norm(q), k_norm(k))
    with triton_path(True):
        actual = qk_norm_rope(positions, q, k, q_norm, k_norm, rope)
    for a, e in zip(actual, expected, strict=True):
        assert_same_values(a, e, roundings=3)
