"""``weights_checksum()`` equals the trainer's digests of the tensors it pushed, with
the tensor-parallel shards merged, and a push into a TP=2 engine lands whole."""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file
from test_generate_hf_parity import NEW_TOKENS, PROMPTS

from kvrunner import SamplingParams
from kvrunner.weight_sync.checksum import tensor_digests

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, num_blocks=64,
              block_size=4)
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def digests(path, dtype: str) -> dict[str, str]:
    tensors = load_file(os.path.join(path, "model.safetensors"))
    return tensor_digests({k: v.to(getattr(torch, dtype)) for k, v in tensors.items()},
                          torch.float32)


def test_a_tp2_engines_checksum_merges_its_shards_into_the_checkpoints_digests(
    llm_tp2, checkpoints
) -> None:
    llm_tp2.load_weights(checkpoints.path(1))
    assert llm_tp2.weights_checksum() == digests(checkpoints.path(1), "float32")


def test_a_push_into_a_tp2_engine_generates_as_transformers_and_its_checksum_matches(
    llm_tp2, trainer, checkpoints
) -> None:
    address, authkey = trainer.start(path=checkpoints.path(2), dtype="bfloat16",
                                     bucket_bytes=512 * 64 * 4, order_seed=5)
    loaded = llm_tp2.update_weights_from_ipc(address, authkey=authkey, timeout_s=30)
    assert trainer.result() == ("pushed", loaded)
    assert [o.token_ids for o in llm_tp2.generate(PROMPTS, GREEDY)] == \
        checkpoints.expected(2, "bfloat16")
    checksum = llm_tp2.weights_checksum()
    assert checksum == digests(checkpoints.path(2), "bfloat16")
    assert checksum != digests(checkpoints.path(1), "float32")  # the digests see a change
