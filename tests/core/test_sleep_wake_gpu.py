"""On CUDA: hundreds of sleep / wake / recapture cycles lose nothing, and the memory
really goes back to the device.

Each cycle sleeps (levels 1 and 2 alternating, every tenth discarding the weights
and pushing them again), wakes, recaptures with the audit on, and generates: the
answers equal the never-slept run's, no row is NaN, device memory after each wake (live
tensors) is within 1 MiB of the first wake, a level-1 sleep frees at least the pool's bytes and
a level-2 sleep at least 95% of what the engine held - and at least the pool's and
the weights' bytes even beside a colocated trainer's tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvrunner import LLM, SamplingParams
from kvrunner.models.loader import iter_safetensors
from kvrunner.models.tiny import write_tiny_checkpoint

pytestmark = pytest.mark.gpu

CYCLES = 200
MiB = 1 << 20
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 300 + 1 for j in range(5 + 3 * i)] for i in range(6)]
SETTINGS = dict(max_num_seqs=8, max_model_len=128, gpu_memory_utilization=0.3, audit=True)


def write_qwen3_0_6b_shape(path: Path) -> Path:
    """A random bf16 checkpoint shaped like Qwen3-0.6B (28 layers, hidden 1024)."""
    tiny = write_tiny_checkpoint(path, kind="qwen3")  # tokenizer and generation config
    h, inter, layers, heads, kv, d, vocab = 1024, 3072, 28, 16, 8, 128, 151936
    g = torch.Generator(device="cuda").manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=g) * 0.02).bfloat16().cpu()

    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    t = {"model.embed_tokens.weight": w(vocab, h), "model.norm.weight": ones(h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t |= {
            p + "self_attn.q_proj.weight": w(heads * d, h),
            p + "self_attn.k_proj.weight": w(kv * d, h),
            p + "self_attn.v_proj.weight": w(kv * d, h),
            p + "self_attn.o_proj.weight": w(h, heads * d),
            p + "self_attn.q_norm.weight": ones(d),
            p + "self_attn.k_norm.weight": ones(d),
            p + "mlp.gate_proj.weight": w(inter, h),
            p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
            p + "input_layernorm.weight": ones(h),
            p + "post_attention_layernorm.weight": ones(h),
        }
    save_file(t, str(tiny / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tiny / "config.json").read_text())
    config.pop("layer_types", None)  # all full attention, as the architecture's default
    config.update(
        hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=d, vocab_size=vocab,
        tie_word_embeddings=True, torch_dtype="bfloat16", max_position_embeddings=4096,
    )
    (tiny / "config.json").write_text(json.dumps(config))
    return tiny


def tokens(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def run_cycles(llm: LLM, path: str) -> None:
    """CYCLES sleep/wake rounds on ``llm``, checking answers, NaN and memory."""
    reference = tokens(llm)
    first_wake: list[int] | None = None
    for cycle in range(CYCLES):
        level = 1 + cycle % 2
        discard = cycle % 10 == 9
        llm.sleep(level, discard_weights=discard)
        for rank in llm.cache_info().ranks:
            freed, held = rank.last_freed_bytes, rank.device_bytes_before_sleep
            assert freed == held - rank.device_bytes_after_sleep > 0
            if level == 1:
                assert freed >= sum(rank.pool_bytes.values()), f"cycle {cycle}, rank {rank.rank}"
            else:
                assert freed >= 0.95 * held, f"cycle {cycle}, rank {rank.rank}: {freed / MiB} MiB"
        if discard:
            llm.wake_up(["weights"])
            llm.update_weights(iter_safetensors(Path(path), torch.float32))
            llm.wake_up(["kv_cache"])
        else:
            llm.wake_up()
        # Live bytes, not reserved ones: a level-2 wake reallocates the weights into
        # other allocator segments, which moves the reserved figure by a few MiB.
        after = [r.allocated_bytes_after_wake for r in llm.cache_info().ranks]
        first_wake = first_wake or after
        drift = [abs(a - f) for a, f in zip(after, first_wake, strict=True)]
        assert max(drift) <= MiB, f"cycle {cycle}: device memory after wake moved {drift} B"
        assert tokens(llm) == reference, f"cycle {cycle} (level {level}, discard {discard})"
    assert llm.executor.describe_ranks()[0]["nan_rows"] == 0


def test_200_cycles_of_tiny_qwen3_next(tmp_path) -> None:
    path = str(write_tiny_checkpoint(tmp_path / "next", kind="qwen3-next"))
    with LLM(model=path, dtype="float32", **SETTINGS) as llm:
        run_cycles(llm, path)


def test_200_cycles_of_the_qwen3_0_6b_shape(tmp_path) -> None:
    path = str(write_qwen3_0_6b_shape(tmp_path / "q06"))
    with LLM(model=path, dtype="bfloat16", **SETTINGS) as llm:
        run_cycles(llm, path)


def test_a_level_2_sleep_returns_the_weights_beside_a_colocated_trainers_tensors(tmp_path):
    """A colocated trainer's device tensors, allocated after the engine loaded (here a
    copy of every weight), do not keep the weights' memory reserved: a level-2 sleep
    returns at least the pool's and the weights' bytes, offloading or discarding."""
    path = write_qwen3_0_6b_shape(tmp_path / "q06")
    with LLM(model=str(path), dtype="bfloat16", **SETTINGS) as llm:
        reference = tokens(llm)
        trainer = [(n, t.cuda()) for n, t in iter_safetensors(path, torch.bfloat16)]
        for discard in (False, True):
            llm.sleep(2, discard_weights=discard)
            rank = llm.cache_info().ranks[0]
            released = sum(rank.pool_bytes.values()) + rank.weight_bytes
            assert rank.last_freed_bytes >= released, (
                f"discard={discard}: {(released - rank.last_freed_bytes) / MiB:.0f} MiB of "
                f"the pool and weights stayed reserved"
            )
            if discard:
                llm.wake_up(["weights"])
                llm.update_weights(trainer)
                llm.wake_up(["kv_cache"])
            else:
                llm.wake_up()
            assert tokens(llm) == reference, f"discard={discard}"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_200_cycles_at_tp2_on_two_gpus(tmp_path) -> None:
    path = str(write_tiny_checkpoint(tmp_path / "next", kind="qwen3-next"))
    with LLM(model=path, dtype="float32", tensor_parallel_size=2, **SETTINGS) as llm:
        run_cycles(llm, path)
