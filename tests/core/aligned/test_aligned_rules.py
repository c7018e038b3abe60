"""Trainer-aligned mode refuses, naming the problem, what would break the bitwise
equality: an engine that is not deterministic, another tensor-parallel size, dtype
or attention backend, a model it does not cover, and trainer batches the engine
never computes. A refused ``align`` changes nothing; a refused forward leaves the
model usable."""

from __future__ import annotations

import pytest
import torch

from kvrunner.aligned import AlignmentError, align
from kvrunner.config import EngineConfig

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             max_position_embeddings=64)


def qwen3(dtype: torch.dtype = torch.float32, **changes) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen3Config(**(SHAPE | changes))
    return transformers.Qwen3ForCausalLM(config).to(dtype)


def engine(**changes) -> EngineConfig:
    return EngineConfig.load(**(dict(deterministic=True, device="cpu", dtype="float32")
                                | changes))


def untouched(model: torch.nn.Module) -> bool:
    return "forward" not in vars(model.model) and "forward" not in vars(model.lm_head)


@pytest.mark.parametrize(("config", "message"), [
    (dict(deterministic=False), "not deterministic"),
    (dict(tensor_parallel_size=2), r"tensor_parallel_size=2 .* unsharded"),
    (dict(dtype="bfloat16"), r"engine computes in torch.bfloat16 .* weights are torch.float32"),
    (dict(full_attention="flashinfer"), "attention backend is 'flashinfer'"),
], ids=["not-deterministic", "tp2", "dtype", "backend"])
def test_an_engine_that_computes_otherwise_is_refused(config, message) -> None:
    model = qwen3()
    with pytest.raises(AlignmentError, match=message):
        align(model, engine(**config))
    assert untouched(model)


@pytest.mark.parametrize(("build", "message"), [
    (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{k: v for k, v in SHAPE.items()})), "LlamaForCausalLM is not supported"),
    (lambda: qwen3(attention_dropout=0.1), "attention_dropout=0.1"),
    (lambda: qwen3(hidden_act="gelu"), "hidden_act 'gelu'"),
    (lambda: qwen3(rope_parameters={"rope_type": "linear", "factor": 2.0,
                                    "rope_theta": 10000.0}), "rope type 'linear'"),
    (lambda: qwen3(layer_types=["sliding_attention"]), "sliding_attention"),
], ids=["llama", "dropout", "gelu", "rope-scaling", "sliding"])
def test_a_model_the_aligned_forward_does_not_cover_is_refused(build, message) -> None:
    model = build()
    with pytest.raises(AlignmentError, match=message):
        align(model)
    assert untouched(model)


def test_mixed_weight_dtypes_and_gradient_checkpointing_are_refused() -> None:
    model = qwen3()
    model.lm_head.to(torch.bfloat16)
    with pytest.raises(AlignmentError, match="mix dtypes"):
        align(model)
    model = qwen3()
    model.activation_checkpointing_enable()
    with pytest.raises(AlignmentError, match="gradient checkpointing"):
        align(model)
    assert untouched(model)


def test_unknown_op_names_are_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown ops \['softmax'\]"):
        align(qwen3(), transformers_ops=["softmax"])


@pytest.mark.parametrize(("inputs", "message"), [
    (dict(attention_mask=torch.tensor([[1, 0, 1, 1]])), "one run"),
    (dict(position_ids=torch.tensor([[5, 6, 7, 8]])), "number each row's real tokens 0"),
    (dict(use_cache=True), "use_cache=True"),
    (dict(output_hidden_states=True), "output_hidden_states=True"),
], ids=["holed-mask", "positions", "cache", "hidden-states"])
def test_a_batch_the_engine_never_computes_is_refused(inputs, message) -> None:
    model = align(qwen3(), engine())
    ids = torch.tensor([[3, 4, 5, 6]])
    with pytest.raises(AlignmentError, match=message):
        model(input_ids=ids, **inputs)
    before = model(input_ids=ids).logits  # the model still works
    assert before.shape == (1, 4, SHAPE["vocab_size"])


def test_more_than_one_cpu_thread_is_refused_at_the_forward() -> None:
    model = align(qwen3(), engine())
    assert torch.get_num_threads() == 1  # align pins it, as the engine does
    torch.set_num_threads(2)
    try:
        with pytest.raises(AlignmentError, match="2 CPU threads"):
            model(input_ids=torch.tensor([[3, 4]]))
    finally:
        torch.set_num_threads(1)
