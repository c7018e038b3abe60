"""An engine serving a Qwen3-MoE with FP8 experts on the CPU: what it loads, what a push
writes, what the checksum covers.

The tiny checkpoint (``qwen3-moe-blocks``: 4 experts of 256, top-2, hidden 128) is
stored as Qwen's FP8 MoE checkpoints are: each expert projection in e4m3 beside its
``weight_scale_inv``, the router in float. On the CPU the experts multiply their
dequantized weights, so an FP8 engine must answer exactly as an engine holding the
dequantized weights; a float checkpoint or push quantized as it loads must give the
FP8 checkpoint's very bytes, into the same storages, the same bytes twice.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvrunner import LLM
from kvrunner.errors import ConfigError
from kvrunner.models.loader import iter_safetensors
from kvrunner.models.tiny import write_tiny_checkpoint
from kvrunner.models.tiny_fp8 import write_dequantized_checkpoint, write_fp8_checkpoint

from .engine_kit import answers, fp8_state, pointers, same

SETTINGS = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96, block_size=4,
                capture_sizes=(1, 2, 4), cpu_cache_bytes=4 << 20)
EXPERT = "model.layers.0.mlp.experts.1"


def bf16_exact(src: Path, dst: Path) -> Path:
    """``src`` with every tensor rounded to bf16 (kept float32): a bf16 push of it holds
    the very values the checkpoint holds, so both quantize to the same bytes."""
    dst.mkdir(parents=True)
    for file in src.iterdir():
        if file.name != "model.safetensors":
            (dst / file.name).write_bytes(file.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    save_file({n: t.to(torch.bfloat16).float() for n, t in tensors.items()},
              str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fp8moe")
    float_a = bf16_exact(write_tiny_checkpoint(root / "a0", kind="qwen3-moe-blocks", seed=0),
                         root / "a")
    float_b = write_tiny_checkpoint(root / "b", kind="qwen3-moe-blocks", seed=1)
    fp8_a = write_fp8_checkpoint(float_a, root / "a8")
    return {"float_a": str(float_a), "float_b": str(float_b), "fp8_a": str(fp8_a),
            "dequant_a": str(write_dequantized_checkpoint(fp8_a, root / "a_dq"))}


def test_the_checkpoint_stores_each_expert_projection_in_fp8_and_the_router_as_it_was(
        ckpts) -> None:
    tensors = load_file(str(Path(ckpts["fp8_a"]) / "model.safetensors"))
    assert tensors[f"{EXPERT}.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors[f"{EXPERT}.down_proj.weight_scale_inv"].shape == (1, 2)
    assert tensors["model.layers.0.mlp.gate.weight"].dtype == torch.float32


def test_an_fp8_moe_checkpoint_answers_as_its_dequantized_weights_exactly(ckpts) -> None:
    fp8 = LLM(model=ckpts["fp8_a"], **SETTINGS)
    assert fp8.runner.quantization == "fp8"
    params = dict(fp8.runner.model.named_parameters())
    assert params["model.layers.0.mlp.experts.w13"].dtype == torch.float8_e4m3fn
    assert params["model.layers.0.mlp.experts.w2_scale_inv"].shape == (4, 1, 2)
    assert params["model.layers.0.mlp.gate.weight"].dtype == torch.float32  # the router
    assert answers(fp8) == answers(LLM(model=ckpts["dequant_a"], **SETTINGS))


def test_the_fp8_checkpoint_and_its_weights_pushed_in_bf16_give_the_same_bytes_and_tokens(
        ckpts) -> None:
    stored = LLM(model=ckpts["fp8_a"], **SETTINGS)
    pushed = LLM(model=ckpts["float_b"], quantization="fp8", **SETTINGS)
    before = pointers(pushed)
    push = dict(iter_safetensors(Path(ckpts["float_a"]), torch.bfloat16))
    pushed.update_weights(push)
    first = fp8_state(pushed)
    assert same(first, fp8_state(stored))
    assert answers(pushed) == answers(stored)
    pushed.update_weights(push)  # the same push twice: the same bytes, the same storages
    assert same(fp8_state(pushed), first)
    assert pointers(pushed) == before
    quantized_on_load = LLM(model=ckpts["float_a"], quantization="fp8", **SETTINGS)
    assert same(fp8_state(quantized_on_load), first)


def test_sleep_with_discarded_weights_then_a_quantizing_push_restores_service(ckpts) -> None:
    llm = LLM(model=ckpts["float_b"], quantization="fp8", **SETTINGS)
    expected = answers(LLM(model=ckpts["fp8_a"], **SETTINGS))
    llm.sleep(2, discard_weights=True)
    llm.wake_up(["weights"])
    llm.update_weights(iter_safetensors(Path(ckpts["float_a"]), torch.bfloat16))
    llm.wake_up(["kv_cache"])
    assert answers(llm) == expected


def test_the_checksum_covers_the_experts_fp8_bytes_and_scales(ckpts) -> None:
    llm = LLM(model=ckpts["float_a"], quantization="fp8", **SETTINGS)
    first = llm.weights_checksum()
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert f"{EXPERT}.{proj}.weight_scale_inv" in first
    assert first == LLM(model=ckpts["fp8_a"], **SETTINGS).weights_checksum()
    params = dict(llm.runner.model.named_parameters())
    with torch.no_grad():
        # expert 1's up half starts at row 256 of w13, its scales at block row 2
        params["model.layers.0.mlp.experts.w13_scale_inv"][1, 2, 0] *= 2
        bytes_ = params["model.layers.0.mlp.experts.w2"].view(torch.uint8)
        bytes_[1, 5, 7] ^= 1
    changed = llm.weights_checksum()
    assert sorted(n for n in first if first[n] != changed[n]) == [
        f"{EXPERT}.down_proj.weight", f"{EXPERT}.up_proj.weight_scale_inv"]


def test_deterministic_mode_still_refuses_fp8_experts(ckpts) -> None:
    with pytest.raises(ConfigError, match="deterministic=True with quantization='fp8'"):
        LLM(model=ckpts["fp8_a"], deterministic=True, **SETTINGS)


def test_a_refused_deterministic_fp8_engine_leaves_the_process_choices_as_they_were(
        ckpts) -> None:
    """The refusal comes before the engine sets the process's layer choices: the layers
    built afterwards outside any engine take their default products."""
    from kvrunner.layers.fused.dispatch import batch_invariant

    assert not batch_invariant()
    with pytest.raises(ConfigError):
        LLM(model=ckpts["fp8_a"], deterministic=True, **SETTINGS)
    assert not batch_invariant()
