"""An engine with FP8 weights on the CPU: what it loads, what a push writes, what it refuses.

On the CPU the FP8 product dequantizes the weight and multiplies, so an FP8 engine
must give exactly the tokens and logprobs of an engine holding the dequantized
weights; a bf16 (here float32) checkpoint or push quantized as it loads must give
the FP8 checkpoint's very bytes; a push rewrites the same storages (captured graphs
stay valid) and the same push twice writes the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvrunner import LLM
from kvrunner.errors import ConfigError, WeightUpdateError
from kvrunner.models.loader import iter_safetensors
from kvrunner.models.tiny import write_tiny_checkpoint
from kvrunner.models.tiny_fp8 import write_dequantized_checkpoint, write_fp8_checkpoint

from .engine_kit import answers, fp8_state, pointers, same

SETTINGS = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96, block_size=4,
                capture_sizes=(1, 2, 4), cpu_cache_bytes=4 << 20)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fp8")
    float_a = write_tiny_checkpoint(root / "a", kind="qwen3-blocks", seed=0)
    float_b = write_tiny_checkpoint(root / "b", kind="qwen3-blocks", seed=1)
    fp8_a = write_fp8_checkpoint(float_a, root / "a8")
    return {"float_a": str(float_a), "float_b": str(float_b), "fp8_a": str(fp8_a),
            "fp8_b": str(write_fp8_checkpoint(float_b, root / "b8")),
            "dequant_a": str(write_dequantized_checkpoint(fp8_a, root / "a_dq"))}


def test_an_fp8_checkpoint_answers_as_its_dequantized_weights_exactly(ckpts) -> None:
    fp8 = LLM(model=ckpts["fp8_a"], **SETTINGS)
    assert fp8.runner.quantization == "fp8"
    assert fp8_state(fp8), "the projections hold FP8 weights"
    assert answers(fp8) == answers(LLM(model=ckpts["dequant_a"], **SETTINGS))


def test_a_float_checkpoint_quantized_on_load_holds_the_fp8_checkpoints_bytes(ckpts) -> None:
    stored = LLM(model=ckpts["fp8_a"], **SETTINGS)
    quantized = LLM(model=ckpts["float_a"], quantization="fp8", **SETTINGS)
    assert same(fp8_state(stored), fp8_state(quantized))
    assert answers(stored) == answers(quantized)


def test_a_quantizing_push_rewrites_the_same_storages_with_the_same_bytes_twice(ckpts) -> None:
    llm = LLM(model=ckpts["fp8_a"], **SETTINGS)
    before = pointers(llm)
    push = dict(iter_safetensors(Path(ckpts["float_b"]), torch.bfloat16))
    llm.update_weights(push)
    first = fp8_state(llm)
    assert pointers(llm) == before
    llm.update_weights(push)
    assert same(fp8_state(llm), first)
    assert pointers(llm) == before
    # a push of the FP8 form (bytes and scales) loads as it is
    target = LLM(model=ckpts["fp8_a"], **SETTINGS)
    target.update_weights(dict(iter_safetensors(Path(ckpts["fp8_b"]), torch.float32)))
    reference = LLM(model=ckpts["fp8_b"], **SETTINGS)
    assert same(fp8_state(target), fp8_state(reference))
    assert answers(target) == answers(reference)


def test_sleep_with_discarded_weights_then_a_quantizing_push_restores_service(ckpts) -> None:
    llm = LLM(model=ckpts["fp8_a"], **SETTINGS)
    expected = answers(LLM(model=ckpts["fp8_b"], **SETTINGS))
    llm.sleep(2, discard_weights=True)
    llm.wake_up(["weights"])
    llm.update_weights(iter_safetensors(Path(ckpts["float_b"]), torch.float32))
    llm.wake_up(["kv_cache"])  # the graphs are recaptured on the new storages
    assert answers(llm) == expected


def test_the_checksum_covers_the_quantized_bytes_and_the_scales(ckpts) -> None:
    llm = LLM(model=ckpts["float_a"], quantization="fp8", **SETTINGS)
    first = llm.weights_checksum()
    scale_names = [n for n in first if n.endswith("weight_scale_inv")]
    assert "model.layers.0.self_attn.q_proj.weight_scale_inv" in scale_names
    stored = LLM(model=ckpts["fp8_a"], **SETTINGS).weights_checksum()
    assert first == stored  # the same bytes and scales, whichever way they came
    with torch.no_grad():
        scale = dict(llm.runner.model.named_parameters())[
            "model.layers.0.self_attn.qkv_proj.weight_scale_inv"]
        scale[0, 0] *= 2
    changed = llm.weights_checksum()
    assert [n for n in first if first[n] != changed[n]] == [
        "model.layers.0.self_attn.q_proj.weight_scale_inv"]


def test_refusals_name_the_problem(ckpts, tmp_path) -> None:
    with pytest.raises(ConfigError, match="quantization='none' cannot load"):
        LLM(model=ckpts["fp8_a"], quantization="none", **SETTINGS)
    with pytest.raises(ConfigError, match="deterministic=True with quantization='fp8'"):
        LLM(model=ckpts["fp8_a"], deterministic=True, **SETTINGS)
    misaligned = write_tiny_checkpoint(tmp_path / "tiny", kind="qwen3")
    with pytest.raises(ConfigError, match="multiple of 128"):
        LLM(model=str(misaligned), quantization="fp8", **SETTINGS)
    odd = write_tiny_checkpoint(tmp_path / "odd", kind="qwen3-blocks")
    config = json.loads((odd / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [64, 64]}
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="weight_block_size"):
        LLM(model=str(odd), **SETTINGS)
    plain = LLM(model=ckpts["float_a"], **SETTINGS)
    fp8_tensors = dict(iter_safetensors(Path(ckpts["fp8_a"]), torch.float32))
    name = "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(WeightUpdateError, match="FP8 .* loads only into FP8 weights"):
        plain.update_weights({name: fp8_tensors[name]})


def test_an_fp8_tensor_without_its_scales_in_an_update_known_up_front_is_refused_first(
    ckpts, tmp_path
) -> None:
    """FP8 bytes mean nothing without their block scales: a push (list or Mapping) or a
    checkpoint that gives an FP8 weight's tensor but not its ``weight_scale_inv`` is
    refused naming both before anything loads, even a good tensor given before it."""
    import shutil

    from safetensors.torch import load_file, save_file

    from kvrunner.errors import CheckpointError

    llm = LLM(model=ckpts["fp8_a"], **SETTINGS)
    before, state = answers(llm), fp8_state(llm)
    b = dict(iter_safetensors(Path(ckpts["fp8_b"]), torch.float32))
    name = "model.layers.0.mlp.down_proj.weight"
    scale = f"{name}_scale_inv"
    good = "model.layers.0.self_attn.q_proj"
    pushes = [[(f"{good}.weight", b[f"{good}.weight"]), (f"{good}.weight_scale_inv",
                                                         b[f"{good}.weight_scale_inv"]),
               (name, b[name])],
              {name: b[name]}]
    for push in pushes:
        with pytest.raises(WeightUpdateError, match=rf"FP8 tensor '{name}' comes without its "
                                                    rf"block scales '{scale}'"):
            llm.update_weights(push)
        assert llm.cache_info().weights == "resident"
        assert same(fp8_state(llm), state)
    lacking = tmp_path / "b8_no_scale"
    shutil.copytree(ckpts["fp8_b"], lacking)
    for file in lacking.glob("*.safetensors"):
        tensors = load_file(file)
        if scale in tensors:
            del tensors[scale]
            save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"FP8 tensor '{name}' comes without its "
                                              rf"block scales '{scale}'"):
        llm.load_weights(lacking)
    assert same(fp8_state(llm), state)
    assert [t for t, _ in answers(llm)] == [t for t, _ in before]
    # with its scales beside it, the same tensor loads
    assert llm.update_weights({name: b[name], scale: b[scale]}) == 2
    llm.shutdown()
