"""Rotary embedding and RMSNorm against naive definitions.

Full rotary and the norm are also covered end to end by the transformers parity
test; these check what that test cannot: partial rotary, the relative-position
property, and the fused residual form of the norm.
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from kvrunner.layers.rmsnorm import RMSNorm
from kvrunner.layers.rotary import RotaryEmbedding


def naive_rotary(x: torch.Tensor, pos: torch.Tensor, rotary_dim: int, base: float) -> torch.Tensor:
    """Pair dim i with i + r/2 and rotate the pair as a complex number (float64)."""
    half = rotary_dim // 2
    freq = base ** (-torch.arange(half, dtype=torch.float64) * 2 / rotary_dim)
    angle = pos.double()[:, None, None] * freq
    pair = torch.complex(x[..., :half].double(), x[..., half:rotary_dim].double())
    rotated = pair * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([rotated.real, rotated.imag, x[..., rotary_dim:].double()], dim=-1)


@given(st.sampled_from([4, 8, 16]), st.lists(st.integers(0, 255), min_size=1, max_size=6),
       st.integers(0, 1000))
def test_rotary_matches_naive_including_partial(rotary_dim: int, positions: list[int],
                                                seed: int) -> None:
    rope = RotaryEmbedding(16, max_position=256, base=500.0, rotary_dim=rotary_dim)
    gen = torch.Generator().manual_seed(seed)
    pos = torch.tensor(positions)
    q, k = torch.randn(len(pos), 3, 16, generator=gen), torch.randn(len(pos), 1, 16, generator=gen)
    rq, rk = rope(pos, q, k)
    assert rq.dtype == q.dtype and rq.shape == q.shape and rk.shape == k.shape
    # float32 angles (as HF computes them) err by ~position * 2**-24 radians.
    tol = dict(rtol=1e-5, atol=max(positions) * 2e-7 + 1e-6)
    torch.testing.assert_close(rq.double(), naive_rotary(q, pos, rotary_dim, 500.0), **tol)
    torch.testing.assert_close(rk.double(), naive_rotary(k, pos, rotary_dim, 500.0), **tol)
    torch.testing.assert_close(rq[..., rotary_dim:], q[..., rotary_dim:], rtol=0, atol=0)


@given(st.integers(0, 100), st.integers(0, 100), st.integers(1, 50))
def test_rotary_scores_depend_only_on_relative_position(i: int, j: int, shift: int) -> None:
    rope = RotaryEmbedding(16, max_position=256, base=10000.0)
    gen = torch.Generator().manual_seed(i * 1000 + j)
    q, k = torch.randn(1, 1, 16, generator=gen), torch.randn(1, 1, 16, generator=gen)

    def score(pq: int, pk: int) -> torch.Tensor:
        rq, _ = rope(torch.tensor([pq]), q, k)
        _, rk = rope(torch.tensor([pk]), q, k)
        return (rq * rk).sum()

    torch.testing.assert_close(score(i, j), score(i + shift, j + shift), rtol=1e-4, atol=1e-4)


def test_rmsnorm_fused_residual_equals_add_then_norm() -> None:
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(32, 1e-6, dtype=torch.float32, device="cpu")
    norm.weight.data = torch.rand(32, generator=gen) + 0.5
    x, res = torch.randn(4, 32, generator=gen), torch.randn(4, 32, generator=gen)
    total = x + res
    expected = norm.weight * total / total.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    out, new_res = norm(x, res)
    torch.testing.assert_close(new_res, total)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(norm(total), expected)

