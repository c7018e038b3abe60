"""Where the FP8 KV scales come from and what they are worth: calibrated from a first
prefill, loaded from a checkpoint or a weight update (per tensor or per KV head,
vLLM's and SGLang's names), rewritten in place, kept across sleep and wake.

The kernels' use of a scale table (store divides, attention multiplies back, per head)
is held to the naive references in ``test_paged_fp8_kv.py``; here the table's life.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from paged_cases import TRITON_DEVICE
from safetensors.torch import load_file, save_file

from kvrunner import LLM, SamplingParams
from kvrunner.errors import CheckpointError, WeightUpdateError
from kvrunner.models.tiny import ensure_default_model
from kvrunner_paged.kv_format import FP8_DTYPE, K_INV, K_SCALE, V_INV, V_SCALE, scale_table
from kvrunner_paged.kv_scales import K_RANGE, MIN_SCALE, V_RANGE, KVScales
from kvrunner_paged.ops.store_kv.store_torch import store_kv_torch

HEADS, DIM = 2, 16


def _round_trip(k: torch.Tensor, table: torch.Tensor, store) -> torch.Tensor:
    """``k`` (``[tokens, HEADS, DIM]``) stored into an FP8 pool by ``store`` and read back
    as the attention entries read it: ``stored * k_scale``, per head."""
    cache = torch.zeros((1, len(k), HEADS, DIM), dtype=FP8_DTYPE)
    store(k=k, v=k, k_cache=cache, v_cache=cache.clone(), slot_mapping=torch.arange(len(k)),
          scales=table)  # fmt: skip
    return cache[0].float() * table[K_SCALE][:, None]


def _within_e4m3(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor, ulps: float) -> bool:
    """``got`` is ``want`` to ``ulps`` e4m3 steps: relative ``ulps / 8`` among the normals,
    ``ulps * 2^-9`` times the head's scale below them (e4m3 has 3 mantissa bits; its
    smallest normal is 2^-6, its subnormal step 2^-9)."""
    s = scale[:, None]
    return bool(((got - want).abs() <= (want.abs() * ulps / 8 + ulps * 2.0**-9 * s)
                 * (1 + 1e-6)).all())  # fmt: skip


def _triton_store(**kw: torch.Tensor) -> None:
    """The Triton store on its device (compiled: a GPU), the pools copied back."""
    from kvrunner_paged.ops.store_kv.store import store_kv

    on = {n: t.to(TRITON_DEVICE) for n, t in kw.items()}
    store_kv(**on)
    kw["k_cache"].copy_(on["k_cache"])


#: magnitudes past e4m3's 448: scale 1.0 saturates them
LARGE = st.sampled_from([600.0, 2000.0, 1e4])


# Triton's interpreter converts float32 to e4m3 its own way (ties away from zero, no
# subnormals, and a rounding that carries into the exponent lands a binade low: 125.9
# becomes 64, not 128), so the Triton store is shown compiled, on a GPU, where it
# rounds as torch does.
@pytest.mark.parametrize("store", [pytest.param(store_kv_torch, id="torch"),
                                   pytest.param(_triton_store, marks=pytest.mark.gpu,
                                                id="compiled")])
@given(magnitude=LARGE, seed=st.integers(0, 2**16))
def test_calibrated_scales_carry_keys_past_448(store, magnitude: float, seed: int) -> None:
    """Keys and values up to ``magnitude`` (2000 and more): calibrated from them, the
    store and the read give each back within half an e4m3 step; with the default scale
    1.0 the same check fails (they saturate at 448)."""
    gen = torch.Generator().manual_seed(seed)
    k = (torch.rand((8, HEADS, DIM), generator=gen) * 2 - 1) * magnitude
    k[0, 0, 0] = magnitude  # the largest reaches the calibration and the store
    scales = KVScales(layers=(0,), num_kv_heads=HEADS, device=torch.device("cpu"),
                      calculate=True)  # fmt: skip
    scales.calibrate(0, k, k)
    table = scales.of(0)
    assert _within_e4m3(_round_trip(k, table, store), k, table[K_SCALE], ulps=0.5)
    ones = scale_table(1.0, 1.0, HEADS)
    assert not _within_e4m3(_round_trip(k, ones, store), k, ones[K_SCALE], ulps=1.0)


@settings(max_examples=25)
@given(amax=st.floats(1e-12, 1e6), value_amax=st.floats(1e-12, 1e6))
def test_calibration_is_the_largest_magnitude_over_vllms_constants(
    amax: float, value_amax: float
) -> None:
    """``amax(|k|) / 200`` and ``amax(|v|) / 100`` (vLLM's ``K_SCALE_CONSTANT`` and
    ``V_SCALE_CONSTANT``), at least :data:`MIN_SCALE`, the same on every head, beside
    their float32 reciprocals; the layer then calibrates no more."""
    k = torch.zeros((3, HEADS, DIM))
    v = torch.zeros((3, HEADS, DIM))
    k[1, 1, 3], v[2, 0, 0] = -amax, value_amax
    scales = KVScales(layers=(0, 5), num_kv_heads=HEADS, device=torch.device("cpu"),
                      calculate=True)  # fmt: skip
    scales.calibrate(5, k, v)
    table = scales.of(5)
    want_k = max(torch.tensor(amax).float().item() / K_RANGE, MIN_SCALE)
    want_v = max(torch.tensor(value_amax).float().item() / V_RANGE, MIN_SCALE)
    torch.testing.assert_close(table[K_SCALE], torch.full((HEADS,), want_k), rtol=1e-6, atol=0)
    torch.testing.assert_close(table[V_SCALE], torch.full((HEADS,), want_v), rtol=1e-6, atol=0)
    assert torch.equal(table[K_INV], table[K_SCALE].reciprocal())
    assert torch.equal(table[V_INV], table[V_SCALE].reciprocal())
    assert scales.uncalibrated == {0}
    assert torch.equal(scales.of(0), scale_table(1.0, 1.0, HEADS))  # the other layer's


@pytest.mark.parametrize("bad", [0.0, float("nan"), float("inf")])
def test_a_first_batch_without_a_finite_positive_maximum_keeps_scale_one(bad: float) -> None:
    scales = KVScales(layers=(0,), num_kv_heads=HEADS, device=torch.device("cpu"),
                      calculate=True)  # fmt: skip
    k = torch.zeros((2, HEADS, DIM))
    k[0, 0, 0] = bad
    scales.calibrate(0, k, k)
    assert torch.equal(scales.of(0), scale_table(1.0, 1.0, HEADS))


def test_a_loaded_scale_is_written_in_place_and_refusals_change_nothing() -> None:
    """Per tensor or per head, into the same storage (a captured graph reads it by
    address); the layer no longer calibrates. A bad shape or value is refused by name,
    the table as it was."""
    scales = KVScales(layers=(3,), num_kv_heads=HEADS, device=torch.device("cpu"),
                      calculate=True)  # fmt: skip
    table, address = scales.of(3), scales.table.data_ptr()
    scales.load(3, "k", torch.tensor(0.5))
    scales.load(3, "v", torch.tensor([2.0, 4.0]))
    assert torch.equal(table, scale_table(0.5, torch.tensor([2.0, 4.0]), HEADS))
    assert scales.table.data_ptr() == address and scales.uncalibrated == set()
    before = table.clone()
    for which, bad, message in (("k", torch.ones(3), "one number or one per KV head"),
                                ("v", torch.tensor([1.0, -1.0]), "positive and finite"),
                                ("v", torch.tensor(float("nan")), "positive and finite"),
                                ("q", torch.tensor(1.0), "'k' or 'v'")):
        with pytest.raises(ValueError, match=message):
            scales.load(3, which, bad)
    assert torch.equal(table, before)


# -- through an engine --------------------------------------------------------------

SETTINGS = dict(device="cpu", max_num_seqs=4, block_size=8, num_blocks=32, kv_cache_dtype="fp8")
PROMPTS = [list(range(3, 30)), [5, 6, 7]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _paged(llm: LLM):
    return llm.runner.backends.pm.get_plugin("paged")


def _checkpoint(tmp_path: Path, extra: dict[str, torch.Tensor]) -> Path:
    """tiny-qwen3 with ``extra`` tensors in its safetensors file."""
    dest = tmp_path / "model"
    shutil.copytree(ensure_default_model("tiny-qwen3"), dest)
    tensors = load_file(dest / "model.safetensors")
    save_file({**tensors, **extra}, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def test_a_checkpoints_scales_set_the_tables_and_calibration_leaves_them(tmp_path: Path) -> None:
    """compressed-tensors' ``k_proj.output_scale`` (per tensor, float32 as stored, not
    cast to the model's bf16) and vLLM's ``self_attn.v_scale`` per KV head set layer 0's
    table; ``calculate_kv_scales`` leaves that layer alone and calibrates layer 1, which
    the checkpoint gives none, from the first prefill."""
    path = _checkpoint(tmp_path, {
        "model.layers.0.self_attn.k_proj.output_scale": torch.tensor([0.0123]),
        "model.layers.0.self_attn.v_scale": torch.tensor([0.5, 0.25]),
    })  # fmt: skip
    loaded = scale_table(0.0123, torch.tensor([0.5, 0.25]), HEADS)
    with LLM(str(path), calculate_kv_scales=True, dtype="bfloat16", **SETTINGS) as llm:
        scales = _paged(llm).scales
        assert torch.equal(scales.of(0), loaded)
        assert scales.uncalibrated == {1}
        llm.generate(PROMPTS, GREEDY)
        assert torch.equal(scales.of(0), loaded)
        assert scales.uncalibrated == set()
        assert (scales.of(1) != 1.0).all()


def test_without_calculate_kv_scales_the_scales_stay_one() -> None:
    with LLM("tiny-qwen3", **SETTINGS) as llm:
        llm.generate(PROMPTS, GREEDY)
        ones = scale_table(1.0, 1.0, HEADS).expand(2, 4, HEADS)
        assert torch.equal(_paged(llm).scales.table, ones)


def test_an_update_rewrites_scales_in_place_and_a_sleep_keeps_them() -> None:
    """A weight update carrying scales (the older single ``kv_scale`` sets both) rewrites
    the table where it is; the tokens follow the new scales; a sleep that discards the
    weights, a wake and a push without scales leave them."""
    with LLM("tiny-qwen3", calculate_kv_scales=True, **SETTINGS) as llm:
        first = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        table = _paged(llm).scales.table
        address, calibrated = table.data_ptr(), table.clone()
        assert not torch.equal(calibrated, scale_table(1.0, 1.0, HEADS).expand(2, 4, HEADS))
        llm.update_weights([("model.layers.1.self_attn.kv_scale", torch.tensor(0.04))])
        assert table.data_ptr() == address
        assert torch.equal(table[0], calibrated[0])
        assert torch.equal(table[1], scale_table(0.04, 0.04, HEADS))
        updated = table.clone()
        llm.sleep(level=2, discard_weights=True)
        llm.wake_up(["weights"])
        llm.update_weights(list(load_file(ensure_default_model("tiny-qwen3")
                                          / "model.safetensors").items()))
        llm.wake_up(["kv_cache"])
        assert torch.equal(_paged(llm).scales.table, updated)
        assert _paged(llm).scales.table.data_ptr() == address
        again = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert len(again) == len(first)


def test_bad_scales_in_an_update_are_refused_by_name_loading_nothing() -> None:
    """A per-head scale of the wrong length, a name given twice (``kv_scale`` covers
    ``k_scale``): refused before anything loads, naming the tensor; a scale that is not
    positive is refused naming it too."""
    with LLM("tiny-qwen3", **SETTINGS) as llm:
        table = _paged(llm).scales.table
        before = table.clone()
        with pytest.raises(WeightUpdateError, match=r"model.layers.0.self_attn.k_scale.*shape"):
            llm.update_weights([("model.layers.0.self_attn.v_scale", torch.tensor(0.5)),
                                ("model.layers.0.self_attn.k_scale", torch.ones(3))])
        with pytest.raises(WeightUpdateError, match="given twice"):
            llm.update_weights([("model.layers.0.self_attn.kv_scale", torch.tensor(0.5)),
                                ("model.layers.0.self_attn.k_scale", torch.tensor(0.5))])
        assert torch.equal(table, before)
        with pytest.raises(WeightUpdateError, match=r"v_scale.*positive and finite"):
            llm.update_weights([("model.layers.1.self_attn.v_scale", torch.tensor(-2.0))])
        assert torch.equal(table, before)


def test_a_checkpoint_scale_of_the_wrong_shape_is_refused_at_start(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, {"model.layers.0.self_attn.k_scale": torch.ones(2, 2)})
    with pytest.raises(CheckpointError, match=r"model.layers.0.self_attn.k_scale"):
        LLM(str(path), **SETTINGS)


def test_auto_kv_cache_takes_a_checkpoints_scales_and_ignores_them(tmp_path: Path) -> None:
    """As vLLM under ``kv_cache_dtype = "auto"``: the names load, the tokens are those of
    the checkpoint without them."""
    path = _checkpoint(tmp_path, {"model.layers.0.self_attn.k_scale": torch.tensor(0.01)})
    auto = {**SETTINGS, "kv_cache_dtype": "auto"}
    with LLM(str(path), **auto) as llm:
        scaled = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    with LLM("tiny-qwen3", **auto) as llm:
        plain = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert scaled == plain


@pytest.mark.gpu
def test_a_captured_decode_replays_with_scales_rewritten_after_capture() -> None:
    """A decode graph captured under one scale table replays with whatever the table
    holds: after an update of every layer's scales, replayed tokens equal the tokens of
    an eager engine given the same scales."""
    scales = [(f"model.layers.{i}.self_attn.{w}_scale", torch.tensor(s))
              for i in range(2) for w, s in (("k", 0.02), ("v", 0.03))]
    runs = []
    for eager in (False, True):
        with LLM("tiny-qwen3", device="cuda", max_num_seqs=4, block_size=8, num_blocks=64,
                 kv_cache_dtype="fp8", enforce_eager=eager) as llm:  # fmt: skip
            llm.generate(PROMPTS, GREEDY)  # the graphs serve under scale 1.0 first
            llm.update_weights(scales)
            runs.append([o.token_ids for o in llm.generate(PROMPTS, GREEDY)])
    assert runs[0] == runs[1]


def test_the_layers_quantize_and_read_by_their_tables() -> None:
    """Scales of 1/1000 saturate the tiny model's keys and values at ±0.448: the greedy
    tokens leave those of scale 1.0, and come back when the scales are set to 1.0 again
    (the layers read the table a push rewrites, and nothing else)."""
    tiny = [(f"model.layers.{i}.self_attn.{w}_scale", torch.tensor(1e-3))
            for i in range(2) for w in "kv"]
    one = [(name, torch.tensor(1.0)) for name, _ in tiny]
    with LLM("tiny-qwen3", enable_prefix_caching=False, **SETTINGS) as llm:
        plain = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        llm.update_weights(tiny)
        saturated = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        llm.update_weights(one)
        again = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert saturated != plain
    assert again == plain


@pytest.mark.gpu
def test_the_start_up_profile_calibrates_nothing() -> None:
    """On CUDA the engine runs a maximal prefill of placeholder tokens to measure its
    activation peak (``StepMetadata.is_profile``): no layer learns its scales from it."""
    with LLM("tiny-qwen3", device="cuda", max_num_seqs=4, block_size=8, num_blocks=64,
             kv_cache_dtype="fp8", calculate_kv_scales=True) as llm:  # fmt: skip
        scales = _paged(llm).scales
        assert scales.uncalibrated == {0, 1}
        assert torch.equal(scales.table.cpu(), scale_table(1.0, 1.0, HEADS).expand(2, 4, HEADS))
        llm.generate(PROMPTS, GREEDY)
        assert scales.uncalibrated == set()
