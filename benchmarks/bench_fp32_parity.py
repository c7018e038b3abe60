"""The engine in float32 against transformers in float32 on the GPU: logprob gaps.

A float32 engine and a float32 trainer should agree to a few ulps of fp32 (on the CPU
the GRPO example's gap is below 2.2e-7). This prints, for random checkpoints of two
shapes (the GRPO example's ``large`` policy, head_dim 64, and Qwen3-0.6B's, head
dim 128), the mean and max |engine - transformers| logprob per token of:

* prompt scoring (``prompt_logprobs``: the prefill path) and
* sampled tokens (the decode path, graphs),

under the default kernels and with each fused choice switched off in turn
(``skinny_gemm="off"``, eager: no graphs, ``deterministic``), and against
transformers' ``eager`` and ``sdpa`` attention. A gap near 1e-3 relative names the
path that leaves fp32.

    python benchmarks/bench_fp32_parity.py [grpo-large] [qwen3-0.6b]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from kvrunner import LLM, SamplingParams

PROMPTS, PROMPT_LEN, NEW = 8, 48, 16
#: the CPU runs it too (slowly): there the gaps are the CPU's
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def checkpoint(root: Path, name: str) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from bench_e2e_decode import write_checkpoint
    from grpo.policy import write_policy

    if name == "grpo-large":
        return write_policy(root / name, "large", seed=0)
    write_checkpoint(root / name, max_positions=1024)  # bf16 weights, loaded as fp32
    return root / name


def reference(path: Path, attn: str, prompts: list[list[int]], outs: list[list[int]]
              ) -> list[torch.Tensor]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=attn).to(DEVICE).eval()
    res = []
    with torch.no_grad():
        for p, o in zip(prompts, outs, strict=True):
            ids = torch.tensor([p + o], device=DEVICE)
            lp = torch.log_softmax(model(ids).logits[0].float(), -1)
            res.append(lp[torch.arange(len(p) + len(o) - 1, device=DEVICE), ids[0, 1:]].cpu())
    del model
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return res


def main(only: list[str] | None = None) -> None:
    print(f"{'checkpoint':<12}{'engine':<22}{'HF attn':<8}{'prefill mean':>13}{'max':>10}"
          f"{'decode mean':>13}{'max':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in only or ("grpo-large", "qwen3-0.6b"):
            path = checkpoint(Path(tmp), name)
            g = torch.Generator().manual_seed(0)
            vocab = 4096 if name == "grpo-large" else 150000
            prompts = torch.randint(10, vocab, (PROMPTS, PROMPT_LEN), generator=g).tolist()
            params = SamplingParams(max_tokens=NEW, temperature=1.0, seed=1, logprobs=0,
                                    prompt_logprobs=0, ignore_eos=True)
            for label, extra in (("default", {}), ("skinny_gemm off", {"skinny_gemm": "off"}),
                                 ("eager", {"enforce_eager": True}),
                                 ("deterministic", {"deterministic": True})):
                with LLM(str(path), dtype="float32", max_num_seqs=PROMPTS,
                         max_model_len=256, gpu_memory_utilization=0.3,
                         skip_tokenizer_init=True, **extra) as llm:
                    got = llm.generate(prompts, params)
                outs = [o.token_ids for o in got]
                for attn in ("eager", "sdpa") if label == "default" else ("sdpa",):
                    ref = reference(path, attn, prompts, outs)
                    pre, dec = [], []
                    for o, r in zip(got, ref, strict=True):
                        pre.append((torch.tensor(o.prompt_logprobs[1:]) - r[:PROMPT_LEN - 1]).abs())
                        dec.append((torch.tensor(o.logprobs) - r[PROMPT_LEN - 1:]).abs())
                    p, d = torch.cat(pre), torch.cat(dec)
                    print(f"{name:<12}{label:<22}{attn:<8}{p.mean():>13.2e}{p.max():>10.2e}"
                          f"{d.mean():>13.2e}{d.max():>10.2e}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or None)
