"""FP8 keys and values (``kv_cache_dtype = "fp8"``): the store writes ``x / scale`` as
e4m3 (clamped to ±448, ties to even), and every attention entry attends ``stored *
scale``: the naive reference's values over the dequantized pool. Scales are per tensor
or per KV head, handed to the kernels as the layer's scale table.

Triton's interpreter rounds float32 to e4m3 its own way (ties away from zero, no
subnormal or NaN results), so under it the Triton stores are shown on values that are e4m3
numbers already, or past the clamp; ``test_paged_gpu.py`` shows the compiled store byte
for byte on any values. The interpreter widens e4m3 exactly, so the attention entries
are shown on any pool here.
"""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from paged_cases import TRITON_DEVICE, PagedCase, paged_cases

from kvrunner.plugin_api import PAD_SLOT_ID
from kvrunner_paged.kv_format import FP8_DTYPE, K_SCALE, V_SCALE, KVFormat, scale_table
from kvrunner_paged.ops.paged_attention.decode import paged_decode_attention
from kvrunner_paged.ops.paged_attention.decode_torch import paged_decode_attention_torch
from kvrunner_paged.ops.paged_attention.fixed_order import LAUNCH, fixed_order_attention
from kvrunner_paged.ops.paged_attention.fixed_order_torch import fixed_order_attention_torch
from kvrunner_paged.ops.paged_attention.inputs import NewKV, PagedAttentionInputs
from kvrunner_paged.ops.paged_attention.naive import naive_paged_attention
from kvrunner_paged.ops.paged_attention.prefill import paged_prefill_attention
from kvrunner_paged.ops.paged_attention.prefill_torch import paged_prefill_attention_torch
from kvrunner_paged.ops.store_kv.naive import naive_store_kv
from kvrunner_paged.ops.store_kv.store import store_kv
from kvrunner_paged.ops.store_kv.store_torch import store_kv_torch

#: per-tensor scales: 1.0 (vLLM's default), powers of two, and ones whose reciprocal rounds
SCALES = st.sampled_from([1.0, 0.25, 2.0, 0.037, 3.0])


def head_scales(data: st.DataObject, num_kv_heads: int) -> float | torch.Tensor:
    """A per-tensor scale, or one per KV head (each from :data:`SCALES`)."""
    if data.draw(st.booleans(), label="per head"):
        return torch.tensor(data.draw(st.lists(SCALES, min_size=num_kv_heads,
                                               max_size=num_kv_heads)))
    return data.draw(SCALES)


def _per_head(scale: float | torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[num_kv_heads, 1]`` float32: a scale to multiply ``[..., heads, dim]`` rows by."""
    return torch.as_tensor(scale, dtype=torch.float32).expand(num_kv_heads).reshape(-1, 1)
#: how large the keys and values are: well inside e4m3's range, and far past its 448
MAGNITUDES = st.sampled_from([1.0, 30.0, 1000.0])
#: deterministic mode's launch at tiles and splits of 16 keys, so tiny cases cross splits
SMALL_TILES = attrs.evolve(LAUNCH[torch.float32], block_m=16, block_n=16)
#: every finite e4m3 value that is 0 or normal (the interpreter converts these exactly)
E4M3_NORMALS = [
    v
    for v in torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float().tolist()
    if math.isfinite(v) and (v == 0 or abs(v) >= 2.0**-6)
]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _fp8_pool(case: PagedCase, gen: torch.Generator, magnitude: float) -> torch.Tensor:
    """``[2, blocks, block_size, kv_heads, dim]`` e4m3; NaN in every slot no sequence reads."""
    pool = case.pool(gen, poison_unread=True) * magnitude
    return pool.clamp(-448, 448).to(FP8_DTYPE)  # clamp keeps NaN


def _rows(
    case: PagedCase, rows: int, gen: torch.Generator, magnitude: float, on_grid: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v as strided views of one projection output; ``on_grid``: every value an
    e4m3 normal or zero times the key scale, or past the clamp."""
    kv = torch.randn((rows, 2 * case.num_kv_heads + 1, case.head_dim), generator=gen) * magnitude
    if on_grid:
        grid = torch.tensor(E4M3_NORMALS + [1e4, -1e4])
        kv = grid[torch.randint(len(grid), kv.shape, generator=gen)]
    return kv[:, : case.num_kv_heads], kv[:, case.num_kv_heads : 2 * case.num_kv_heads]


def _store_triton(**kw: torch.Tensor | float) -> None:
    """The Triton store on its device, results copied back into the given caches."""
    moved = {n: t.to(TRITON_DEVICE) if isinstance(t, torch.Tensor) else t for n, t in kw.items()}
    store_kv(**moved)
    kw["k_cache"].copy_(moved["k_cache"])
    kw["v_cache"].copy_(moved["v_cache"])


def _store_both_ways(
    store, case: PagedCase, scale: float | torch.Tensor, magnitude: float, pads: list[bool],
    on_grid: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``store`` and the naive store from one pool (keys at ``scale``, per tensor or per
    KV head, values at half of it; PAD rows wherever ``pads`` says), which must agree
    byte for byte: ``(pool before, pool after, slots, k, v)``."""
    gen = case.generator()
    before = _fp8_pool(case, gen, 1.0)
    slots = case.slot_mapping()
    slots[[i for i, pad in enumerate(pads[: len(slots)]) if pad]] = PAD_SLOT_ID
    k, v = _rows(case, len(slots), gen, magnitude, on_grid=on_grid)
    heads = _per_head(scale, case.num_kv_heads)
    if on_grid:
        k, v = k * heads, v * (heads / 2)
    after, expected = before.clone(), before.clone()
    table = scale_table(scale, scale / 2, case.num_kv_heads)
    store(k=k, v=v, k_cache=after[0], v_cache=after[1], slot_mapping=slots, scales=table)
    naive_store_kv(k, v, expected[0], expected[1], slots, k_scale=scale, v_scale=scale / 2)
    assert torch.equal(_as_bytes(after), _as_bytes(expected))
    return before, after, slots, k, v


COMPILED_STORE = pytest.param(_store_triton, marks=pytest.mark.gpu, id="compiled")


# Compiled, the Triton store rounds as torch does (ties to even, subnormals): it takes
# any values too, but only on a GPU (module doc).
@pytest.mark.parametrize("store", [pytest.param(store_kv_torch, id="torch"), COMPILED_STORE])
@given(
    data=st.data(),
    case=paged_cases(),
    magnitude=MAGNITUDES,
    pads=st.lists(st.booleans(), max_size=40),
)
def test_a_store_writes_the_naive_stores_bytes(
    store, data: st.DataObject, case: PagedCase, magnitude: float, pads: list[bool]
) -> None:
    """Byte for byte, PAD rows anywhere, every other slot (NaN ones too) untouched; and
    what lands is the input within half an e4m3 step (1/16 of it, or 2^-10 times the
    scale below the normals), clamped to ±448 times its KV head's scale."""
    scale = head_scales(data, case.num_kv_heads)
    before, after, slots, k, v = _store_both_ways(store, case, scale, magnitude, pads,
                                                  on_grid=False)  # fmt: skip
    real = slots >= 0
    flat = after.view(2, -1, case.num_kv_heads, case.head_dim)
    heads = _per_head(scale, case.num_kv_heads)
    for half, rows, s in ((0, k, heads), (1, v, heads / 2)):
        want = torch.maximum(torch.minimum(rows[real], 448 * s), -448 * s)
        got = flat[half, slots[real]].float() * s
        # (float32 products of the reciprocal scale: a part in 10^6 of slack)
        assert ((got - want).abs() <= (want.abs() / 16 + 2.0**-10 * s) * (1 + 1e-6)).all()
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots[real]] = False
    assert torch.equal(_as_bytes(flat[:, untouched]), _as_bytes(before.view_as(flat)[:, untouched]))


@pytest.mark.parametrize(
    "store", [store_kv_torch, naive_store_kv, _store_triton], ids=["torch", "naive", "triton"]
)
def test_e4m3_rounding_ties_to_even_and_saturates(store) -> None:
    """50 lies halfway between 48 and 52 and goes to 48 (even mantissa), 54 to 56; past
    448 saturates; NaN stays NaN. The same for every store entry."""
    k = torch.tensor([50.0, 54.0, 1000.0, -1e6, 448.0, float("nan"), 0.5, -0.0])
    want = torch.tensor([48.0, 56.0, 448.0, -448.0, 448.0, float("nan"), 0.5, -0.0])
    if store is _store_triton and TRITON_DEVICE.type == "cpu":
        # the interpreter rounds ties its own way and writes no e4m3 NaN (module doc)
        keep = [2, 3, 4, 6, 7]
        k, want = k[keep], want[keep]
    k = k.view(-1, 1, 1).expand(-1, 1, 16).contiguous()
    k_cache = torch.zeros((len(k), 1, 1, 16), dtype=FP8_DTYPE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(len(k))
    if store is naive_store_kv:
        store(k, k, k_cache, v_cache, slots)
    else:
        store(k=k, v=k, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
    for cache in (k_cache, v_cache):
        torch.testing.assert_close(cache[:, 0, 0, 0].float(), want, equal_nan=True)
        assert torch.equal(cache[:, 0, 0, 0].float().signbit(), want.signbit())


@given(
    case=paged_cases(),
    scale=st.sampled_from([1.0, 0.5, 4.0]),
    pads=st.lists(st.booleans(), max_size=40),
)
def test_the_triton_store_writes_the_naive_stores_bytes(
    case: PagedCase, scale: float, pads: list[bool]
) -> None:
    """On e4m3 values (times a power-of-two scale) and values past the clamp: every
    written byte the naive store's, every other byte untouched."""
    _store_both_ways(_store_triton, case, scale, 1.0, pads, on_grid=True)


def _attend_inputs(
    case: PagedCase, gen: torch.Generator, magnitude: float, k_scale: float | torch.Tensor,
    v_scale: float | torch.Tensor,
) -> PagedAttentionInputs:
    pool = _fp8_pool(case, gen, magnitude)
    # decode: a row a sequence, then padded rows of no keys; varlen: the tokens
    seqs = case.num_seqs + case.num_pad_rows if case.is_decode else case.num_seqs
    tokens = seqs if case.is_decode else case.num_tokens
    return PagedAttentionInputs(
        q=torch.randn((tokens, case.num_heads, case.head_dim), generator=gen),
        k_cache=pool[0], v_cache=pool[1], block_tables=case.block_table_tensor(seqs),
        context_lens=case.context_lens_tensor(seqs), scale=case.scale,
        scales=scale_table(k_scale, v_scale, case.num_kv_heads),
        query_start_loc=torch.arange(seqs + 1, dtype=torch.int32) if case.is_decode
        else case.query_start_loc(),
        num_seqs=seqs, max_query_len=max(case.query_lens),
    )  # fmt: skip


def _dequantized_reference(x: PagedAttentionInputs) -> torch.Tensor:
    """The naive reference over float32 pools holding ``stored * scale``, unscaled."""
    assert x.scales is not None
    return naive_paged_attention(
        x.q,
        x.k_cache.float() * x.scales[K_SCALE].cpu()[:, None],
        x.v_cache.float() * x.scales[V_SCALE].cpu()[:, None],
        x.block_tables,
        x.query_start_loc,
        x.context_lens,
        x.scale,
    )


def _assert_attends(out: torch.Tensor, x: PagedAttentionInputs) -> None:
    """``out`` is the reference's over the dequantized pool, to float32 rounding: scores
    as large as the keys (up to 448 times the scale) carry their rounding through the
    softmax into values as large, so the absolute tolerance grows with both."""
    assert torch.isfinite(out).all(), "non-finite output (read outside a context?)"
    assert x.scales is not None
    keys, values = (
        c.float().nan_to_num(0.0).abs().max().item() * x.scales[row].max().item()
        for c, row in ((x.k_cache, K_SCALE), (x.v_cache, V_SCALE))
    )
    torch.testing.assert_close(
        out.float(), _dequantized_reference(x), rtol=1e-4, atol=max(1e-5, 1e-6 * keys * values)
    )


def _on_triton_device(x: PagedAttentionInputs) -> PagedAttentionInputs:
    tensors = ("q", "k_cache", "v_cache", "block_tables", "context_lens", "query_start_loc",
               "scales")
    return attrs.evolve(x, **{n: getattr(x, n).to(TRITON_DEVICE) for n in tensors})


ENTRIES = {
    "decode_torch": (True, lambda x: paged_decode_attention_torch(inputs=x)),
    "prefill_torch": (False, lambda x: paged_prefill_attention_torch(inputs=x)),
    "fixed_order_torch": (False, lambda x: fixed_order_attention_torch(inputs=x)),
    "decode_triton": (
        True,
        lambda x: paged_decode_attention(
            inputs=_on_triton_device(x), num_splits=2, block_n=16
        ).cpu(),
    ),
    "prefill_triton": (
        False,
        lambda x: paged_prefill_attention(
            inputs=_on_triton_device(x), block_m=16, block_n=16
        ).cpu(),
    ),
    "fixed_order_triton": (
        False,
        lambda x: fixed_order_attention(
            inputs=_on_triton_device(x), max_context_len=64, key_split=16, launch=SMALL_TILES
        ).cpu(),
    ),
}


@pytest.mark.parametrize("entry", ENTRIES)
@given(data=st.data(), magnitude=MAGNITUDES)
def test_every_entry_attends_the_dequantized_pool(
    entry: str, data: st.DataObject, magnitude: float
) -> None:
    """Decode and varlen entries over an FP8 pool (NaN wherever no sequence reads, padded
    rows and PAD tails included) give the naive reference's output on the float32 pool
    of ``stored * scale``, the scales per tensor or per KV head."""
    decode, attend = ENTRIES[entry]
    case = data.draw(paged_cases(decode=decode, max_pad_rows=3 if decode else 0))
    k_scale, v_scale = head_scales(data, case.num_kv_heads), head_scales(data, case.num_kv_heads)
    x = _attend_inputs(case, case.generator(), magnitude, k_scale, v_scale)
    _assert_attends(attend(x), x)


@given(
    case=paged_cases(decode=True), scale=st.sampled_from([1.0, 0.5]), split_programs=st.booleans()
)
def test_decode_launches_that_store_quantize_what_they_attend(
    case: PagedCase, scale: float, split_programs: bool
) -> None:
    """The decode kernel and deterministic mode's kernel store this step's keys and values
    in their own launch: the pool after it is the naive store's, byte for byte, and the
    output the reference's over it."""
    gen = case.generator()
    x = _attend_inputs(case, gen, 1.0, scale, scale)
    rows = x.q.shape[0]
    k, v = _rows(case, rows, gen, 1.0, on_grid=True)
    k, v = k * scale, v * scale
    slots = torch.cat(
        [case.slot_mapping()[: case.num_seqs], torch.full((rows - case.num_seqs,), PAD_SLOT_ID)]
    )
    expected_k, expected_v = x.k_cache.clone(), x.v_cache.clone()
    naive_store_kv(k, v, expected_k, expected_v, slots, k_scale=scale, v_scale=scale)
    on = attrs.evolve(
        _on_triton_device(x),
        new_kv=NewKV(
            k=k.to(TRITON_DEVICE), v=v.to(TRITON_DEVICE), slot_mapping=slots.to(TRITON_DEVICE)
        ),
    )
    if split_programs:
        out = fixed_order_attention(
            inputs=on, max_context_len=64, split_programs=True, key_split=16, launch=SMALL_TILES
        )
    else:
        out = paged_decode_attention(inputs=on, num_splits=2, block_n=16)
    assert torch.equal(_as_bytes(on.k_cache.cpu()), _as_bytes(expected_k))
    assert torch.equal(_as_bytes(on.v_cache.cpu()), _as_bytes(expected_v))
    stored = attrs.evolve(x, k_cache=expected_k, v_cache=expected_v)
    _assert_attends(out.cpu(), stored)


def test_the_format_names_and_the_scale_table() -> None:
    """Named "auto", keys and values are the model's dtype; "fp8", e4m3. A layer's scale
    table holds each KV head's key and value scale and their float32 reciprocals; a
    scale is one number or one per head, positive and finite."""
    assert KVFormat.for_cache_dtype("auto", torch.bfloat16).dtype == torch.bfloat16
    fp8 = KVFormat.for_cache_dtype("fp8", torch.bfloat16)
    assert (fp8.dtype, fp8.quantized) == (FP8_DTYPE, True)
    table = scale_table(0.1, torch.tensor([2.0, 4.0]), 2)
    point_one = torch.tensor(0.1, dtype=torch.float32)
    assert torch.equal(table, torch.tensor([[point_one, point_one], [2.0, 4.0],
                                            [1 / point_one, 1 / point_one], [0.5, 0.25]]))
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="k_scale must be positive and finite"):
            scale_table(bad, 1.0, 2)
    with pytest.raises(ValueError, match=r"v_scale must be one number or one per KV head \(2\)"):
        scale_table(1.0, torch.ones(3), 2)
    with pytest.raises(ValueError, match="not 'fp8_e5m2'"):
        KVFormat.for_cache_dtype("fp8_e5m2", torch.bfloat16)


@given(data=st.data(), k_scale=SCALES, v_scale=SCALES)
def test_a_decode_launch_that_widens_to_float16_attends_the_dequantized_pool(
    data: st.DataObject, k_scale: float, v_scale: float
) -> None:
    """``widen_f16``: bf16 queries over an e4m3 pool, the tiles widened to float16 (and the
    queries with them), give the reference's output to bf16 rounding, as the default
    widening to bf16 does (Triton under the interpreter on the CPU)."""
    case = data.draw(paged_cases(decode=True, head_dims=(128,), max_pad_rows=0))
    x = _attend_inputs(case, case.generator(), 1.0, k_scale, v_scale)
    x = attrs.evolve(x, q=x.q.to(torch.bfloat16))
    values = x.v_cache.float().nan_to_num(0.0).abs().max().item() * v_scale
    out = paged_decode_attention(inputs=_on_triton_device(x), num_splits=2, block_n=16,
                                 widen_f16=True).cpu()
    torch.testing.assert_close(out.float(), _dequantized_reference(x), rtol=2**-6,
                               atol=2**-6 * values)


@settings(max_examples=10)
@given(case=paged_cases(decode=True, head_dims=(128,), max_pad_rows=0),
       exponent=st.integers(1, 100), num_splits=st.sampled_from([1, 2]))
def test_queries_past_float16s_range_widen_without_overflow(
    case: PagedCase, exponent: int, num_splits: int
) -> None:
    """Queries scaled by ``2**exponent`` and the softmax scale by ``2**-exponent`` (the same
    scores, past float16's 65504 from ``exponent`` 16 on) give the unscaled launch's
    output bit for bit under ``widen_f16``: a group of large queries is scaled down by a
    power of two before it narrows to float16, and never overflows to inf."""
    x = _attend_inputs(case, case.generator(), 1.0, 1.0, 1.0)
    x = _on_triton_device(attrs.evolve(x, q=x.q.to(torch.bfloat16)))
    big = attrs.evolve(x, q=x.q * 2.0**exponent, scale=x.scale * 2.0**-exponent)
    assert torch.equal(big.q.float() * 2.0**-exponent, x.q.float())  # the scaling is exact
    outs = [paged_decode_attention(inputs=y, num_splits=num_splits, block_n=16, widen_f16=True)
            for y in (x, big)]
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[1], outs[0])


@settings(max_examples=3)
@given(case=paged_cases(decode=True, head_dims=(128,), max_pad_rows=0))
def test_widening_to_float16_takes_bf16_queries_over_an_e4m3_pool_only(case: PagedCase) -> None:
    x = _on_triton_device(_attend_inputs(case, case.generator(), 1.0, 1.0, 1.0))
    bf16_q = attrs.evolve(x, q=x.q.to(torch.bfloat16))
    bf16_pool = attrs.evolve(bf16_q, k_cache=bf16_q.k_cache.to(torch.bfloat16),
                             v_cache=bf16_q.v_cache.to(torch.bfloat16), scales=None)
    for wrong in (x, bf16_pool):  # float32 queries; a bf16 pool
        with pytest.raises(ValueError, match="widen_f16"):
            paged_decode_attention(inputs=wrong, widen_f16=True)


@pytest.mark.gpu
@pytest.mark.parametrize("entry", ["decode_triton", "prefill_triton", "fixed_order_triton"])
@given(data=st.data(), k_scale=SCALES, v_scale=SCALES)
def test_bf16_queries_attend_the_dequantized_pool(
    entry: str, data: st.DataObject, k_scale: float, v_scale: float
) -> None:
    """The model's case: bf16 queries over an e4m3 pool (widened to bf16 exactly, the
    scales folded in float32) give the reference's output to bf16 rounding."""
    decode, attend = ENTRIES[entry]
    case = data.draw(paged_cases(decode=decode, head_dims=(128,), max_pad_rows=0))
    x = _attend_inputs(case, case.generator(), 1.0, k_scale, v_scale)
    x = attrs.evolve(x, q=x.q.to(torch.bfloat16))
    values = x.v_cache.float().nan_to_num(0.0).abs().max().item() * v_scale
    torch.testing.assert_close(attend(x).float(), _dequantized_reference(x), rtol=2**-6,
                               atol=2**-6 * values)  # fmt: skip
