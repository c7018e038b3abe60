"""A push from a trainer process into FP8 weights: bf16 buckets over the IPC protocol
(shared memory on the CPU) are quantized as they land, into the same storages, and
give the bytes a start-up quantization of the same checkpoint gives."""

from __future__ import annotations

import torch

from kvrunner import LLM, SamplingParams
from kvrunner.models.tiny import write_tiny_checkpoint

SETTINGS = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, num_blocks=64,
                block_size=4, quantization="fp8")
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]


def fp8_state(llm: LLM) -> dict[str, torch.Tensor]:
    return {n: p.detach().view(torch.uint8).clone() if p.element_size() == 1 else p.clone()
            for n, p in llm.runner.model.named_parameters()}


def test_an_ipc_push_into_fp8_weights_quantizes_as_start_up_does(trainer, tmp_path) -> None:
    a = write_tiny_checkpoint(tmp_path / "a", kind="qwen3-blocks", seed=0)
    b = write_tiny_checkpoint(tmp_path / "b", kind="qwen3-blocks", seed=1)
    reference = LLM(model=str(b), **SETTINGS)
    llm = LLM(model=str(a), **SETTINGS)
    pointers = {n: p.data_ptr() for n, p in llm.runner.model.named_parameters()}
    address, authkey = trainer.start(path=b, dtype="float32", bucket_bytes=1 << 20,
                                     order_seed=5)
    loaded = llm.update_weights_from_ipc(address, authkey=authkey, timeout_s=30)
    assert trainer.result() == ("pushed", loaded)
    assert {n: p.data_ptr() for n, p in llm.runner.model.named_parameters()} == pointers
    ours, theirs = fp8_state(llm), fp8_state(reference)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert ([o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
            == [o.token_ids for o in reference.generate(PROMPTS, GREEDY)])
