"""The one-pass sampling kernel (Triton; under the interpreter without a GPU): its draw
is the torch path's ``argmax(logits / T + G)`` with the same seeded noise, and the
sampler hands it exactly the rows it can serve."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvrunner.config import KernelsConfig
from kvrunner.engine.step_io import SamplingColumns
from kvrunner.layers.fused.dispatch import kernels_chosen
from kvrunner.layers.fused.gumbel_argmax_triton import gumbel_argmax, gumbel_argmax_into_
from kvrunner.layers.fused.seeded_uniform_triton import seeded_uniform_
from kvrunner.layers.sampler import sample
from kvrunner.layers.sampling_draw import use_fused_draw
from kvrunner.sampling_params import SamplingParams

pytest.importorskip("triton")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def torch_scores(logits, rows, temps, seeds, counts) -> torch.Tensor:
    """The torch path's perturbed scores for ``rows``: the same noise, its own logs."""
    dev = logits.device
    u = seeded_uniform_(torch.empty(len(rows), logits.shape[1], device=dev),
                        torch.arange(len(rows), device=dev), seeds.to(dev), counts.to(dev))
    eps = torch.finfo(torch.float32).eps
    u.clamp_(min=torch.finfo(torch.float32).tiny, max=1.0 - eps)
    return logits[rows] / temps[:, None] - torch.log(-torch.log(u))


@given(rows=st.integers(1, 5), vocab=st.integers(1, 5000), dtype=st.sampled_from(DTYPES),
       data=st.data())
def test_the_kernel_draws_the_torch_paths_token(rows, vocab, dtype, data) -> None:
    """Same token wherever the best score leads the next by more than rounding; at a
    closer call, a token whose score is within rounding of the best."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    logits = (torch.randn(rows + 2, vocab, generator=gen) * data.draw(st.sampled_from([1, 8])))
    logits = logits.to(dtype)
    pick = torch.tensor(data.draw(st.permutations(range(rows + 2)))[:rows])
    temps = torch.tensor(data.draw(st.lists(st.floats(0.05, 3.0), min_size=rows,
                                            max_size=rows)), dtype=torch.float32)
    seeds = torch.tensor(data.draw(st.lists(st.integers(-(2**62), 2**62), min_size=rows,
                                            max_size=rows)))
    counts = torch.tensor(data.draw(st.lists(st.integers(0, 10**5), min_size=rows,
                                             max_size=rows)))
    assert_draws_the_torch_paths_token(logits, pick, temps, seeds, counts)


def assert_draws_the_torch_paths_token(logits, pick, temps, seeds, counts) -> None:
    drawn = gumbel_argmax(logits, pick, temps, seeds, counts)
    scores = torch_scores(logits.float(), pick, temps, seeds, counts).cpu()
    drawn, vocab = drawn.cpu(), logits.shape[1]
    assert drawn.dtype == torch.int64 and ((drawn >= 0) & (drawn < vocab)).all()
    for i in range(len(pick)):
        best = scores[i].max()
        close = 1e-5 * max(1.0, float(best.abs()))
        top2 = scores[i].topk(min(2, vocab)).values
        if vocab == 1 or top2[0] - top2[1] > close:
            assert drawn[i] == scores[i].argmax(), f"row {i}"
        else:
            assert scores[i][drawn[i]] >= best - close, f"row {i}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "vocab"), [(1, 151_936), (64, 151_936), (5, 4099)])
def test_on_the_gpu_the_kernel_draws_the_torch_paths_token(rows, vocab, dtype) -> None:
    """Compiled for the chip, at a real vocabulary: the same draws as the torch path."""
    gen = torch.Generator(device="cuda").manual_seed(rows * vocab)
    logits = (torch.randn(rows + 1, vocab, device="cuda", generator=gen) * 3).to(dtype)
    pick = torch.arange(rows, 0, -1, device="cuda")  # not in order, skipping row 0
    temps = torch.linspace(0.3, 1.7, rows, device="cuda")
    seeds = torch.arange(rows, device="cuda") * 7919 - 2**40
    counts = torch.arange(rows, device="cuda") * 131
    assert_draws_the_torch_paths_token(logits, pick, temps, seeds, counts)


@given(rows=st.integers(1, 6), vocab=st.integers(1, 3000), dtype=st.sampled_from(DTYPES),
       data=st.data())
def test_in_place_rows_at_temperature_zero_keep_their_token_and_the_rest_draw(
    rows, vocab, dtype, data
) -> None:
    """The decode graph's form: row ``i`` of the logits, drawn where its temperature is
    above 0 (the row kernel's token, bit for bit), left as it was at 0."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    logits = (torch.randn(rows + 1, vocab, generator=gen) * 3).to(dtype)  # one row unread
    temps = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 0.3, 1.0, 2.5]),
                                            min_size=rows, max_size=rows)))
    seeds = torch.tensor(data.draw(st.lists(st.integers(-(2**62), 2**62), min_size=rows,
                                            max_size=rows)))
    counts = torch.randint(0, 10**5, (rows,), generator=gen)
    before = torch.full((rows,), -7)  # not a column: a row that drew shows
    tokens = gumbel_argmax_into_(before.clone(), logits, temps, seeds, counts)
    drawing = temps > 0
    assert tokens[~drawing].tolist() == before[~drawing].tolist()
    rows_drawn = torch.arange(rows)[drawing]
    assert tokens[drawing].tolist() == gumbel_argmax(
        logits, rows_drawn, temps[drawing], seeds[drawing], counts[drawing]).tolist()


@given(rows=st.integers(1, 4), vocab=st.integers(1, 9000), splits=st.integers(2, 6),
       dtype=st.sampled_from(DTYPES), in_place=st.booleans(), data=st.data())
def test_cutting_the_vocabulary_into_slices_draws_the_same_tokens(
    rows, vocab, splits, dtype, in_place, data
) -> None:
    """A row's draw over several slices, reduced, is the one-slice draw bit for bit:
    the whole row's first maximum, also where half the row is -inf, where every
    logit is (column 0), or where one column is finite (that column, wherever the
    slices meet)."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    logits = torch.randn(rows, vocab, generator=gen) * 3
    shape = data.draw(st.sampled_from(["plain", "half -inf", "one finite column", "all -inf"]))
    only = None
    if shape == "half -inf":
        logits[:, vocab // 2:] = float("-inf")
    elif shape == "one finite column":  # often at a tile's edge, where slices meet
        edges = [c for c in (2047, 2048, 4095, 4096, 6143, 6144) if c < vocab]
        only = data.draw(st.sampled_from(edges) if edges and data.draw(st.booleans())
                         else st.integers(0, vocab - 1))
        logits[:, :only] = float("-inf")
        logits[:, only + 1:] = float("-inf")
    elif shape == "all -inf":
        logits[:] = float("-inf")
    logits = logits.to(dtype)
    temps = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]),
                                            min_size=rows, max_size=rows)))
    if not in_place:
        temps = temps.clamp(min=0.25)
    seeds = torch.tensor(data.draw(st.lists(st.integers(-(2**62), 2**62), min_size=rows,
                                            max_size=rows)))
    counts = torch.randint(0, 10**5, (rows,), generator=gen)
    if in_place:
        def draw(k):
            return gumbel_argmax_into_(torch.full((rows,), -7), logits, temps, seeds, counts,
                                       splits=k)
    else:
        pick = torch.arange(rows - 1, -1, -1)

        def draw(k):
            return gumbel_argmax(logits, pick, temps, seeds, counts, splits=k)
    assert draw(splits).tolist() == draw(1).tolist()
    if only is not None:
        assert set(draw(splits)[temps > 0].tolist()) <= {only}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_on_the_gpu_the_sliced_draw_is_the_one_slice_draw(rows) -> None:
    """Compiled, at a real vocabulary, with the slices the chip's size chooses."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    logits = (torch.randn(rows, 151_936, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    pick = torch.arange(rows, device="cuda")
    temps = torch.linspace(0.3, 1.7, rows, device="cuda")
    seeds, counts = pick * 7919 - 2**40, pick * 131
    assert torch.equal(gumbel_argmax(logits, pick, temps, seeds, counts),
                       gumbel_argmax(logits, pick, temps, seeds, counts, splits=1))
    tokens = logits.float().argmax(dim=-1)
    greedy_too = temps.masked_fill(pick % 2 == 0, 0.0)  # the graph's in-place form
    assert torch.equal(
        gumbel_argmax_into_(tokens.clone(), logits, greedy_too, seeds, counts),
        gumbel_argmax_into_(tokens.clone(), logits, greedy_too, seeds, counts, splits=1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_decode_bucket_shares_one_compile_of_each_draw_kernel() -> None:
    """The slice count differs from bucket to bucket (75 at one row, 5 at 64, ...) but
    is a runtime argument: drawing at every size a decode graph is captured at adds
    one compile of the one-slice kernel, one of the sliced kernel and one of its
    reduce, not one per bucket (a capture on a cold cache paid each)."""
    from kvrunner.layers.fused import gumbel_argmax_triton as kernels

    vocab = 151_936 - 64  # a width no other test compiles for
    logits = torch.randn(320, vocab, device="cuda").to(torch.bfloat16)

    def compiled(kernel) -> int:
        caches = getattr(kernel, "device_caches", None)
        if caches is None:
            pytest.skip("this Triton keeps no per-device kernel cache to count")
        return sum(len(cache[0]) for cache in caches.values())

    kernel_fns = (kernels._gumbel_argmax_kernel, kernels._first_max_of_splits_kernel)
    for kernel in kernel_fns:  # forget what earlier tests compiled (it reloads from disk)
        for cache in kernel.device_caches.values():
            cache[0].clear()
            cache[1].clear()
    before = [compiled(k) for k in kernel_fns]
    sizes = [1, 2, 4, 8, *range(16, 257, 16), 320]  # 320 rows fill the chip: one slice
    assert len({kernels.vocab_splits(b, vocab, logits.device) for b in sizes}) > 4
    for b in sizes:
        tokens = logits[:b].float().argmax(dim=-1)
        pick = torch.arange(b, device="cuda")
        kernels.gumbel_argmax_into_(tokens, logits[:b], torch.ones(b, device="cuda"),
                                    pick, pick)  # fmt: skip
    torch.cuda.synchronize()
    added = [compiled(k) - n for k, n in zip(kernel_fns, before, strict=True)]
    assert added == [2, 1], f"compiles added per kernel: {added}"


def test_a_lone_finite_column_is_drawn_wherever_the_slices_meet() -> None:
    """Every column on either side of every slice edge belongs to exactly one slice: a
    row finite only there draws it, for 1-4 slices of a 6,145-column row."""
    edges = [0, 2047, 2048, 4095, 4096, 6143, 6144]
    logits = torch.full((len(edges), 6145), float("-inf"))
    for row, col in enumerate(edges):
        logits[row, col] = 0.0
    n = len(edges)
    temps, seeds, counts = torch.ones(n), torch.arange(n), torch.zeros(n, dtype=torch.int64)
    for splits in (1, 2, 3, 4):
        assert gumbel_argmax(logits, torch.arange(n), temps, seeds, counts,
                             splits=splits).tolist() == edges, f"{splits} slices"


def test_a_tie_takes_the_first_column_as_argmax_does() -> None:
    """Noise differs per column, so equal scores come from equal logits at -inf: a row
    masked over several tiles draws column 0, as torch's argmax does, and a row with
    one finite column draws that column wherever its tile is."""
    logits = torch.full((2, 5000), float("-inf"))
    logits[1, 4099] = 0.0
    rows, seeds, counts, temps = (torch.tensor(v) for v in ([0, 1], [3, 3], [4, 4], [1.0, 1.0]))
    scores = torch_scores(logits, rows, temps, seeds, counts)
    drawn = gumbel_argmax(logits, rows, temps, seeds, counts)
    assert drawn.tolist() == scores.argmax(dim=-1).tolist() == [0, 4099]


def test_no_rows_draw_nothing() -> None:
    empty = torch.empty(0, dtype=torch.int64)
    out = gumbel_argmax(torch.zeros(3, 10), empty, torch.empty(0), empty, empty)
    assert out.shape == (0,)


@pytest.fixture
def switches():
    with contextlib.ExitStack() as stack:
        def set_(fused: bool, triton: bool = True) -> None:
            stack.enter_context(kernels_chosen(fused_sampler=fused, triton_on_cpu=triton))

        yield set_


def test_the_kernel_serves_seeded_unfiltered_rows_unless_switched_off(switches) -> None:
    logits = torch.zeros(2, 50)
    rows = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.5, seed=2)]
    seeded = SamplingColumns.of(rows)
    switches(fused=True)
    assert use_fused_draw(logits, seeded)
    switches(fused=KernelsConfig().fused_sampler)
    assert use_fused_draw(logits, seeded)  # the default, on the Triton path
    assert use_fused_draw(logits,
                          SamplingColumns.of([SamplingParams(temperature=1.0, seed=1, top_k=50)]))
    for other in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, seed=1, top_k=5),
                  SamplingParams(temperature=1.0, seed=1, top_p=0.9)):
        assert not use_fused_draw(logits, SamplingColumns.of([rows[0], other])), other
    switches(fused=False)
    assert not use_fused_draw(logits, seeded)
    switches(fused=True, triton=False)
    assert not use_fused_draw(logits, seeded)


@given(st.integers(1, 6), st.integers(2, 300), st.integers(0, 2**31))
def test_the_sampler_with_the_kernel_draws_the_torch_paths_tokens(rows, vocab, seed) -> None:
    """Through ``sample``: a batch of seeded rows (some greedy among them) takes the same
    tokens with the kernel as without it, where no row is a close call."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 4
    params = [SamplingParams(temperature=0.0 if i % 3 == 2 else 0.7, seed=seed + i, logprobs=1)
              for i in range(rows)]
    counts = [seed % 97 + i for i in range(rows)]
    with kernels_chosen(triton_on_cpu=True, fused_sampler=True):
        fused = sample(logits, params, counts)
    with kernels_chosen(triton_on_cpu=True, fused_sampler=False):
        plain = sample(logits, params, counts)
    drawing = [i for i, p in enumerate(params) if p.temperature]
    scores = torch_scores(logits, torch.tensor(drawing), torch.full((len(drawing),), 0.7),
                          torch.tensor([seed + i for i in drawing]),
                          torch.tensor([counts[i] for i in drawing])) if drawing else None
    for j, i in enumerate(drawing):
        top2 = scores[j].topk(2).values
        if top2[0] - top2[1] > 1e-5 * max(1.0, float(top2[0].abs())):
            assert fused.token_ids[i] == plain.token_ids[i], f"row {i}"
    greedy = [i for i, p in enumerate(params) if not p.temperature]
    assert torch.equal(fused.token_ids[greedy], plain.token_ids[greedy])
    # logprobs are of the drawn token, from the same raw log_softmax
    assert torch.allclose(fused.logprobs, torch.log_softmax(logits, -1).gather(
        1, fused.token_ids[:, None]).squeeze(1))
