"""A refused update of a Qwen3-8B-shaped model leaves the old weights serving on the GPU.

The engine holds the 8B shape's 16 GB of bf16 weights on CUDA with its graphs
captured; the trainer's push is a full update of CUDA tensors (a list: a
transaction). With NaN in the last tensor, or a wrong shape in the last one, it is
refused whole: the engine is not ``partial``, serves the same greedy tokens at the
same weight version, and the same push with the fault repaired is accepted and
changes the tokens (so the refused push was one that would have applied).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvrunner import LLM, SamplingParams
from kvrunner.errors import WeightUpdateError
from kvrunner.models.tiny import write_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

#: Qwen3-8B's shape (the tiny tokenizer's vocabulary keeps the embedding small)
SHAPE = dict(hidden=4096, inter=12288, layers=36, heads=32, kv_heads=8, head_dim=128, vocab=512)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 60))]

Pairs = list[tuple[str, torch.Tensor]]


def write_config(path: Path) -> Path:
    """config.json and a tokenizer: the engine starts from them (``load_format="dummy"``)."""
    s = SHAPE
    path.mkdir(parents=True)
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "torch_dtype": "bfloat16", "hidden_size": s["hidden"],
        "intermediate_size": s["inter"], "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"],
        "head_dim": s["head_dim"], "hidden_act": "silu", "vocab_size": s["vocab"],
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "tie_word_embeddings": True, "attention_bias": False,
        "bos_token_id": 0, "eos_token_id": 0,
    }
    (path / "config.json").write_text(json.dumps(config))
    tiny = write_tiny_checkpoint(path / "_tok", kind="qwen3")
    shutil.copy(tiny / "tokenizer.json", path / "tokenizer.json")
    shutil.rmtree(tiny)
    return path


def trainer_push(seed: int) -> Pairs:
    """Every tensor of the 8B shape, bf16 on CUDA, in Hugging Face names (std 0.02)."""
    s, g = SHAPE, torch.Generator(device="cuda").manual_seed(seed)
    h, d = s["hidden"], s["head_dim"]

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device="cuda", dtype=torch.bfloat16)

    pairs: Pairs = [("model.embed_tokens.weight", w(s["vocab"], h))]
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        pairs += [
            (p + "self_attn.q_proj.weight", w(s["heads"] * d, h)),
            (p + "self_attn.k_proj.weight", w(s["kv_heads"] * d, h)),
            (p + "self_attn.v_proj.weight", w(s["kv_heads"] * d, h)),
            (p + "self_attn.o_proj.weight", w(h, s["heads"] * d)),
            (p + "self_attn.q_norm.weight", ones(d)),
            (p + "self_attn.k_norm.weight", ones(d)),
            (p + "mlp.gate_proj.weight", w(s["inter"], h)),
            (p + "mlp.up_proj.weight", w(s["inter"], h)),
            (p + "mlp.down_proj.weight", w(h, s["inter"])),
            (p + "input_layernorm.weight", ones(h)),
            (p + "post_attention_layernorm.weight", ones(h)),
        ]
    return [*pairs, ("model.norm.weight", ones(h))]


def nan_in_the_last_tensor(pairs: Pairs) -> Pairs:
    name, t = pairs[-1]
    bad = t.clone()
    bad.view(-1)[-1] = float("nan")
    return [*pairs[:-1], (name, bad)]


def wrong_shape_last(pairs: Pairs) -> Pairs:
    victim = "model.layers.35.mlp.down_proj.weight"
    t = dict(pairs)[victim]
    return [(n, x) for n, x in pairs if n != victim] + [(victim, t[:, :-1])]


FAULTS: dict[str, tuple[Callable[[Pairs], Pairs], str]] = {
    "NaN in the last tensor": (nan_in_the_last_tensor, "NaN or inf"),
    "wrong shape in the last tensor": (wrong_shape_last, "model.layers.35.mlp.down_proj"),
}


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    path = write_config(tmp_path_factory.mktemp("qwen3-8b") / "m")
    engine = LLM(model=str(path), load_format="dummy", dtype="bfloat16", max_num_seqs=8,
                 max_model_len=256, gpu_memory_utilization=0.45)
    yield engine
    engine.shutdown()


def served(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_a_refused_8b_update_leaves_the_old_weights_serving_and_the_repaired_one_applies(llm):
    before, version = served(llm), llm.weight_version
    push = trainer_push(seed=1)
    for fault, (change, why) in FAULTS.items():
        with pytest.raises(WeightUpdateError, match=why):
            llm.update_weights(change(push))
        assert llm.cache_info().weights == "resident", fault
        assert llm.weight_version == version, fault
        assert served(llm) == before, fault
    llm.update_weights(push)
    assert llm.cache_info().weights == "resident"
    assert served(llm) != before
