"""A call that needs an idle engine, refused while requests are unfinished, says which
call was refused, which requests hold it, why, and what to do; nothing changes."""

from __future__ import annotations

import re

import pytest
import safetensors.torch

from kvrunner import LLM, SamplingParams
from kvrunner.errors import SleepStateError
from kvrunner.models.tiny import write_tiny_checkpoint

SMALL = dict(max_num_seqs=4, max_model_len=64, block_size=4, num_blocks=64, enforce_eager=True)
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("idle") / "m")


def queue(llm: LLM, prompts: list[list[int]]) -> list[int]:
    """Requests queued on the engine and never stepped: unfinished."""
    ids = []
    for i, prompt in enumerate(prompts):
        for seq in llm.engine.make_group(prompt, GREEDY, i):
            llm.engine.add_request(seq)
            ids.append(seq.seq_id)
    return ids


def test_each_refused_call_names_itself_the_requests_why_and_the_way_out(checkpoint) -> None:
    tensors = safetensors.torch.load_file(str(checkpoint / "model.safetensors"))
    name = "model.norm.weight"
    with LLM(str(checkpoint), **SMALL) as llm:
        reference = [o.token_ids for o in llm.generate([[5, 6, 7]], GREEDY)]
        (one,) = queue(llm, [[5, 6, 7]])
        with pytest.raises(SleepStateError) as refused:
            llm.update_weights([(name, tensors[name])])
        assert str(refused.value) == (
            f"update_weights() refused: request {one} is unfinished, and an unfinished "
            f"request's KV was computed under the weights it replaces; finish or abort the "
            f"requests first (LLMEngine.abort_request), or park them with their KV "
            f"(AsyncLLM.pause(mode='keep'))"
        )
        more = queue(llm, [[8, 9], [10, 11, 12]])
        with pytest.raises(SleepStateError, match=re.escape(
            f"sleep() refused: 3 requests are unfinished ({one}, {more[0]}, {more[1]}), and "
            f"a sleep frees the KV cache an unfinished request holds; finish or abort the "
            f"requests first (LLMEngine.abort_request)") + "$"):
            llm.sleep(level=1)
        with pytest.raises(SleepStateError, match=r"^reset_prefix_cache\(\) refused: 3 "
                                                  r"requests are unfinished .*blocks of the cache"):
            llm.reset_prefix_cache()
        with pytest.raises(SleepStateError, match=r"^load_weights\(\) refused"):
            llm.load_weights(str(checkpoint))
        # Refused means untouched: the requests are still there, and once aborted the
        # same calls work and the engine answers as before.
        assert llm.engine.scheduler.unfinished_ids() == [one, *more]
        for seq_id in (one, *more):
            llm.engine.abort_request(seq_id)
        llm.update_weights([(name, tensors[name])])
        llm.sleep(level=1)
        llm.wake_up()
        assert [o.token_ids for o in llm.generate([[5, 6, 7]], GREEDY)] == reference
