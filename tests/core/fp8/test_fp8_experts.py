"""FP8 experts: the stacked layout a checkpoint loads into, and the products over it.

The experts' FP8 storage (``layers/fp8/experts.py``) must hold, for every expert
projection, exactly the bytes and scales :func:`quantize_blocks` gives that
projection alone (what Qwen's FP8 checkpoints store), however the projection
arrives: a float tensor quantized as it loads, an FP8 tensor with its scales, a
transformers-5 stacked float tensor. Both products read it as its dequantized
weights: the torch path multiplies the dequantized weights (equal to the naive
per-token loop), and the Triton kernels, which dequantize each tile by its block
scale as they stream it (w8a16), equal the unscaled kernels run on the dequantized
weights bit for bit, under the interpreter, in float32, at aligned and ragged
dimensions (a partial last block in H, in I, in each half of ``w13``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrunner.errors import ConfigError
from kvrunner.layers.fp8.blocks import BLOCK, quantize_blocks
from kvrunner.layers.fp8.choice import building_with
from kvrunner.layers.fp8.experts import dequantize_experts, quantize_experts
from kvrunner.layers.fused import kernels_chosen
from kvrunner.layers.fused.moe_triton import fp8_tiles, grouped_experts_triton, kernel_config
from kvrunner.layers.linear import TPGroup
from kvrunner.layers.moe import FusedMoE
from kvrunner.layers.moe_align import align_to_blocks
from kvrunner.layers.moe_experts import experts_reference
from kvrunner.models.weight_names import load_weights_into

TOL = dict(rtol=1e-5, atol=1e-5)
#: float32 sums of up to 200 products of unit size, in another order than the naive loop's
SUM_TOL = dict(rtol=1e-5, atol=5e-5)


@st.composite
def fp8_routings(draw: st.DrawFn, max_tokens: int = 10) -> dict:
    """Shapes (block-aligned and ragged H and I), float weights, a routing."""
    experts = draw(st.integers(1, 6))
    top_k = draw(st.integers(1, experts))
    tokens = draw(st.integers(0, max_tokens))
    hidden = draw(st.sampled_from([64, 128, 200]))
    inter = draw(st.sampled_from([48, 128, 160]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]
                      ) if tokens else torch.zeros(0, top_k, dtype=torch.int64)
    # rows of very different magnitudes, so each block's scale differs from its neighbours'
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * torch.rand(
        experts, 2 * inter, 1, generator=gen)
    w2 = torch.randn(experts, hidden, inter, generator=gen) * torch.rand(
        experts, hidden, 1, generator=gen)
    return dict(x=torch.randn(tokens, hidden, generator=gen), w13=w13 * 0.2, w2=w2 * 0.2,
                weights=torch.rand(tokens, top_k, generator=gen), ids=ids.to(torch.int32))


def fp8_layer(experts: int, hidden: int, inter: int, tp: TPGroup | None = None) -> FusedMoE:
    kw = {} if tp is None else {"tp": tp}
    with building_with("fp8"):
        return FusedMoE(experts, hidden, inter, dtype=torch.float32, device="cpu", **kw)


def load(layer: FusedMoE, tensors: dict[str, torch.Tensor], **kw: object) -> set[str]:
    """Load ``tensors`` (names relative to the experts, as ``mlp.experts.`` names them)
    into ``layer`` by the model's rule; returns the names loaded."""
    holder = torch.nn.Module()
    holder.experts = layer
    return {n.removeprefix("experts.") for n in load_weights_into(
        holder, [(f"experts.{n}", t) for n, t in tensors.items()], **kw)}


def loaded_layer(r: dict) -> FusedMoE:
    """An FP8 layer that took ``r``'s experts per expert and projection, as floats."""
    experts, two_i, hidden = r["w13"].shape
    layer = fp8_layer(experts, hidden, two_i // 2)
    load(layer, per_expert(r["w13"], r["w2"]))
    return layer


def per_expert(w13: torch.Tensor, w2: torch.Tensor) -> dict[str, torch.Tensor]:
    """Stacked experts as a checkpoint names them, one tensor per expert and projection."""
    i = w2.shape[2]
    out = {}
    for e in range(w13.shape[0]):
        out |= {f"{e}.gate_proj.weight": w13[e, :i], f"{e}.up_proj.weight": w13[e, i:],
                f"{e}.down_proj.weight": w2[e]}
    return out


def fp8_checkpoint(w13: torch.Tensor, w2: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same experts as an FP8 checkpoint stores them: each projection's bytes and
    its own scales."""
    out = {}
    for name, w in per_expert(w13, w2).items():
        out[name], out[name + "_scale_inv"] = quantize_blocks(w)
    return out


def stored(layer: FusedMoE) -> dict[str, torch.Tensor]:
    return {"w13": layer.w13.view(torch.uint8).clone(), "w2": layer.w2.view(torch.uint8).clone(),
            "w13_scale_inv": layer.w13_scale_inv.clone(),
            "w2_scale_inv": layer.w2_scale_inv.clone()}


def dequantized(layer: FusedMoE) -> tuple[torch.Tensor, torch.Tensor]:
    return dequantize_experts(layer.w13, layer.w13_scale_inv, layer.w2, layer.w2_scale_inv,
                              torch.float32)


@settings(max_examples=30, deadline=None)
@given(fp8_routings())
def test_a_float_load_stores_each_projections_own_blocks(r: dict) -> None:
    layer = loaded_layer(r)
    i, ib = r["w2"].shape[2], -(-r["w2"].shape[2] // 128)
    for e, (gate, up, down) in enumerate(zip(r["w13"][:, :i], r["w13"][:, i:], r["w2"],
                                             strict=True)):
        for w, rows, scale_rows, stacked, scales in (
                (gate, slice(0, i), slice(0, ib), layer.w13, layer.w13_scale_inv),
                (up, slice(i, 2 * i), slice(ib, 2 * ib), layer.w13, layer.w13_scale_inv),
                (down, slice(None), slice(None), layer.w2, layer.w2_scale_inv)):
            q, s = quantize_blocks(w)
            assert torch.equal(stacked[e, rows].view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(scales[e, scale_rows], s)


@settings(max_examples=20, deadline=None)
@given(fp8_routings())
def test_an_fp8_checkpoint_loads_the_bytes_a_float_load_writes(r: dict) -> None:
    experts, two_i, hidden = r["w13"].shape
    from_fp8 = fp8_layer(experts, hidden, two_i // 2)
    load(from_fp8, fp8_checkpoint(r["w13"], r["w2"]))
    expected = stored(loaded_layer(r))
    assert all(torch.equal(a, expected[k]) for k, a in stored(from_fp8).items())


def test_a_stacked_float_push_equals_the_per_expert_one_and_a_stacked_fp8_one_is_refused(
) -> None:
    gen = torch.Generator().manual_seed(4)
    r = dict(w13=torch.randn(3, 2 * 160, 200, generator=gen),
             w2=torch.randn(3, 200, 160, generator=gen))
    stacked = fp8_layer(3, 200, 160)
    loaded = load(stacked, {"gate_up_proj": r["w13"], "down_proj": r["w2"]})
    assert "0.gate_proj.weight_scale_inv" in loaded  # a float push writes the scales too
    expected = stored(loaded_layer(r))
    assert all(torch.equal(a, expected[k]) for k, a in stored(stacked).items())
    q13 = quantize_experts(r["w13"], r["w2"])[0]
    with pytest.raises(ValueError, match="FP8 stacked tensor has no block scales"):
        load(stacked, {"gate_up_proj": q13}, require_all=False)


@given(fp8_routings())
def test_the_torch_path_multiplies_the_dequantized_weights(r: dict) -> None:
    layer = loaded_layer(r)
    with kernels_chosen(triton_on_cpu=False):
        out = layer(r["x"], r["weights"], r["ids"])
    w13, w2 = dequantized(layer)
    torch.testing.assert_close(out, experts_reference(r["x"], w13, w2, r["weights"], r["ids"]),
                               **SUM_TOL)


@settings(max_examples=10, deadline=None)
@given(fp8_routings(max_tokens=8))
def test_the_w8a16_kernels_equal_the_unscaled_kernels_on_the_dequantized_weights(r: dict
                                                                                   ) -> None:
    layer = loaded_layer(r)
    w13, w2 = dequantized(layer)
    experts = w13.shape[0]
    with kernels_chosen(triton_on_cpu=True):
        out = layer(r["x"], r["weights"], r["ids"])
    config = fp8_tiles(kernel_config(r["ids"].numel(), experts), BLOCK)
    blocks = align_to_blocks(r["ids"], experts, config["BLOCK_M"])
    plain = grouped_experts_triton(r["x"], w13, w2, r["weights"], blocks, config).sum(dim=1)
    assert torch.equal(out, plain)
    torch.testing.assert_close(out, experts_reference(r["x"], w13, w2, r["weights"], r["ids"]),
                               **SUM_TOL)


@pytest.mark.parametrize("per_expert_rows", [1, 6, 16, 48, 200])
def test_every_tile_configuration_reads_the_scales_of_its_blocks(per_expert_rows: int) -> None:
    """The decode tiles (a K step of 256, cut to one scale block) and the prefill tiles
    (K steps of 64: two per block) both find each tile's scale."""
    experts, top_k, tokens, hidden, inter = 3, 2, 37, 200, 160
    gen = torch.Generator().manual_seed(per_expert_rows)
    r = dict(x=torch.randn(tokens, hidden, generator=gen),
             w13=torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2,
             w2=torch.randn(experts, hidden, inter, generator=gen) * 0.2,
             weights=torch.rand(tokens, top_k, generator=gen),
             ids=torch.stack([torch.randperm(experts, generator=gen)[:top_k]
                              for _ in range(tokens)]).to(torch.int32))
    layer = loaded_layer(r)
    config = fp8_tiles(kernel_config(per_expert_rows * experts, experts), BLOCK)
    assert 128 % config["BLOCK_K"] == 0
    blocks = align_to_blocks(r["ids"], experts, config["BLOCK_M"])
    out = grouped_experts_triton(r["x"], layer.w13, layer.w2, r["weights"], blocks, config,
                                 scales=(layer.w13_scale_inv, layer.w2_scale_inv),
                                 scale_block=BLOCK)
    w13, w2 = dequantized(layer)
    assert torch.equal(out, grouped_experts_triton(r["x"], w13, w2, r["weights"], blocks, config))
    torch.testing.assert_close(out.sum(dim=1),
                               experts_reference(r["x"], w13, w2, r["weights"], r["ids"]),
                               **SUM_TOL)


def test_a_k_step_across_scale_blocks_is_refused() -> None:
    layer = fp8_layer(2, 256, 128)
    ids = torch.tensor([[0], [1]], dtype=torch.int32)
    config = kernel_config(2, 2)
    assert config["BLOCK_K"] > 128
    with pytest.raises(ValueError, match="BLOCK_K dividing 128"):
        grouped_experts_triton(torch.zeros(2, 256), layer.w13, layer.w2, torch.ones(2, 1),
                               align_to_blocks(ids, 2, config["BLOCK_M"]), config,
                               scales=(layer.w13_scale_inv, layer.w2_scale_inv), scale_block=BLOCK)


def identity_group(rank: int) -> TPGroup:
    """Rank ``rank`` of two whose all-reduce returns the rank's own partial sum."""
    return TPGroup(rank=rank, size=2, all_reduce=lambda x: x, all_gather=lambda x: x)


@pytest.mark.parametrize("source", ["float", "fp8"])
def test_two_ranks_hold_the_blocks_of_their_halves_and_their_sums_add_up(source: str) -> None:
    gen = torch.Generator().manual_seed(2)
    experts, hidden, inter = 3, 200, 256
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.2
    checkpoint = per_expert(w13, w2) if source == "float" else fp8_checkpoint(w13, w2)
    x = torch.randn(5, hidden, generator=gen)
    ids = torch.tensor([[0, 1], [2, 0], [1, 2], [0, 2], [1, 0]], dtype=torch.int32)
    weights = torch.rand(5, 2, generator=gen)
    outs = []
    for tp in (None, identity_group(0), identity_group(1)):
        layer = fp8_layer(experts, hidden, inter, tp)
        load(layer, checkpoint)
        outs.append(layer(x, weights, ids))
    torch.testing.assert_close(outs[1] + outs[2], outs[0], **TOL)


def test_a_rank_slice_off_a_block_boundary_is_refused() -> None:
    with pytest.raises(ConfigError, match="multiple of 128"):
        fp8_layer(3, 128, 192, identity_group(1))  # 96 rows a rank
