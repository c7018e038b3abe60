"""The RL numerics switches: ``fp32_lm_head`` runs the LM head's product in float32,
``fp32_router_logits`` the MoE routers', and ``dtype="float16"`` runs the whole model
in float16, which a float32 trainer's logprobs sit closer to than bf16's."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvrunner import LLM, SamplingParams
from kvrunner.layers.embedding import LMHead
from kvrunner.layers.moe import SparseMoeBlock
from kvrunner.layers.numerics import choose_numerics
from kvrunner.models.tiny import write_tiny_checkpoint

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_generate_hf_parity import save_hf_qwen3  # noqa: E402

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_blocks=64)


def test_an_fp32_lm_head_is_the_float32_product_of_the_bf16_rows_and_weight() -> None:
    torch.manual_seed(0)
    head = LMHead(300, 64, dtype=torch.bfloat16, device="cpu")
    head.weight.data.normal_(0, 1)
    hidden = torch.randn(5, 64).to(torch.bfloat16)
    bf16 = head(hidden)
    head.compute_dtype = torch.float32
    fp32 = head(hidden)
    assert fp32.dtype == torch.float32
    assert torch.equal(fp32, F.linear(hidden.float(), head.weight.float()))
    assert not torch.equal(fp32, bf16), "the switch must change the product's rounding"


def near_tie_router() -> tuple[SparseMoeBlock, torch.Tensor]:
    """A router whose experts 0 and 1 differ by less than bf16 resolves: in bf16 their
    logits round to one value, in float32 expert 1 is ahead."""
    block = SparseMoeBlock(hidden_size=4, num_experts=4, top_k=1, intermediate_size=8,
                           renormalize=True, dtype=torch.bfloat16, device="cpu")
    x = torch.tensor([[1.0, 1.0 / 256, 0.0, 0.0]], dtype=torch.bfloat16)
    weight = torch.zeros(4, 4)
    weight[0, 0] = 1.0
    weight[1, 0], weight[1, 1] = 1.0, 1.0  # logit 1 + 1/256: bf16 rounds it to 1.0
    weight[2, 0] = weight[3, 0] = -1.0
    block.gate.weight.data.copy_(weight)
    return block, x


def test_an_fp32_router_picks_the_expert_a_float32_trainer_picks() -> None:
    block, x = near_tie_router()
    bf16_logits = block.gate(x)
    assert bf16_logits[0, 0] == bf16_logits[0, 1], "in bf16 the two experts tie"
    block.router_dtype = torch.float32
    weights, fp32_ids = block.route(x)
    reference = torch.topk(torch.softmax(F.linear(x.float(), block.gate.weight.float()), -1), 1)
    assert fp32_ids.tolist() == reference.indices.int().tolist() == [[1]]
    assert weights.dtype == torch.bfloat16


def test_choose_numerics_sets_every_head_and_router_and_unsets_them() -> None:
    block, _ = near_tie_router()
    model = torch.nn.ModuleList([block, LMHead(8, 4, dtype=torch.bfloat16, device="cpu")])
    choose_numerics(model, fp32_lm_head=True, fp32_router_logits=True)
    assert block.router_dtype is torch.float32 and model[1].compute_dtype is torch.float32
    choose_numerics(model, fp32_lm_head=False, fp32_router_logits=False)
    assert block.router_dtype is None and model[1].compute_dtype is None


def head_io(llm: LLM) -> list[tuple[torch.Tensor, torch.Tensor]]:
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    head = llm.runner.model.lm_head
    head.register_forward_hook(lambda _m, args, out: seen.append((args[0].clone(), out.clone())))
    llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    return seen


@pytest.mark.parametrize("fp32_lm_head", [False, True])
def test_an_engine_computes_its_logits_as_the_switch_says(tmp_path, fp32_lm_head: bool) -> None:
    path = write_tiny_checkpoint(tmp_path / "m", kind="qwen3", seed=0)
    with LLM(model=str(path), dtype="bfloat16", fp32_lm_head=fp32_lm_head,
             enforce_eager=True, **ENGINE) as llm:
        weight = llm.runner.model.lm_head.weight
        calls = head_io(llm)
    assert calls, "the LM head was never called"
    for hidden, logits in calls:
        fp32 = F.linear(hidden.float(), weight.float())
        bf16 = F.linear(hidden, weight).float()
        assert torch.equal(logits.float(), fp32 if fp32_lm_head else bf16)


def test_an_engine_routes_as_the_switch_says(tmp_path) -> None:
    path = write_tiny_checkpoint(tmp_path / "m", kind="qwen3-moe", seed=0)
    with LLM(model=str(path), dtype="bfloat16", fp32_router_logits=True, enforce_eager=True,
             **ENGINE) as llm:
        blocks = [m for m in llm.runner.model.modules() if isinstance(m, SparseMoeBlock)]
        assert all(block.router_dtype is torch.float32 for block in blocks)
        seen: list[tuple[SparseMoeBlock, torch.Tensor, torch.Tensor]] = []
        for block in blocks:
            block.experts.register_forward_hook(
                lambda _m, args, _out, b=block: seen.append((b, args[0].clone(), args[2].clone())))
        llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=3, temperature=0,
                                                       ignore_eos=True))
    assert blocks and len(seen) >= len(blocks)
    for block, x, ids in seen:
        probs = torch.softmax(F.linear(x.float(), block.gate.weight.float()), -1)
        assert torch.equal(ids.long(), torch.topk(probs, block.top_k).indices)


def prompt_logprob_gap(path: Path, dtype: str, reference: torch.Tensor,
                       seqs: list[list[int]]) -> float:
    with LLM(model=str(path), dtype=dtype, **ENGINE) as llm:
        outs = llm.generate(seqs, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0))
    engine = torch.tensor([lp for o in outs for lp in o.prompt_logprobs[1:]])
    return (engine - reference).abs().mean().item()


def test_a_float16_engine_sits_closer_to_a_float32_trainer_than_a_bf16_one(tmp_path) -> None:
    path = tmp_path / "hf"
    save_hf_qwen3(path, tie=False, seed=1)
    tiny = write_tiny_checkpoint(tmp_path / "tok", kind="qwen3", seed=0)
    shutil.copy(tiny / "tokenizer.json", path / "tokenizer.json")
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 512, (40,), generator=gen).tolist() for _ in range(4)]
    trainer = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = torch.cat([
            torch.log_softmax(trainer(torch.tensor([s])).logits[0], -1)[
                torch.arange(len(s) - 1), torch.tensor(s[1:])]
            for s in seqs
        ])
    fp16 = prompt_logprob_gap(path, "float16", reference, seqs)
    bf16 = prompt_logprob_gap(path, "bfloat16", reference, seqs)
    # float16 keeps 10 mantissa bits to bf16's 7: measured 2.5e-3 against 1.6e-2
    assert fp16 < bf16 / 3, (fp16, bf16)
