"""The mixture-of-experts layer computes what a naive per-token loop computes.

Properties over random shapes and routings, in float32 on the CPU, for the torch
path and for the Triton kernels (under the interpreter, ``[kernels] triton_on_cpu``):
experts that receive no token, every token on one expert, ``top_k`` equal to the
number of experts, an empty batch, and PAD rows (a graph's padding) that must not
change the real rows. The alignment the kernels rely on, the router, and the
tensor-parallel split of each expert are specified on their own.
"""

from __future__ import annotations

import pytest
import torch
from fused_testing import triton_path
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrunner.layers.linear import TPGroup
from kvrunner.layers.moe import FusedMoE, SparseMoeBlock
from kvrunner.layers.moe_align import align_to_blocks, max_padded_rows
from kvrunner.layers.moe_experts import experts_reference, route_reference
from kvrunner.layers.moe_routing import topk_softmax

TOL = dict(rtol=1e-5, atol=1e-5)


@st.composite
def routings(draw: st.DrawFn, max_tokens: int = 12) -> dict:
    """Shapes, weights and a routing: each token's experts distinct, as top-k gives;
    ``concentrated``: every token's first choice is the same expert."""
    experts = draw(st.integers(1, 9))
    top_k = draw(st.integers(1, experts))
    tokens = draw(st.integers(0, max_tokens))
    hidden = draw(st.sampled_from([16, 24, 40]))
    inter = draw(st.sampled_from([16, 20, 48]))
    seed = draw(st.integers(0, 2**16))
    concentrated = draw(st.booleans())
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]
                      ) if tokens else torch.zeros(0, top_k, dtype=torch.int64)
    if concentrated and tokens:
        hot = int(torch.randint(experts, (1,), generator=gen))
        for row in ids:  # swap the hot expert into slot 0 (keeps the row distinct)
            where = (row == hot).nonzero()
            row[where[0, 0] if len(where) else 0] = row[0].clone()
            row[0] = hot
    return dict(
        x=torch.randn(tokens, hidden, generator=gen),
        w13=torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2,
        w2=torch.randn(experts, hidden, inter, generator=gen) * 0.2,
        weights=torch.rand(tokens, top_k, generator=gen),
        ids=ids.to(torch.int32),
    )


def fused(r: dict) -> FusedMoE:
    experts, two_i, hidden = r["w13"].shape
    layer = FusedMoE(experts, hidden, two_i // 2, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        layer.w13.copy_(r["w13"])
        layer.w2.copy_(r["w2"])
    return layer


def expected(r: dict) -> torch.Tensor:
    return experts_reference(r["x"], r["w13"], r["w2"], r["weights"], r["ids"])


@given(routings())
def test_torch_path_equals_the_naive_loop(r: dict) -> None:
    with triton_path(False):
        out = fused(r)(r["x"], r["weights"], r["ids"])
    assert out.shape == r["x"].shape
    torch.testing.assert_close(out, expected(r), **TOL)


@settings(max_examples=8)
@given(routings(max_tokens=8))
def test_triton_kernels_equal_the_naive_loop(r: dict) -> None:
    with triton_path(True):
        out = fused(r)(r["x"], r["weights"], r["ids"])
    torch.testing.assert_close(out, expected(r), **TOL)


@pytest.mark.parametrize("on", [False, True], ids=["torch", "triton"])
def test_every_token_on_one_expert_and_the_rest_idle(on: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    r = dict(x=torch.randn(20, 16, generator=gen), w13=torch.randn(5, 32, 16, generator=gen),
             w2=torch.randn(5, 16, 16, generator=gen), weights=torch.rand(20, 1, generator=gen),
             ids=torch.full((20, 1), 3, dtype=torch.int32))
    with triton_path(on):
        out = fused(r)(r["x"], r["weights"], r["ids"])
    torch.testing.assert_close(out, expected(r), **TOL)


@settings(max_examples=6)
@given(routings(max_tokens=6), st.integers(1, 5), st.sampled_from(["zeros", "garbage"]))
@pytest.mark.parametrize("on", [False, True], ids=["torch", "triton"])
def test_pad_rows_leave_the_real_rows_alone(on: bool, r: dict, pads: int, fill: str) -> None:
    """A captured batch is padded to its graph size; what the PAD rows hold (zeros, or a
    stale earlier batch) and wherever they route must not reach a real row."""
    tokens, hidden = r["x"].shape
    experts, top_k = r["w13"].shape[0], r["ids"].shape[1]
    pad_x = torch.zeros(pads, hidden) if fill == "zeros" else torch.randn(pads, hidden) * 5
    pad_ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(pads)]).to(torch.int32)
    layer = fused(r)
    with triton_path(on):
        alone = layer(r["x"], r["weights"], r["ids"])
        pad_weights = torch.rand(pads, top_k)
        padded = layer(torch.cat([r["x"], pad_x]), torch.cat([r["weights"], pad_weights]),
                       torch.cat([r["ids"], pad_ids]))
    assert padded.shape == (tokens + pads, hidden)
    torch.testing.assert_close(padded[:tokens], alone, **TOL)


@given(st.integers(0, 40), st.integers(1, 9), st.sampled_from([1, 4, 16]), st.integers(0, 999))
def test_alignment_puts_each_assignment_once_in_a_block_of_its_expert(
    tokens: int, experts: int, block_m: int, seed: int
) -> None:
    top_k = min(2, experts)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(experts, (tokens, top_k), generator=gen, dtype=torch.int32)
    blocks = align_to_blocks(ids, experts, block_m)
    n = tokens * top_k
    assert blocks.sorted_ids.numel() == max_padded_rows(n, experts, block_m)
    total = int(blocks.total_padded)
    real = blocks.sorted_ids[:total]
    assert sorted(real[real < n].tolist()) == list(range(n))  # each exactly once
    assert (blocks.sorted_ids[total:] == n).all()  # only padding past the total
    flat = ids.reshape(-1)
    for b in range(total // block_m):
        rows = blocks.sorted_ids[b * block_m : (b + 1) * block_m]
        rows = rows[rows < n].long()
        assert len(rows) > 0, "a block inside the total holds at least one assignment"
        assert (flat[rows] == blocks.block_expert[b]).all()
    assert (blocks.block_expert[total // block_m :] == experts).all()


@pytest.mark.parametrize("on", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize(("experts", "top_k"), [(7, 3), (5, 5), (128, 8), (3, 1)])
def test_router_picks_the_largest_probabilities(on: bool, renormalize: bool, experts: int,
                                                top_k: int) -> None:
    logits = torch.randn(9, experts, generator=torch.Generator().manual_seed(experts))
    with triton_path(on):
        weights, ids = topk_softmax(logits, top_k, renormalize)
    ref_w, ref_ids = route_reference(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == logits.dtype
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=1e-7)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(9))


def identity_group(rank: int) -> TPGroup:
    """Rank ``rank`` of two whose all-reduce returns the rank's own partial sum."""
    return TPGroup(rank=rank, size=2, all_reduce=lambda x: x, all_gather=lambda x: x)


@pytest.mark.parametrize("shared", [0, 24], ids=["experts", "experts+shared"])
def test_two_ranks_partial_sums_add_up_to_the_whole_block(shared: int) -> None:
    """Each rank holds half of every expert's intermediate dimension (and of the shared
    expert's); its output is a partial sum, and one all-reduce of them is the block."""
    kw = dict(hidden_size=16, num_experts=5, top_k=2, intermediate_size=12, renormalize=True,
              shared_intermediate_size=shared, dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(1)
    shapes = {"gate.weight": (5, 16)}
    for e in range(5):
        shapes |= {f"experts.{e}.gate_proj.weight": (12, 16),
                   f"experts.{e}.up_proj.weight": (12, 16),
                   f"experts.{e}.down_proj.weight": (16, 12)}
    if shared:
        shapes |= {"shared_expert.gate_proj.weight": (shared, 16),
                   "shared_expert.up_proj.weight": (shared, 16),
                   "shared_expert.down_proj.weight": (16, shared),
                   "shared_expert_gate.weight": (1, 16)}
    checkpoint = {name: torch.randn(shape, generator=gen) * 0.3 for name, shape in shapes.items()}
    full = SparseMoeBlock(**kw)
    x = torch.randn(7, 16, generator=gen)
    outs = []
    for block in (full, SparseMoeBlock(tp=identity_group(0), **kw),
                  SparseMoeBlock(tp=identity_group(1), **kw)):
        load(block, checkpoint)
        outs.append(block(x))
    torch.testing.assert_close(outs[1] + outs[2], outs[0], **TOL)


def load(block: SparseMoeBlock, checkpoint: dict[str, torch.Tensor]) -> None:
    from kvrunner.models.weight_names import load_weights_into

    stacked = [(".gate_up_proj.", ".gate_proj.", 0), (".gate_up_proj.", ".up_proj.", 1)]
    load_weights_into(block, checkpoint.items(), stacked=stacked)


def test_the_triton_path_runs_the_kernels_not_the_torch_loop(monkeypatch) -> None:
    import kvrunner.layers.moe as moe

    def torch_loop(*args: object) -> None:
        raise AssertionError("the torch path ran")

    monkeypatch.setattr(moe, "grouped_experts_torch", torch_loop)
    gen = torch.Generator().manual_seed(0)
    r = dict(x=torch.randn(3, 16, generator=gen), w13=torch.randn(4, 32, 16, generator=gen),
             w2=torch.randn(4, 16, 16, generator=gen), weights=torch.rand(3, 2, generator=gen),
             ids=torch.tensor([[0, 1], [2, 3], [1, 0]], dtype=torch.int32))
    with triton_path(True):
        out = fused(r)(r["x"], r["weights"], r["ids"])
    torch.testing.assert_close(out, expected(r), **TOL)
    with triton_path(False), pytest.raises(AssertionError, match="the torch path ran"):
        fused(r)(r["x"], r["weights"], r["ids"])


@pytest.mark.parametrize("per_expert", [1, 6, 16, 48, 200])
def test_every_tile_configuration_computes_the_same(per_expert: int) -> None:
    """Tile sizes follow the mean rows per expert (decode: thin, prefill: square);
    each configuration the layer can pick equals the naive loop."""
    from kvrunner.layers.fused.moe_triton import grouped_experts_triton, kernel_config

    experts, top_k = 3, 2
    config = kernel_config(per_expert * experts, experts)
    gen = torch.Generator().manual_seed(per_expert)
    tokens = 37  # not a multiple of any block: partial blocks everywhere
    r = dict(x=torch.randn(tokens, 40, generator=gen),
             w13=torch.randn(experts, 2 * 24, 40, generator=gen) * 0.2,
             w2=torch.randn(experts, 40, 24, generator=gen) * 0.2,
             weights=torch.rand(tokens, top_k, generator=gen),
             ids=torch.stack([torch.randperm(experts, generator=gen)[:top_k]
                              for _ in range(tokens)]).to(torch.int32))
    blocks = align_to_blocks(r["ids"], experts, config["BLOCK_M"])
    out = grouped_experts_triton(r["x"], r["w13"], r["w2"], r["weights"], blocks, config)
    torch.testing.assert_close(out.sum(dim=1), expected(r), **TOL)
