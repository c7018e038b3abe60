"""The RL numerics switches on the GPU: each one's effect on the trainer-rollout gap
and its cost (``fp32_lm_head``, ``fp32_router_logits``, ``dtype="float16"``), and the
same for FP8 weights and the FP8 KV cache (``quantization="fp8"``,
``kv_cache_dtype="fp8"``).

For a random checkpoint at Qwen3-0.6B's shape (bf16 weights, std 0.02) and a small
Qwen3-MoE (transformers' own initialisation, 64 experts, top 8), the engine samples
``NEW`` tokens for ``PROMPTS`` prompts with logprobs, and transformers on the same
weights rescores them, as a trainer does. Printed per variant: the mean and max
|engine - trainer| logprob per sampled token against transformers in the engine's
dtype (the trainer's usual mixed precision) and in float32 (the exact value), the
engine's rollout tokens/s (``ROLLOUT`` prompts) with its ratio to the bf16 default, and
the tokens its KV pool holds at the same ``gpu_memory_utilization``. The trainer stays
in bf16 for every variant: the FP8 rows are the gap FP8 rollouts add.

    python benchmarks/bench_numerics.py [dense] [moe]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

from kvrunner import LLM, SamplingParams

PROMPTS, PROMPT_LEN, NEW = 16, 64, 32
ROLLOUT, ROLLOUT_PROMPT, ROLLOUT_NEW = 256, 256, 128
VARIANTS = {
    "dense": (("bf16", "bfloat16", {}), ("bf16 + fp32_lm_head", "bfloat16",
                                         {"fp32_lm_head": True}), ("float16", "float16", {}),
              ("fp8 weights", "bfloat16", {"quantization": "fp8"}),
              ("fp8 kv cache", "bfloat16", {"kv_cache_dtype": "fp8"}),
              ("fp8 weights + kv cache", "bfloat16",
               {"quantization": "fp8", "kv_cache_dtype": "fp8"})),
    "moe": (("bf16", "bfloat16", {}), ("bf16 + fp32_lm_head", "bfloat16", {"fp32_lm_head": True}),
            ("bf16 + fp32_router_logits", "bfloat16", {"fp32_router_logits": True}),
            ("bf16 + both", "bfloat16", {"fp32_lm_head": True, "fp32_router_logits": True}),
            ("float16", "float16", {})),
}


def checkpoint(root: Path, name: str) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from kvrunner.models.tiny import write_tiny_checkpoint

    path = root / name
    if name == "dense":
        from bench_e2e_decode import write_checkpoint

        write_checkpoint(path, max_positions=1024)
        return path
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, moe_intermediate_size=384,
        num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
        num_experts=64, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        max_position_embeddings=1024, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    tok = write_tiny_checkpoint(root / "_tok", kind="qwen3")
    (path / "tokenizer.json").write_bytes((tok / "tokenizer.json").read_bytes())
    return path


def trainer_logprobs(path: Path, dtype: torch.dtype, seqs: list[list[int]],
                     start: int) -> torch.Tensor:
    """Each sequence's token logprobs from ``start`` on, from one transformers forward."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s], device="cuda")
            lp = torch.log_softmax(model(ids).logits[0].float(), -1)
            pos = torch.arange(start - 1, len(s) - 1, device="cuda")
            out.append(lp[pos, ids[0, start:]].cpu())
    del model
    torch.cuda.empty_cache()
    return torch.cat(out)


def rollout_tps(llm: LLM, vocab: int) -> float:
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(10, vocab, (ROLLOUT, ROLLOUT_PROMPT), generator=g).tolist()
    params = SamplingParams(max_tokens=ROLLOUT_NEW, temperature=1.0, seed=0, ignore_eos=True)
    llm.generate(prompts[:8], params)  # warm
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    torch.cuda.synchronize()
    return ROLLOUT * ROLLOUT_NEW / (time.perf_counter() - t0)


def main(only: list[str] | None = None) -> None:
    print(f"{'model':<7}{'variant':<28}{'vs same dtype mean':>19}{'max':>10}"
          f"{'vs fp32 mean':>14}{'max':>10}{'tok/s':>10}{'vs bf16':>9}{'kv tokens':>11}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in only or ("dense", "moe"):
            path = checkpoint(Path(tmp), name)
            g = torch.Generator().manual_seed(0)
            prompts = torch.randint(10, 150000, (PROMPTS, PROMPT_LEN), generator=g).tolist()
            params = SamplingParams(max_tokens=NEW, temperature=1.0, seed=1, logprobs=0,
                                    ignore_eos=True)
            fp32_ref: dict[tuple[int, ...], torch.Tensor] = {}
            base_tps = None
            for label, dtype, extra in VARIANTS[name]:
                with LLM(str(path), dtype=dtype, max_num_seqs=ROLLOUT, max_model_len=512,
                         gpu_memory_utilization=0.5, skip_tokenizer_init=True, **extra) as llm:
                    got = llm.generate(prompts, params)
                    tps = rollout_tps(llm, 150000)
                    info = llm.cache_info()
                    kv_tokens = info.num_blocks * info.block_size
                base_tps = base_tps or tps
                seqs = [p + o.token_ids for p, o in zip(prompts, got, strict=True)]
                engine = torch.tensor([lp for o in got for lp in o.logprobs])
                same = trainer_logprobs(path, getattr(torch, dtype), seqs, PROMPT_LEN)
                key = tuple(s[-1] for s in seqs)
                if key not in fp32_ref:
                    fp32_ref[key] = trainer_logprobs(path, torch.float32, seqs, PROMPT_LEN)
                exact = fp32_ref[key]
                d_same, d_exact = (engine - same).abs(), (engine - exact).abs()
                print(f"{name:<7}{label:<28}{d_same.mean():>19.2e}{d_same.max():>10.2e}"
                      f"{d_exact.mean():>14.2e}{d_exact.max():>10.2e}{tps:>10,.0f}"
                      f"{tps / base_tps:>9.3f}{kv_tokens:>11,}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or None)
