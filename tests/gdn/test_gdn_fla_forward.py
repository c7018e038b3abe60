"""fla's forward called directly: bound only where it is fla's own call, and then the
public ``chunk_gated_delta_rule``'s result bit for bit.

The chunk maps the wrapper hands it are checked everywhere; where fla-core is not
installed the other tests skip, and the bit-for-bit comparison needs a GPU (fla's
kernels do not run under the Triton interpreter, see test_gdn_fla.py).
"""

from __future__ import annotations

import pytest
import torch
from gdn_testkit import DEVICE, Heads, cases, qkvgb, same_bytes
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrunner_gdn.ops.gated_delta_rule.chunk_fla import (
    fla_chunk_indices,
    fla_chunk_kernel,
    fla_chunk_maps,
)
from kvrunner_gdn.ops.gated_delta_rule.fla_forward import (
    CHECKED_VERSIONS,
    FlaDirectForward,
    fla_direct_forward,
)


@given(lens=st.lists(st.integers(0, 200), min_size=1, max_size=6),
       chunk=st.sampled_from((16, 32, 64)))
def test_the_chunk_offsets_point_at_each_sequences_first_chunk(lens, chunk):
    """The offsets the direct forward is given with the chunk map, in the same copy:
    sequence s owns rows offsets[s]:offsets[s + 1] of the map, numbered 0, 1, ... and
    one per started chunk of its tokens (none for an empty sequence)."""
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    maps = fla_chunk_maps(cu, chunk, torch.device("cpu"))
    indices, offsets = maps["chunk_indices"], maps["chunk_offsets"].tolist()
    assert torch.equal(indices, fla_chunk_indices(cu, chunk, torch.device("cpu")))
    assert offsets[0] == 0 and offsets[-1] == indices.shape[0] and len(offsets) == len(lens) + 1
    for s, n in enumerate(lens):
        rows = indices[offsets[s] : offsets[s + 1]].tolist()
        assert rows == [[s, c] for c in range(-(-n // chunk))], f"sequence {s}"


def test_the_chunk_offsets_are_the_ones_fla_would_build():
    index = pytest.importorskip("fla.ops.utils.index")
    for cu in ([0, 1], [0, 64, 65, 65, 300], [0, 17, 200, 201]):
        for chunk in (16, 32, 64):
            want = index.prepare_chunk_offsets(torch.tensor(cu), chunk)
            got = fla_chunk_maps(cu, chunk, torch.device("cpu"))["chunk_offsets"]
            assert torch.equal(got, want)


@pytest.fixture(scope="module")
def fla_public():
    """fla's public chunk_gated_delta_rule (module scope: hypothesis reruns the test)."""
    return pytest.importorskip("fla.ops.gated_delta_rule").chunk_gated_delta_rule


def test_the_direct_forward_binds_on_a_checked_fla_and_serves_the_layer():
    pytest.importorskip("fla.ops.gated_delta_rule")
    import fla

    if fla.__version__ not in CHECKED_VERSIONS:
        pytest.skip(f"fla {fla.__version__} is not a checked version: the public call serves")
    direct = fla_direct_forward()
    assert isinstance(direct, FlaDirectForward)
    assert isinstance(fla_chunk_kernel(), FlaDirectForward)


def test_an_unchecked_fla_version_keeps_the_public_call(fla_public, monkeypatch):
    """The composition follows one version's internals: any other version gets the
    public call, never an unchecked composition."""
    import fla

    monkeypatch.setattr(fla, "__version__", "0.0.0")
    assert fla_direct_forward() is None
    assert fla_chunk_kernel() is fla_public


def test_an_active_fla_backend_keeps_the_public_call(fla_public, monkeypatch):
    """Where fla's dispatcher would hand the call to a backend of its own (FlashQLA,
    TileLang, ...), the direct forward would run another kernel: it does not bind."""
    from fla import backends

    registry = backends._load_operation_registry("gated_delta_rule")
    monkeypatch.setattr(registry, "get_active", lambda: object())
    assert fla_direct_forward() is None
    assert fla_chunk_kernel() is fla_public


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("h", [Heads(1, 2, 16, 16), Heads(2, 4, 128, 128)],
                         ids=["k16", "qwen3-next-heads"])
@settings(max_examples=6, deadline=None)
@given(case=cases(max_len=150), start=st.booleans(),
       layout=st.sampled_from(("one", "varlen", "varlen, fla's own chunk map")))
def test_the_direct_forward_is_the_public_call_bit_for_bit(fla_public, case, h, dtype, start,
                                                           layout):
    """Same inputs through both, in fla's 64-token chunks (the layer's), one sequence or
    varlen (with our chunk map or fla's): the same output and final states, byte for
    byte. q, k and v are column slices of one row-major tensor, as the GDN layer passes
    them (the public call's input guard makes them contiguous; the direct forward must
    too)."""
    direct = fla_direct_forward()
    assert direct is not None
    gen = torch.Generator().manual_seed(case.seed)
    tokens = sum(case.lens)
    q, k, v, g, beta = qkvgb(h, tokens, gen)
    mixed = torch.cat([t.flatten(1) for t in (q, k, v)], 1).to(dtype)
    q, k, v = (part.unflatten(1, shape) for part, shape in zip(
        mixed.split([h.hk * h.dk, h.hk * h.dk, h.hv * h.dv], 1),
        ((h.hk, h.dk), (h.hk, h.dk), (h.hv, h.dv)), strict=True))
    beta = beta.to(dtype)
    varlen = layout != "one"
    lens = case.lens if varlen else (tokens,)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    call = dict(scale=h.dk**-0.5, output_final_state=True, use_qk_l2norm_in_kernel=True,
                chunk_size=64)
    if start:
        call["initial_state"] = torch.randn(len(lens), h.hv, h.dk, h.dv, generator=gen).to(DEVICE)
    direct_call = dict(call)
    if varlen:
        call["cu_seqlens"] = direct_call["cu_seqlens"] = torch.tensor(cu, device=DEVICE)
        if layout == "varlen":  # else both build the map from the device offsets
            call["chunk_indices"] = fla_chunk_indices(cu, 64, DEVICE)
            direct_call |= fla_chunk_maps(cu, 64, DEVICE)  # as the wrapper gives it
    batched = [t[None] for t in (q, k, v, g, beta)]
    want_out, want_final = fla_public(*batched, **call)
    out, final = direct(*batched, **direct_call)
    assert out.dtype == want_out.dtype == dtype
    assert same_bytes(out, want_out)
    assert same_bytes(final, want_final)
